"""``latsim trace``: summarize a request trace, or convert it to the canonical CSV.

- ``summarize PATH``: request count, span, mean rate, inter-arrival CV, dispersion
  and peak/mean of counts per 1 s and 60 s, token percentiles (and prefix-block
  reuse for traces with hash ids), as a table.
- ``convert PATH --out OUT.csv``: the canonical CSV (``arrival_s, prompt_tokens,
  output_tokens, priority, prefix_hashes``) after the same window / limit /
  speedup / rate options a ``kind: trace`` workload takes.

Both read through ``simulator.workload.traces``, so they see what a scenario would
replay. Bad input raises ``LatsimError`` (the main CLI prints it on one line, exit 2).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.table import Table

from simulator.errors import LatsimError
# numpy, pandas, pydantic and the trace readers are imported where used: ``latsim trace
# --help`` needs none of them.
if TYPE_CHECKING:
    from simulator.workload.base import Workload

trace_app = typer.Typer(help="Inspect and convert request traces (Azure, Mooncake, Vidur, CSV).",
                        no_args_is_help=True)

_FORMAT_HELP = "azure | mooncake | vidur | csv (default: from the extension or header)"
_WINDOW_HELP = "START,END seconds on the trace's own clock (before rescaling)"


def _window(text: Optional[str]) -> Optional[tuple[float, float]]:
    if text is None:
        return None
    try:
        a, b = (float(x) for x in text.replace(":", ",").split(","))
    except ValueError:
        raise LatsimError("expected START,END in seconds", source="--window", value=text,
                          has_value=True) from None
    if not a < b:
        raise LatsimError("START must be below END", source="--window", value=text, has_value=True)
    return a, b


def load_trace(path: Path, fmt: Optional[str] = None, *, speedup: Optional[float] = None,
               rate: Optional[float] = None, window: Optional[str] = None,
               limit: Optional[int] = None, sort: bool = False, seed: int = 0) -> Workload:
    """Read ``path`` as a ``kind: trace`` workload with these options (CLI paths: from cwd)."""
    import numpy as np
    from pydantic import ValidationError
    from simulator.workload.traces import TraceWorkload, build_trace
    fields = {"path": str(path), "format": fmt, "speedup": speedup, "rate": rate,
              "window": _window(window), "limit": limit, "sort": sort}
    try:
        cfg = TraceWorkload(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:  # name the option and the problem on one line
        err = e.errors()[0]
        # A rule over several options (no one field) quotes no value: it would be them all.
        raise LatsimError(err["msg"].removeprefix("Value error, "), source=str(path),
                          field=".".join(map(str, err["loc"])) or None,
                          value=err.get("input"), has_value=bool(err["loc"])) from None
    return build_trace(cfg, np.random.default_rng(seed), Path.cwd())


def _fmt(x, digits: int = 3) -> str:
    import numpy as np
    if isinstance(x, float) and math.isnan(x):
        return "-"
    if isinstance(x, (int, np.integer)):
        return f"{x:,}"
    return f"{x:,.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"


def summary_table(path: Path, s: dict) -> Table:
    """A rich table of ``summarize_workload``'s figures."""
    t = Table(show_header=True, header_style="bold")
    t.add_column("statistic")
    t.add_column("value", justify="right")
    rows = [("requests", s["requests"]), ("span (s)", s["span_s"]),
            ("mean rate (req/s)", s["mean_rate"]), ("inter-arrival CV", s["iat_cv"]),
            ("dispersion of counts @1 s", s["disp_1s"]), ("dispersion of counts @60 s", s["disp_60s"]),
            ("peak/mean @1 s", s["peak_mean_1s"]), ("peak/mean @60 s", s["peak_mean_60s"])]
    for name in ("prompt", "output"):
        rows += [(f"{name} tokens mean", s[f"{name}_mean"])]
        rows += [(f"{name} tokens P{q}", s[f"{name}_p{q}"]) for q in (50, 90, 99)]
        rows += [(f"{name} tokens max", s[f"{name}_max"])]
    if "blocks" in s:
        rows += [("prefix blocks", s["blocks"]), ("blocks reused (infinite cache)",
                                                  f"{100 * s['block_reuse']:.1f}%")]
    for k, v in rows:
        t.add_row(k, v if isinstance(v, str) else _fmt(v))
    return t


@trace_app.command()
def summarize(
    path: Path = typer.Argument(..., help="trace file"),
    format: Optional[str] = typer.Option(None, "--format", "-f", help=_FORMAT_HELP),
    window: Optional[str] = typer.Option(None, help=_WINDOW_HELP),
    limit: Optional[int] = typer.Option(None, help="first N requests only"),
    sort: bool = typer.Option(False, help="sort out-of-order timestamps (with a warning)"),
) -> None:
    """Print a trace's count, span, rate, burstiness and token percentiles."""
    from simulator.workload.traces import summarize_workload
    wl = load_trace(path, format, window=window, limit=limit, sort=sort)
    console = Console()
    console.print(f"[bold]{path}[/bold] ({wl.meta['format']})", soft_wrap=True, highlight=False)
    console.print(summary_table(path, summarize_workload(wl)))


def write_canonical(wl: Workload, out: Path) -> None:
    """Write ``wl`` as the canonical CSV (full float precision, so it reads back exactly),
    staged in a hidden file renamed over ``out`` at the end (``StagedFile``): an
    interrupted write or a full disk leaves no half-written trace behind."""
    import pandas as pd
    from simulator.report.files import StagedFile
    hashes = ([" ".join(map(str, h)) for h in wl.hash_ids] if wl.hash_ids is not None
              else [""] * len(wl))
    df = pd.DataFrame({"arrival_s": wl.arrival_s, "prompt_tokens": wl.prompt_tokens,
                       "output_tokens": wl.output_tokens, "priority": wl.priority,
                       "prefix_hashes": hashes})
    with StagedFile(Path(out)) as staged:
        df.to_csv(staged.path, index=False)


@trace_app.command()
def convert(
    path: Path = typer.Argument(..., help="trace file"),
    out: Path = typer.Option(..., "--out", "-o", help="canonical CSV to write"),
    format: Optional[str] = typer.Option(None, "--format", "-f", help=_FORMAT_HELP),
    speedup: Optional[float] = typer.Option(None, help="divide every time by this"),
    window: Optional[str] = typer.Option(None, help=_WINDOW_HELP),
    rate: Optional[float] = typer.Option(None, help="rescale to this mean rate (req/s)"),
    limit: Optional[int] = typer.Option(None, help="first N requests only"),
    sort: bool = typer.Option(False, help="sort out-of-order timestamps (with a warning)"),
    force: bool = typer.Option(False, "--force", help="--out may name an existing file: it "
                               "is replaced"),
) -> None:
    """Write the canonical CSV: arrival_s, prompt_tokens, output_tokens, priority, prefix_hashes."""
    from simulator.report.files import check_out_file
    check_out_file(out, force=force, reading=(path,))
    wl = load_trace(path, format, speedup=speedup, rate=rate, window=window, limit=limit, sort=sort)
    write_canonical(wl, out)
    typer.echo(f"wrote {len(wl):,} requests over {wl.arrival_s[-1]:,.1f} s to {out}")
