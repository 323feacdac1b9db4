"""``latsim report RESULTS_DIR``: write the PNG plots for a results folder.

The folder is what ``latsim run --out`` wrote (latency CDFs, E2E breakdown, time
series), a ``latsim sweep`` folder (``results.csv`` with ``sweep.yaml``, or a
``sweep.csv``: latency against load), a ``latsim validate --out`` folder
(``real-<policy>.csv`` and ``sim-<policy>.csv``, also under ``validate/``: fidelity),
or any mix; the PNGs go next to the files they draw (see
``simulator.report.plots.plot_run``). A sweep table (``.csv``) may also be given directly.
Missing folders or files raise ``LatsimError`` (one line, exit 2, from the CLI's
entry point).
"""
from __future__ import annotations

from pathlib import Path

import typer

from simulator.errors import LatsimError, check_file

MAX_TABLE_BYTES = 4 * 2**30   # a sweep table a plot can still read


def report(
    results_dir: Path = typer.Argument(
        ..., help="a `latsim run --out`, `latsim sweep` or `latsim validate --out` folder, "
        "or a sweep table (.csv)"),
) -> None:
    """Write PNG plots next to the results and print their paths, one per line.

    Latency CDFs, the E2E breakdown, time series, latency vs load, fidelity."""
    from simulator.report.plots import plot_run, plot_sweep

    if not results_dir.exists():
        raise LatsimError("results folder not found", source=str(results_dir))
    if results_dir.is_file():
        if results_dir.suffix != ".csv":
            raise LatsimError("expected a results folder or a sweep table (.csv)",
                              source=str(results_dir))
        check_file(results_dir, max_bytes=MAX_TABLE_BYTES, what="sweep table")
    elif not results_dir.is_dir():
        raise LatsimError("expected a results folder or a sweep table (.csv)",
                          source=str(results_dir))
    try:
        files = [plot_sweep(results_dir)] if results_dir.is_file() else plot_run(results_dir)
    except LatsimError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError, OSError) as e:
        # A table that is not what latsim writes (edited, truncated, another tool's).
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise LatsimError(f"cannot plot these results: {type(e).__name__}: {msg} (are they "
                          "files latsim wrote?)", source=str(results_dir)) from None
    for f in files:
        typer.echo(str(f))
