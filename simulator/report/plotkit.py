"""Helpers behind ``simulator.report.plots``: figures on the Agg canvas, colours per policy
and stage, time units and number formats, the logit-scale CDF panel and stacked bars,
and the table arithmetic the plots share (fidelity errors, knees, sweep-table axes).

Nothing here reads result files; ``simulator.report.plots`` is the public API and re-exports
what a user needs from here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from simulator.errors import LatsimError

#: (column, display name, unit) of the latencies plotted; values are seconds in the tables.
LATENCIES = (("ttft", "TTFT", "ms"), ("tpot", "TPOT", "ms"), ("e2el", "E2E latency", "auto"))
STAGES = ("t_net", "t_queue", "t_prefill", "t_decode", "t_stream")
STAGE_LABELS = {"t_net": "T_net (network)", "t_queue": "T_queue", "t_prefill": "T_prefill",
                "t_decode": "T_decode", "t_stream": "T_stream (stream back)"}
STAGE_COLORS = {"t_net": "#8c8c8c", "t_queue": "#d62728", "t_prefill": "#ff7f0e",
                "t_decode": "#1f77b4", "t_stream": "#9467bd"}
_FIXED = {"fifo": "#d62728", "chunked": "#1f77b4", "priority_aging": "#2ca02c",
          "real": "#222222", "sim": "#ff7f0e"}
_PALETTE = ["#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#ff7f0e",
            "#1f77b4", "#2ca02c", "#d62728"]
_assigned: dict[str, str] = {}
_SCALE = {"ms": 1e3, "s": 1.0}
#: Load columns of a sweep table, preferred in this order: (axis label, unit suffix).
LOAD_LABELS = {"workload.arrival.rate": ("offered load (req/s)", " req/s"),
               "rate": ("offered load (req/s)", " req/s"),
               "workload.rate": ("offered load (req/s)", " req/s"),
               "workload.rate_scale": ("load (x the trace's rate)", "x"),
               "workload.speedup": ("load (x the trace's rate)", "x"),
               "offered_rate": ("offered load (req/s)", " req/s")}
POLICY_KEYS = ("engine.policy", "policy")
DPI = 110


def policy_color(name: str) -> str:
    """A colour per policy (or series) name, the same in every figure of a process."""
    if name in _FIXED:
        return _FIXED[name]
    if name not in _assigned:
        _assigned[name] = _PALETTE[len(_assigned) % len(_PALETTE)]
    return _assigned[name]


def fmt(v: float) -> str:
    """A latency for a label: 2,433 / 52.5 / 4.12 / n/a."""
    if v is None or not np.isfinite(v):
        return "n/a"
    a = abs(v)
    return f"{v:,.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}"


def time_unit(top_s: float) -> tuple[str, float]:
    """(unit, multiplier) for times up to ``top_s`` seconds: ms below 2 s, else s."""
    return ("ms", 1e3) if np.isfinite(top_s) and top_s < 2.0 else ("s", 1.0)


def blank_figure(size: tuple[float, float]) -> Figure:
    """An empty constrained-layout figure on the Agg canvas."""
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def new_figure(rows: int, cols: int, panel: tuple[float, float], *,
               sharex: bool = False) -> tuple[Figure, list[list]]:
    """A figure of ``rows x cols`` panels of ``panel`` inches each; axes as a 2-D list."""
    fig = blank_figure((panel[0] * cols, panel[1] * rows + 0.6))
    axes = fig.subplots(rows, cols, squeeze=False, sharex="col" if sharex else False)
    return fig, [list(r) for r in axes]


def save(fig: Figure, path: Optional[Path]) -> Figure:
    """Write ``fig`` as a PNG at ``path`` (folders created) when given; return it."""
    if path is not None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=DPI)
    return fig


def fmt_time(seconds: float) -> str:
    """A duration with its unit: 850 ms, 2.43 s."""
    unit, scale = time_unit(seconds)
    return f"{fmt(seconds * scale)} {unit}"


def stacked_bars(ax, rows: Mapping[str, pd.Series], stages, note: Mapping[str, str]) -> None:
    """Horizontal stacked bars, one per row name (first on top), of the ``stages``
    (seconds) of each row; wide segments labelled, each bar's total (and its ``note``)
    written after it. The unit (ms or s) follows the largest total."""
    names = list(rows)[::-1]
    totals = np.array([np.nansum([rows[k][s] for s in stages]) for k in names], dtype=float)
    top = float(np.nanmax(totals, initial=0.0))
    unit, scale = time_unit(top)
    left = np.zeros(len(names))
    for st in stages:
        w = np.nan_to_num(np.array([rows[k][st] for k in names], dtype=float)) * scale
        bars = ax.barh(names, w, left=left, color=STAGE_COLORS[st], edgecolor="white",
                       linewidth=0.6, label=STAGE_LABELS[st])
        for b, v in zip(bars, w):
            if v >= 0.09 * top * scale:
                ax.text(b.get_x() + v / 2, b.get_y() + b.get_height() / 2, fmt(v),
                        ha="center", va="center", color="white", fontsize=8, fontweight="bold")
        left += w
    for y, k in enumerate(names):
        extra = f"\n  ({note[k]})" if k in note else ""
        ax.text(left[y], y, f"  {fmt(left[y])} {unit}{extra}", va="center", fontsize=8)
    ax.set_xlim(0, max(top * scale, 1e-9) * 1.3)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)


def _ecdf(x: np.ndarray, max_points: int = 2500) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values and Hazen plotting positions (i + 0.5) / n, thinned to about
    ``max_points`` with every point of the top 1% kept."""
    x = np.sort(x)
    n = len(x)
    y = (np.arange(n) + 0.5) / n
    if n > max_points:
        keep = np.unique(np.concatenate([np.linspace(0, n - 1, max_points).astype(int),
                                         np.arange(int(0.99 * n), n)]))
        x, y = x[keep], y[keep]
    return x, y


def cdf_panel(ax, series: Mapping[str, pd.Series], metric: str, title: str) -> None:
    """One CDF per named series (seconds) on a logit y axis, P50 and P99 marked and
    given in the legend; the x axis is logarithmic when the values span > 30x. TTFT and
    TPOT are in ms, E2E in s unless every P99 is below 2 s."""
    unit = next(u for _, n, u in LATENCIES if n == metric)
    if unit == "auto":
        p99s = [np.nanpercentile(s, 99) for s in series.values() if s.notna().any()]
        unit = time_unit(max(p99s, default=np.nan))[0]
    scale = _SCALE[unit]
    n_max, spans = 0, []
    for name, s in series.items():
        x = s.to_numpy(dtype=float)
        x = x[np.isfinite(x)] * scale
        if len(x) == 0:
            continue
        n_max = max(n_max, len(x))
        p50, p99 = np.percentile(x, [50, 99])
        xs, ys = _ecdf(x)
        c = policy_color(name)
        ax.plot(xs, ys, color=c, lw=1.6,
                label=f"{name}: P50 {fmt(p50)}, P99 {fmt(p99)} {unit}")
        ax.scatter([p50], [0.5], color=c, marker="o", s=28, zorder=3, edgecolor="white")
        ax.scatter([p99], [0.99], color=c, marker="^", s=36, zorder=3, edgecolor="white")
        spans.append((np.percentile(x, 1), x.max()))
    if n_max == 0:
        ax.text(0.5, 0.5, "no finished requests", ha="center", va="center",
                transform=ax.transAxes)
    else:
        top = max(min(0.999, 1 - 0.5 / n_max), 0.995)  # P99 always in view
        ax.set_yscale("logit")
        ax.set_ylim(0.01, top)
        # Fixed ticks: the logit scale's own locators are slow and label as 1 - 10^-3.
        ticks = [t for t in (0.01, 0.1, 0.5, 0.9, 0.99, 0.999) if t <= top + 1e-12]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 100:g}%"))
        ax.yaxis.set_minor_locator(NullLocator())
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        if lo > 0 and hi / lo > 30:
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,g}"))
            ax.xaxis.set_minor_locator(NullLocator())
        for q in (0.5, 0.99):
            ax.axhline(q, color="#999999", lw=0.7, ls=":", zorder=1)
        ax.legend(fontsize=7, loc="upper left")
    ax.set_xlabel(f"{metric} ({unit})")
    ax.set_ylabel("requests <= x (%, logit scale)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="major")


def binned(ts: pd.DataFrame, cols: list[str], max_points: int) -> pd.DataFrame:
    """``ts`` cut into ``max_points`` equal time bins (mean of each column per bin, the
    bin centre as ``time``); unchanged when it is short enough."""
    if len(ts) <= max_points:
        return ts
    edges = np.linspace(ts["time"].min(), ts["time"].max(), max_points + 1)
    b = np.clip(np.searchsorted(edges, ts["time"], side="right") - 1, 0, max_points - 1)
    out = ts.groupby(b)[cols].mean()
    out["time"] = (edges[:-1] + edges[1:])[out.index] / 2
    return out


def find_knee(x, y, factor: float = 3.0) -> Optional[float]:
    """The knee of a latency-vs-load curve: the lowest load ``x`` at which ``y`` (P99
    TTFT in ``plot_load_curve``) exceeds ``factor`` times its value at the lowest load;
    None if it never does. NaN ``y`` (nothing finished) counts as past the knee."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) == 0:
        return None
    order = np.argsort(x)
    x, y = x[order], y[order]
    base = y[0]
    if not np.isfinite(base) or base <= 0:
        return None
    past = ~(y <= factor * base)
    return float(x[np.argmax(past)]) if past.any() else None


def finished(df: pd.DataFrame) -> pd.DataFrame:
    """The finished requests of a per-request table (rows with an E2E latency)."""
    if "finished" in df:
        df = df[df["finished"].astype(bool)]
    return df[df["e2el"].notna()] if "e2el" in df else df


def fidelity_errors(real_df: pd.DataFrame, sim_df: pd.DataFrame) -> pd.DataFrame:
    """P50/P99 of TTFT, TPOT, E2E (ms) on each side and the relative error (sim - real)
    / real in %: one row per metric and percentile."""
    rows = []
    real, sim = finished(real_df), finished(sim_df)
    for col, name, _ in LATENCIES:
        for q in (50, 99):
            r = np.nanpercentile(real[col], q) * 1e3 if real[col].notna().any() else np.nan
            s = np.nanpercentile(sim[col], q) * 1e3 if sim[col].notna().any() else np.nan
            rows.append({"metric": name, "percentile": f"P{q}", "real_ms": r, "sim_ms": s,
                         "error_pct": (s - r) / r * 100 if r else np.nan})
    return pd.DataFrame(rows)


def sweep_axes(df: pd.DataFrame) -> tuple[str, Optional[str], list[str]]:
    """``(x, group, other varying parameters)`` of a sweep table. Parameters are the
    columns between ``point`` and ``seed`` (``latsim sweep``'s layout), else the dotted
    ones (not ``run.*``). ``group`` is the policy column if any; ``x`` the first swept
    load column of ``LOAD_LABELS``, else the first other varying numeric parameter."""
    cols = list(df.columns)
    if "point" in cols and "seed" in cols and cols.index("point") < cols.index("seed"):
        params = cols[cols.index("point") + 1:cols.index("seed")]
    else:
        params = [c for c in cols if ("." in c and not c.startswith("run.")) or c in
                  ("rate", "policy", "replicas", "router")]
    group = next((c for c in POLICY_KEYS if c in params), None)
    varying = [c for c in params if c != group and df[c].nunique() > 1]
    numeric = [c for c in varying if pd.api.types.is_numeric_dtype(df[c])]
    x = next((c for c in LOAD_LABELS if c in numeric), numeric[0] if numeric else None)
    if x is None:
        raise LatsimError("sweep table has no varying numeric parameter to plot against "
                          f"(parameters: {', '.join(params) or 'none'})")
    return x, group, [c for c in varying if c != x]
