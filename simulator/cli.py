"""The ``latsim`` command line (typer). All file I/O of a run happens here.

Every user error (bad scenario, bad trace, unknown policy) is a ``LatsimError``:
printed on one line to stderr, exit code 2, no traceback.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from .errors import LatsimError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="latsim: latency simulator and capacity planner for LLM serving.")
console = Console()
err_console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """latsim: latency simulator and capacity planner for LLM serving."""


def _fail(e: Exception) -> None:
    err_console.print(f"latsim: error: {e}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(getattr(e, "exit_code", 2))


@app.command()
def run(
    scenario: Path = typer.Argument(..., help="scenario YAML"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="override: a.b=value"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for result files"),
    seed: Optional[int] = typer.Option(None, "--seed", help="override the scenario's seed"),
    policies: Optional[str] = typer.Option(None, "--policies",
                                           help="comma-separated policies to compare"),
    plots: bool = typer.Option(False, "--plots", help="also write PNG plots to --out"),
) -> None:
    """Simulate a scenario and print P50/P90/P99 latencies and the E2E breakdown."""
    try:
        from .config import load_scenario
        from .costmodel import load_profile, profile_search_dirs, resolve_profile_path
        from .report import print_run, run_outputs, series_table, write_run
        from .simulate import simulate
        from .workload import build_workload
        import numpy as np

        sc, base = load_scenario(scenario, set_)
        names = ([p.strip() for p in policies.split(",") if p.strip()] if policies
                 else (sc.policies or [sc.engine.policy]))
        from .scheduling import POLICIES
        for p in names:
            if p not in POLICIES:
                raise LatsimError(f"unknown policy {p!r}; known: {', '.join(POLICIES)}",
                                  source="--policies")
        s = sc.seed if seed is None else seed
        t0 = time.perf_counter()
        # Same traffic for every policy: build the workload once from the seed.
        wl_rng = np.random.default_rng(np.random.SeedSequence(s).spawn(4)[0])
        wl = build_workload(sc.workload, wl_rng, base)
        profile = None
        if sc.model.cost.kind == "profile":
            profile = load_profile(resolve_profile_path(sc.model.cost.path,
                                                        profile_search_dirs(base)))
        outs, tables, series = {}, {}, {}
        for p in names:
            res = simulate(sc, s, base_dir=base, policy=p, workload=wl, profile=profile)
            df, o = run_outputs(res)
            outs[p], tables[p] = o, df
            series[p] = series_table(res)
        wall = time.perf_counter() - t0
        first = next(iter(outs.values()))["run"]
        console.print(f"[bold]{sc.name}[/]: {len(wl)} requests, {sc.cluster.replicas} replica(s), "
                      f"KV capacity {first['kv_capacity_tokens']:,} tokens/replica, "
                      f"seed {s}, simulated in {wall:.2f} s")
        print_run(console, outs)
        if out is not None:
            files = write_run(out, sc, outs, tables, series)
            if plots:
                from .plots import plot_run
                files += plot_run(out)
            console.print(f"wrote {', '.join(str(f) for f in files)}")
        elif plots:
            raise LatsimError("--plots needs --out", source="--plots")
    except LatsimError as e:
        _fail(e)


def _mount() -> None:
    from .tracecli import trace_app
    app.add_typer(trace_app, name="trace", help="Summarise and convert request traces.")


_mount()


def main() -> None:
    """Console-script entry point: user errors from any command are one line, exit 2."""
    try:
        app()
    except LatsimError as e:
        err_console.print(f"latsim: error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:  # pragma: no cover
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main()
