"""Pictures of latsim results, for people who would rather look than read.

The public API (every figure is a ``matplotlib.figure.Figure`` on the Agg canvas: no
pyplot state, no GUI; pass ``path`` to also write it as a PNG):

- ``load_results(dir)``: a run folder (``requests[-<policy>].csv``, ``timeseries*.csv``,
  ``summary.json``) as ``Results``, a dict ``policy -> Run(requests, timeseries, summary)``;
- ``plot_latency_cdfs``: TTFT, TPOT and E2E CDFs per policy, overall and per priority
  class, with P50 and P99 marked;
- ``plot_breakdown``: the additive E2E breakdown (T_net, T_queue, T_prefill, T_decode,
  T_stream) of the typical P50 and P99 request, per policy (see ``breakdown_at``);
- ``plot_timeseries``: queue length, running batch and KV-cache use over time per replica;
- ``plot_load_curve``: P50/P99 TTFT and TPOT against offered load from a sweep table,
  one colour per policy, the knee marked (see ``find_knee``);
- ``plot_fidelity``: simulated vs real latency CDFs and the P50/P99 errors;
- ``plot_cluster``: offered vs accepted load, replicas and SLO attainment over time
  (runs with traffic control; ``plots_traffic``);
- ``plot_utilization_curve``: throughput, busy fraction and MFU against offered load;
- ``plot_run(dir)``: every plot that fits what the folder holds, written next to it.

Also public: ``read_requests`` (one per-request CSV), ``breakdown_at``, ``find_knee``,
``load_knees``, ``fidelity_errors``, ``sweep_axes`` and ``plot_sweep`` (a sweep table's
load curve). The drawing helpers (CDF panel, stacked bars, colours, units) live in
``simulator.report.plotkit``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Union

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator

from simulator.errors import LatsimError
from simulator.report.metrics import add_derived
from simulator.report.plotkit import (LATENCIES, LOAD_LABELS, STAGES, binned, blank_figure, cdf_panel,
                      fidelity_errors, find_knee, finished, fmt, fmt_time, new_figure,
                      policy_color, save, stacked_bars, sweep_axes)
from simulator.report.plots_traffic import (cluster_frames, plot_cluster,  # noqa: F401
                                           plot_utilization_curve)
from simulator.report.readers import (check_requests, check_sweep, check_timeseries, is_there,
                                      read_summary, read_table)

__all__ = ["Run", "Results", "read_requests", "load_results", "plot_latency_cdfs",
           "breakdown_at", "plot_breakdown", "plot_timeseries", "find_knee", "load_knees",
           "plot_load_curve", "fidelity_errors", "plot_fidelity", "plot_run", "sweep_axes",
           "plot_sweep", "plot_cluster", "plot_utilization_curve"]


@dataclass
class Run:
    """One policy's results: per-request table, time series (or None) and summary."""

    requests: pd.DataFrame
    timeseries: Optional[pd.DataFrame] = None
    summary: dict = field(default_factory=dict)


class Results(dict):
    """``policy -> Run`` in the order the policies ran; ``path`` is the folder read."""

    def __init__(self, runs: Mapping[str, Run], path: Optional[Path] = None) -> None:
        super().__init__(runs)
        self.path = path

    @property
    def policies(self) -> list[str]:
        """The policies, in run order."""
        return list(self)


RunsLike = Union[Results, Mapping[str, Run], Mapping[str, pd.DataFrame], pd.DataFrame]


def _read_csv(p: Path, what: str = "table") -> pd.DataFrame:
    return read_table(p, what)


def _read_series(p: Path) -> Optional[pd.DataFrame]:
    """A time series, checked (``readers.check_timeseries``); None when absent."""
    return check_timeseries(p, _read_csv(p, "time series")) if is_there(p) else None


def read_requests(p: Union[str, Path]) -> pd.DataFrame:
    """A per-request table (requests.csv, validate's real-/sim-<policy>.csv); the derived
    latency columns are computed from the timestamps if the file lacks them."""
    df = _read_csv(Path(p), "per-request table")
    if df.empty:
        raise LatsimError("no requests in it", source=str(p))
    # Times and latencies as numbers a run can hold (``readers.check_requests``).
    check_requests(p, df)
    if not {"ttft", "tpot", "e2el"} <= set(df.columns):
        need = {"arrival", "enqueued", "scheduled", "first_token", "last_token",
                "first_delivered", "last_delivered", "output_tokens"}
        if not need <= set(df.columns):
            raise LatsimError("not a per-request table: needs ttft, tpot, e2el or the "
                              f"timestamps ({', '.join(sorted(need))})", source=str(p))
        add_derived(df)
        check_requests(f"{p} (latencies from its timestamps)", df)
    return df


def load_results(results_dir: Union[str, Path]) -> Results:
    """Read what ``latsim run --out DIR`` wrote: one ``Run`` per policy.

    A single run has ``requests.csv`` (policy named by summary.json); a comparison has
    ``requests-<policy>.csv``. ``timeseries`` is None when its file is missing. Raises
    ``LatsimError`` if the folder or its request tables are missing."""
    d = Path(results_dir)
    if not d.is_dir():
        raise LatsimError("results folder not found", source=str(d))
    summary = read_summary(d / "summary.json") if is_there(d / "summary.json") else {}
    runs: dict[str, Run] = {}
    if is_there(d / "requests.csv"):
        name = str(summary.get("policy", "run"))
        runs[name] = Run(read_requests(d / "requests.csv"), _read_series(d / "timeseries.csv"),
                         summary)
    else:
        files = {p.name[len("requests-"):-4]: p for p in sorted(d.glob("requests-*.csv"))}
        order = [k for k in summary if k in files] + [k for k in files if k not in summary]
        for k in order:
            runs[k] = Run(read_requests(files[k]), _read_series(d / f"timeseries-{k}.csv"),
                          summary.get(k, {}))
    if not runs:
        raise LatsimError("no requests.csv or requests-<policy>.csv here (is it a "
                          "`latsim run --out` folder?)", source=str(d))
    return Results(runs, d)


def _tables(results: RunsLike) -> dict[str, pd.DataFrame]:
    if isinstance(results, pd.DataFrame):
        return {"run": results}
    return {k: (v.requests if isinstance(v, Run) else v) for k, v in results.items()}


def plot_latency_cdfs(results: RunsLike, path: Optional[Path] = None, *,
                      by_class: bool = True) -> Figure:
    """CDFs of TTFT, TPOT and E2E latency (columns), one curve per policy.

    The first row is all finished requests; with ``by_class`` and more than one
    priority class, one more row per class. The y axis is on a logit scale so the
    tail is as readable as the median; P50 (circle) and P99 (triangle) are marked on
    every curve and their values are in the legend."""
    tables = {k: finished(v) for k, v in _tables(results).items()}
    classes = sorted({c for df in tables.values() if "class" in df for c in df["class"].unique()},
                     key=str)
    rows = [("all requests", None)]
    if by_class and len(classes) > 1:
        rows += [(f"class {c}", c) for c in classes]
    fig, axes = new_figure(len(rows), len(LATENCIES), (4.6, 3.1))
    for i, (label, cls) in enumerate(rows):
        for j, (col, name, _) in enumerate(LATENCIES):
            series = {k: df.loc[df["class"] == cls, col] if cls is not None else df[col]
                      for k, df in tables.items()}
            cdf_panel(axes[i][j], series, name, f"{name}: {label}")
    fig.suptitle("Latency CDFs (circle: P50, triangle: P99)", fontsize=13)
    return save(fig, path)


def breakdown_at(requests: pd.DataFrame, q: float, width: float = 0.005,
                 min_requests: int = 10) -> pd.Series:
    """The E2E breakdown (seconds per stage) of the typical request at percentile ``q``.

    A percentile of E2E is one number; the stages are not additive across separate
    percentiles (P99 T_queue + P99 T_decode is not P99 E2E). So the breakdown "at P99"
    is the mean of each stage over the finished requests whose E2E rank lies within
    ``q +- width`` (default: P98.5-P99.5), or the ``min_requests`` ranked nearest to
    ``q`` if that window holds fewer. The stages of those requests add up to their
    mean E2E, which is close to the E2E percentile. ``q`` is in [0, 1]."""
    fin = finished(requests)
    if fin.empty:
        return pd.Series(np.nan, index=list(STAGES) + ["e2el", "n"])
    e2e = fin["e2el"].to_numpy(dtype=float)
    order = np.argsort(e2e, kind="stable")
    rank = np.empty(len(e2e))
    rank[order] = (np.arange(len(e2e)) + 0.5) / len(e2e)
    dist = np.abs(rank - q)
    sel = dist <= width
    if sel.sum() < min(min_requests, len(e2e)):
        sel = np.zeros(len(e2e), bool)
        sel[np.argsort(dist, kind="stable")[:min_requests]] = True
    out = fin.loc[sel, list(STAGES) + ["e2el"]].mean()
    out["n"] = int(sel.sum())
    return out


def plot_breakdown(results: RunsLike, path: Optional[Path] = None, *,
                   quantiles: tuple[float, ...] = (0.5, 0.99)) -> Figure:
    """Stacked horizontal bars of the E2E breakdown at P50 and P99 (one column each),
    one bar per policy; "breakdown at Pq" is defined in ``breakdown_at``. The top row
    stacks all five stages (ending at the E2E of those requests, the E2E percentile
    itself noted); the bottom row zooms into the stages other than T_decode, which
    usually dwarfs them. Segments wide enough are labelled with their value."""
    tables = _tables(results)
    fig, axes = new_figure(2, len(quantiles), (6.4, 0.6 * len(tables) + 1.4))
    others = tuple(s for s in STAGES if s != "t_decode")
    for j, q in enumerate(quantiles):
        bd = {k: breakdown_at(df, q) for k, df in tables.items()}
        fin = {k: finished(df)["e2el"] for k, df in tables.items()}
        note = {k: f"P{q * 100:g} E2E {fmt_time(np.percentile(e, q * 100)) if len(e) else 'n/a'}"
                for k, e in fin.items()}
        lo, hi = f"P{(q - .005) * 100:g}", f"P{(q + .005) * 100:g}"
        stacked_bars(axes[0][j], bd, STAGES, note)
        axes[0][j].set_title(f"E2E breakdown at P{q * 100:g} (requests ranked {lo}-{hi})",
                             fontsize=10)
        stacked_bars(axes[1][j], bd, others, {})
        axes[1][j].set_title(f"Zoom: all but T_decode at P{q * 100:g}", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(STAGES), fontsize=9)
    fig.suptitle("Where end-to-end latency goes, per policy", fontsize=13)
    return save(fig, path)


def plot_timeseries(results: Union[Results, Mapping[str, Run], Mapping[str, pd.DataFrame]],
                    path: Optional[Path] = None, *, max_points: int = 1500,
                    max_replicas: int = 4) -> Figure:
    """Queue length, running batch size and KV-cache blocks reserved (% of capacity)
    over simulated time: one column per replica (the first ``max_replicas``), one line
    per policy. Long series are binned to ``max_points`` (mean of the samples per bin)."""
    series = {k: (v.timeseries if isinstance(v, Run) else v) for k, v in results.items()}
    series = {k: v for k, v in series.items() if v is not None and len(v)}
    if not series:
        raise LatsimError("no time series to plot (timeseries.csv missing or empty)")
    n_rep = int(max(s["replica"].max() for s in series.values())) + 1
    shown = min(n_rep, max_replicas)
    rows = (("waiting", "queue length (requests)", 1.0),
            ("running", "running batch (requests)", 1.0),
            ("kv_reserved_frac", "KV cache reserved (%)", 100.0))
    fig, axes = new_figure(len(rows), shown, (9.0 / min(shown, 2), 2.3), sharex=True)
    for r in range(shown):
        for k, ts in series.items():
            t = binned(ts[ts["replica"] == r], [c for c, _, _ in rows], max_points)
            for i, (col, label, mult) in enumerate(rows):
                if col in t:
                    axes[i][r].plot(t["time"], t[col] * mult, color=policy_color(k), lw=1.0,
                                    label=k, drawstyle="steps-post")
        for i, (col, label, _) in enumerate(rows):
            ax = axes[i][r]
            ax.set_ylabel(label)
            ax.set_title(f"{label.split(' (')[0]}: replica {r}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        axes[-1][r].set_xlabel("simulated time (s)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if len(series) > 1:
        fig.legend(handles, labels, loc="outside lower center", ncol=len(series), fontsize=9)
    more = f", replicas 0-{shown - 1} of {n_rep}" if n_rep > shown else ""
    one = f", policy {next(iter(series))}" if len(series) == 1 else ""
    fig.suptitle(f"Queue, batch and KV cache over time{one}{more}", fontsize=13)
    return save(fig, path)


def load_knees(df: pd.DataFrame, x: str, group: Optional[str] = "engine.policy",
               knee_factor: float = 3.0) -> dict:
    """``{group value: knee load or None}`` of a sweep table: ``find_knee`` of the
    seed-averaged P99 TTFT against ``x`` (one entry ``"all"`` without a group)."""
    groups = df.groupby(group, sort=False) if group else [("all", df)]
    out = {}
    for name, g in groups:
        s = g.groupby(x)["p99_ttft_ms"].mean().sort_index()
        out[name] = find_knee(s.index, s.to_numpy(), knee_factor)
    return out


def plot_load_curve(df: pd.DataFrame, x: str = "workload.arrival.rate",
                    group: Optional[str] = "engine.policy", path: Optional[Path] = None, *,
                    knee_factor: float = 3.0, xlabel: Optional[str] = None) -> Figure:
    """P50 (solid) and P99 (dashed) TTFT and TPOT against load, one colour per ``group``
    value (e.g. policy), from a tidy sweep table (one row per point and seed, metric
    columns ``median_/p99_<ttft|tpot>_ms``). Seeds are averaged, their min-max shaded.
    The knee (``load_knees``: the lowest load where P99 TTFT exceeds ``knee_factor``
    times its lowest-load value) is a star on the P99 TTFT curve and a dotted line."""
    for c in [x, "median_ttft_ms", "p99_ttft_ms"] + ([group] if group else []):
        if c not in df:
            raise LatsimError(f"sweep table has no column {c!r}; columns: {', '.join(df)}")
    label, unit = LOAD_LABELS.get(x, (x, ""))
    knees = load_knees(df, x, group, knee_factor)
    fig, axes = new_figure(1, 2, (5.6, 4.2))
    handles = []
    for name, g in (df.groupby(group, sort=False) if group else [("all", df)]):
        color = policy_color(str(name))
        for ax, m in zip(axes[0], ("ttft", "tpot")):
            for key, ls, mk in (("median", "-", "o"), ("p99", "--", "^")):
                col = f"{key}_{m}_ms"
                if col not in g:
                    continue
                s = g.groupby(x)[col].agg(["mean", "min", "max"]).sort_index()
                ax.plot(s.index, s["mean"], ls, marker=mk, ms=4, color=color,
                        label=f"{name} {'P50' if key == 'median' else 'P99'}")
                if (s["max"] > s["min"]).any():
                    ax.fill_between(s.index, s["min"], s["max"], color=color, alpha=0.12, lw=0)
        knee = knees[name]
        if knee is not None:
            for ax in axes[0]:
                ax.axvline(knee, color=color, ls=":", lw=1.4, label="_knee")
            y = g.groupby(x)["p99_ttft_ms"].mean().loc[knee]
            axes[0][0].scatter([knee], [y], marker="*", s=160, color=color, zorder=4,
                               edgecolor="black", linewidth=0.6)
        handles.append(Line2D([], [], color=color, lw=2, label=f"{name}: knee " + (
            f"{knee:g}{unit}" if knee is not None else "not reached")))
    handles += [Line2D([], [], color="black", ls="-", marker="o", ms=4, label="P50"),
                Line2D([], [], color="black", ls="--", marker="^", ms=4, label="P99")]
    for ax, name in zip(axes[0], ("TTFT", "TPOT")):
        if name == "TTFT":
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,g}"))
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel(xlabel or label)
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} P50 / P99 vs {'load' if x in LOAD_LABELS else x}", fontsize=10)
        ax.grid(alpha=0.3, which="major")
        ax.legend(handles=handles, fontsize=7, loc="upper left")
    what = "load" if x in LOAD_LABELS else x
    fig.suptitle(f"Latency vs {what} (star, dotted line: knee, where P99 TTFT first exceeds "
                 f"{knee_factor:g}x its value at the lowest {what})", fontsize=11)
    return save(fig, path)


def plot_fidelity(real_df: pd.DataFrame, sim_df: pd.DataFrame, path: Optional[Path] = None,
                  *, title: Optional[str] = None) -> Figure:
    """Simulated vs real: CDFs of TTFT, TPOT and E2E overlaid (top row) and the
    relative error of P50 and P99 of each (bottom, bars; see ``fidelity_errors``)."""
    fig = blank_figure((13.5, 7.2))
    gs = fig.add_gridspec(2, 3, height_ratios=(1.2, 1))
    tables = {"real": finished(real_df), "sim": finished(sim_df)}
    for j, (col, name, _) in enumerate(LATENCIES):
        ax = fig.add_subplot(gs[0, j])
        cdf_panel(ax, {k: df[col] for k, df in tables.items()}, name, f"{name}: real vs sim")
    ax = fig.add_subplot(gs[1, :])
    err = fidelity_errors(real_df, sim_df)
    xs = np.arange(len(LATENCIES))
    for i, (p, color) in enumerate((("P50", "#4c72b0"), ("P99", "#dd8452"))):
        e = err[err["percentile"] == p]
        v = e["error_pct"].to_numpy(float)
        bars = ax.bar(xs + (i - 0.5) * 0.4, np.nan_to_num(v), 0.34, color=color, label=p)
        ax.bar_label(bars, [f"{x:+.1f}%\n{fmt(r)} → {fmt(s)} ms" if np.isfinite(x) else "n/a"
                            for x, r, s in zip(v, e["real_ms"], e["sim_ms"])], fontsize=8,
                     padding=2)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(xs, [n for _, n, _ in LATENCIES])
    e = err["error_pct"].to_numpy(float)
    e = e[np.isfinite(e)]
    ax.set_ylim(min(-10.0, e.min(initial=0) * 1.45), max(10.0, e.max(initial=0) * 1.45))
    ax.set_ylabel("error of sim vs real (%)")
    ax.set_title("Relative error (sim - real) / real of P50 and P99 (labels: real → sim)",
                 fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=9)
    fig.suptitle(title or "Simulator fidelity: simulated vs real engine", fontsize=13)
    return save(fig, path)


def plot_run(out_dir: Union[str, Path]) -> list[Path]:
    """Write every plot the folder's files allow, next to them, and return the PNGs.

    ``requests*.csv`` -> ``latency_cdfs.png``, ``breakdown.png`` and (with time series)
    ``timeseries.png``, and with cluster rows (traffic control) ``cluster.png``; a sweep table (``results.csv`` with ``sweep.yaml``, or
    ``sweep.csv``) -> ``load_curve.png``; ``validate/real-<policy>.csv``
    with ``validate/sim-<policy>.csv`` -> ``validate/fidelity-<policy>.png``. Raises
    ``LatsimError`` when the folder is missing or holds none of these."""
    d = Path(out_dir)
    if not d.is_dir():
        raise LatsimError("results folder not found", source=str(d))
    written: list[Path] = []
    if is_there(d / "requests.csv") or any(d.glob("requests-*.csv")):
        res = load_results(d)
        for name, fn in (("latency_cdfs", plot_latency_cdfs), ("breakdown", plot_breakdown)):
            fn(res, d / f"{name}.png")
            written.append(d / f"{name}.png")
        if any(r.timeseries is not None and len(r.timeseries) for r in res.values()):
            plot_timeseries(res, d / "timeseries.png")
            written.append(d / "timeseries.png")
        if cluster_frames(res):
            plot_cluster(res, d / "cluster.png")
            written.append(d / "cluster.png")
    for name in ("sweep.csv", "results.csv"):
        if is_there(d / name) and (name == "sweep.csv" or is_there(d / "sweep.yaml")):
            written.append(plot_sweep(d / name, d / "load_curve.png"))
            break
    for vd in (d / "validate", d):
        for real in sorted(vd.glob("real-*.csv")):
            sim = vd / f"sim-{real.name[5:]}"
            if is_there(sim):
                p = vd / f"fidelity-{real.name[5:-4]}.png"
                plot_fidelity(read_requests(real), read_requests(sim), p,
                              title=f"Simulator fidelity, policy {real.name[5:-4]}")
                written.append(p)
    if not written:
        raise LatsimError("nothing to plot: no requests*.csv, sweep results or "
                          "validate/real-*.csv here", source=str(d))
    return written


def plot_sweep(sweep_csv: Union[str, Path], path: Optional[Path] = None) -> Path:
    """``plot_load_curve`` of a sweep table (``latsim sweep``'s ``results.csv`` or a
    ``sweep.csv``) with the axes ``sweep_axes`` finds: rows with an error are dropped
    and other varying parameters join the group label. Writes ``path`` (default:
    ``load_curve.png`` next to the table) and returns it."""
    p = Path(sweep_csv)
    if not p.exists():
        raise LatsimError("file not found", source=str(p))
    df = table = _read_csv(p, "sweep table")
    if "error" in df:
        df = df[df["error"].isna()]
    try:
        x, group, extra = sweep_axes(df)
    except LatsimError as e:
        raise LatsimError(str(e), source=str(p)) from None
    check_sweep(p, table, x, [f"{q}_{m}_ms" for q in ("median", "p99") for m in ("ttft", "tpot")])
    if extra:
        parts = ([df[group].astype(str)] if group else []) + [
            c + "=" + df[c].astype(str) for c in extra]
        df = df.assign(_group=[", ".join(t) for t in zip(*parts)])
        group = "_group"
    out = Path(path) if path else p.with_name("load_curve.png")
    plot_load_curve(df, x, group, out)
    return out
