"""Pictures of traffic control and utilisation (re-exported by ``simulator.report.plots``).

- ``plot_cluster``: from the cluster rows of ``timeseries.csv`` (``replica`` -1, see
  ``report.traffic``), one column per run: offered load (first attempts and retries)
  against accepted and completed load, the fleet's size (ready, provisioning,
  draining), and SLO attainment and P99 TTFT per window;
- ``plot_utilization_curve``: request throughput, busy fraction and MFU against offered
  load from a table of runs (one row per run), one colour per group (e.g. policy).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from simulator.errors import LatsimError
from simulator.report.plotkit import new_figure, policy_color, save

CLUSTER_ROW = -1


def cluster_frames(results) -> dict[str, pd.DataFrame]:
    """``run -> its cluster rows`` for the runs of ``results`` (a ``plots.Results`` or a
    mapping of run names to ``Run`` or time-series tables) that have them."""
    out = {}
    for k, v in results.items():
        ts = getattr(v, "timeseries", v)
        if isinstance(ts, pd.DataFrame) and "replica" in ts and "offered_rps" in ts:
            rows = ts[ts["replica"] == CLUSTER_ROW]
            if len(rows):
                out[k] = rows.sort_values("time")
    return out


def plot_cluster(results, path: Optional[Path] = None) -> Figure:
    """Offered vs accepted load, replicas and SLO attainment over time (module doc);
    raises ``LatsimError`` when no run has cluster rows."""
    frames = cluster_frames(results)
    if not frames:
        raise LatsimError("no cluster rows to plot (timeseries.csv from a run with traffic "
                          "control: cluster.admission, client, cluster.autoscaler or "
                          "report.utilization)")
    fig, axes = new_figure(3, len(frames), (5.2, 2.4), sharex=True)
    for j, (name, c) in enumerate(frames.items()):
        t = c["time"].to_numpy(float) / 60.0
        ax = axes[0][j]
        ax.step(t, c["offered_rps"], where="pre", color="#d62728", lw=1.3,
                label="offered (with retries)")
        ax.step(t, c["first_rps"], where="pre", color="#8c8c8c", lw=1.0, ls="--",
                label="first attempts")
        ax.step(t, c["accepted_rps"], where="pre", color="#1f77b4", lw=1.3, label="accepted")
        ax.step(t, c["completed_rps"], where="pre", color="#2ca02c", lw=1.0, label="completed")
        ax.set_ylabel("requests/s")
        ax.set_title(f"{name}: load", fontsize=10)
        ax.legend(fontsize=7, loc="upper right")
        ax = axes[1][j]
        ready = c["replicas_ready"].to_numpy(float)
        prov = c["replicas_provisioning"].to_numpy(float)
        drain = c["replicas_draining"].to_numpy(float)
        ax.stackplot(t, ready, prov, drain, step="pre", labels=["ready", "provisioning",
                                                                  "draining"],
                     colors=["#1f77b4", "#ff7f0e", "#9467bd"], alpha=0.8)
        for col, color, label in (("replicas_down", "#d62728", "down (faults)"),
                                  ("breakers_open", "#000000", "breaker open")):
            if col in c and c[col].notna().any():     # a run with cluster.faults / breaker
                ax.step(t, c[col].to_numpy(float), where="pre", color=color, lw=1.3,
                        ls="--" if col == "breakers_open" else "-", label=label)
        ax.set_ylabel("replicas (window mean)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{name}: fleet", fontsize=10)
        ax.legend(fontsize=7, loc="upper right")
        ax = axes[2][j]
        ax.step(t, c["slo_attainment"] * 100.0, where="pre", color=policy_color(str(name)),
                lw=1.4, label="SLO attainment (%)")
        ax.set_ylim(0, 105)
        ax.set_ylabel("SLO attainment (%)")
        ax.set_xlabel("simulated time (min)")
        ax2 = ax.twinx()
        ax2.step(t, c["p99_ttft_ms"], where="pre", color="#7f7f7f", lw=0.9, ls=":",
                 label="P99 TTFT (ms)")
        ax2.set_yscale("log")
        ax2.set_ylabel("P99 TTFT (ms)")
        ax.set_title(f"{name}: requests first sent in each window", fontsize=10)
        for a in (axes[0][j], axes[1][j], ax):
            a.grid(alpha=0.3)
    fig.suptitle("Offered vs accepted load, fleet size and SLO attainment over time",
                 fontsize=13)
    return save(fig, path)


def plot_utilization_curve(df: pd.DataFrame, x: str = "offered_rps", group: str = "policy",
                           path: Optional[Path] = None,
                           labels: Optional[Mapping[str, str]] = None) -> Figure:
    """Throughput (completed req/s), busy fraction and MFU against ``x``, one line per
    ``group`` value, from a table with columns ``x``, ``group``, ``request_throughput``,
    ``busy_frac_mean`` and ``mfu_mean`` (a missing column leaves its panel empty)."""
    for c in (x, group, "request_throughput"):
        if c not in df:
            raise LatsimError(f"table has no column {c!r}; columns: {', '.join(df)}")
    panels = (("request_throughput", "throughput (req/s)", 1.0),
              ("busy_frac_mean", "busy fraction (%)", 100.0), ("mfu_mean", "MFU (%)", 100.0))
    fig, axes = new_figure(1, len(panels), (4.4, 3.6))
    for name, g in df.groupby(group, sort=False):
        g = g.sort_values(x)
        label = (labels or {}).get(str(name), str(name))
        for ax, (col, ylab, mult) in zip(axes[0], panels):
            if col in g and g[col].notna().any():
                ax.plot(g[x], g[col].astype(float) * mult, marker="o", ms=3.5, lw=1.4,
                        color=policy_color(str(name)), label=label)
    xs = np.sort(df[x].unique())
    axes[0][0].plot(xs, xs, color="black", lw=0.8, ls=":", label="offered = served")
    for ax, (_col, ylab, _m) in zip(axes[0], panels):
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel(ylab)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Throughput and GPU use against offered load", fontsize=12)
    return save(fig, path)
