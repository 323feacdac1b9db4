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

from simulator.errors import LatsimError

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
    loop: str = typer.Option("auto", "--loop", help="auto: the compiled loop where it covers "
                             "the run and the run is large enough, else SimPy (same "
                             "results; the run line says which and why); compiled: insist "
                             "on it; simpy: SimPy"),
) -> None:
    """Simulate a scenario and print P50/P90/P99 latencies and the E2E breakdown."""
    try:
        if loop not in ("auto", "compiled", "simpy"):
            raise LatsimError("must be 'auto', 'compiled' or 'simpy'",
                              source="--loop", value=loop, has_value=True)
        from simulator.config.scenario import load_scenario
        from simulator.cost import load_profile, profile_search_dirs, resolve_profile_path
        from simulator.loops.simulate import Unsupported
        from simulator.report.output import print_run, run_outputs, series_table, write_run
        from simulator.loops.simulate import simulate
        from simulator.workload import build_workload
        import numpy as np

        sc, base = load_scenario(scenario, set_)
        if policies:
            names = _policy_list(policies)
            sc = sc.model_copy(update={"policies": names})
        runs = sc.policy_runs()
        s = sc.seed if seed is None else seed
        from simulator.report.kv import kv_capacity_line
        from simulator.loops.simulate import kv_capacity_blocks
        console.print(kv_capacity_line(sc, kv_capacity_blocks(sc)), highlight=False)
        t0 = time.perf_counter()
        # Same traffic for every policy: build the workload once from the seed.
        wl_rng = np.random.default_rng(np.random.SeedSequence(s).spawn(4)[0])
        wl = build_workload(sc.workload, wl_rng, base)
        profile = None
        if getattr(sc.model.cost, "path", None) is not None:
            profile = load_profile(resolve_profile_path(sc.model.cost.path,
                                                        profile_search_dirs(base)))
        outs, tables, series = {}, {}, {}
        for label, psc in runs:
            try:
                res = simulate(psc, s, base_dir=base, workload=wl, profile=profile, loop=loop)
            except Unsupported as e:
                raise LatsimError(f"the {loop} loop cannot run this scenario: {e}",
                                  source="--loop", value=loop, has_value=True) from None
            df, o = run_outputs(res)
            outs[label], tables[label] = o, df
            series[label] = series_table(res)
        wall = time.perf_counter() - t0
        first = next(iter(outs.values()))["run"]
        console.print(f"[bold]{sc.name}[/]: {len(wl)} requests, {sc.cluster.replicas} replica(s), "
                      f"KV capacity {first['kv_capacity_tokens']:,} tokens/replica, "
                      f"seed {s}, simulated in {wall:.2f} s "
                      f"({', '.join(sorted({o['run']['event_loop'] for o in outs.values()}))})")
        print_run(console, outs)
        if out is not None:
            files = write_run(out, sc, outs, tables, series)
            if plots:
                from simulator.report.plots import plot_run
                files += plot_run(out)
            console.print(f"wrote {', '.join(str(f) for f in files)}")
        elif plots:
            raise LatsimError("--plots needs --out", source="--plots")
    except LatsimError as e:
        _fail(e)


@app.command()
def profile(
    model: str = typer.Option("tiny", "--model", help="preset (tiny, small, llama3-1b, "
                              "llama3-8b, llama3-70b) or a local checkpoint folder"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    out: Path = typer.Option(Path("profiles"), "--out", help=".json file or folder"),
    quick: bool = typer.Option(False, "--quick", help="a smaller grid"),
    repeats: Optional[int] = typer.Option(None, "--repeats", min=1),
    warmup: Optional[int] = typer.Option(None, "--warmup", min=0),
    time_budget_s: Optional[float] = typer.Option(None, "--time-budget-s", min=1),
) -> None:
    """Measure the real engine's step costs and write a profile (needs the engine extra)."""
    try:
        rp = _engine_import("real_engine.profile").run_profile
        from simulator.cli.serve import check_engine_flags
        check_engine_flags(model, device)
        prof = rp(model, device, out, quick=quick, repeats=repeats, warmup=warmup,
                  time_budget_s=time_budget_s)
        console.print(f"profile: {len(prof['prefill'])} prefill, {len(prof['decode'])} decode, "
                      f"{len(prof.get('mixed', []))} mixed rows -> {prof['meta'].get('path', out)}")
    except LatsimError as e:
        _fail(e)


_VALIDATE_POLICIES = "fifo,chunked,priority_aging"


@app.command()
def validate(
    profile: Path = typer.Option(..., "--profile", help="profile the engine produced"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="trace file (any format "
                                         "`latsim trace` reads); default: synthetic Poisson"),
    fmt: Optional[str] = typer.Option(None, "--format", help="azure|mooncake|vidur|csv"),
    policies: str = typer.Option(_VALIDATE_POLICIES, "--policies"),
    model: Optional[str] = typer.Option(None, "--model", help="default: the profile's model"),
    device: str = typer.Option("cpu", "--device"),
    limit: int = typer.Option(200, "--limit", min=1, help="requests to replay"),
    load: Optional[float] = typer.Option(None, "--load", min=0.01, max=2.0,
                                         help="rescale arrivals to this fraction of the "
                                         "simulated engine's saturation throughput"),
    max_prompt_tokens: int = typer.Option(1024, "--max-prompt-tokens", min=1),
    max_output_tokens: int = typer.Option(128, "--max-output-tokens", min=1),
    max_num_seqs: int = typer.Option(32, "--max-num-seqs", min=1),
    max_num_batched_tokens: int = typer.Option(256, "--max-num-batched-tokens", min=1),
    chunk_size: Optional[int] = typer.Option(None, "--chunk-size", min=1),
    aging_s: float = typer.Option(2.0, "--aging-s", min=0.001),
    seed: int = typer.Option(0, "--seed"),
    out: Path = typer.Option(Path("results/validate"), "--out"),
    endpoint: Optional[str] = typer.Option(
        None, "--endpoint", help="over real HTTP: 'local' (serve each policy here on a "
        "loopback port) or the URL of a running `latsim serve` (its own policy)"),
) -> None:
    """Replay one trace through the real engine and the simulator; print the errors.

    With ``--endpoint`` the real side is ``latsim bench`` against ``latsim serve``,
    so the wire (T_net, T_stream) is measured too (``real_engine.endpoint``)."""
    try:
        import numpy as np
        from simulator.cost import load_profile
        from simulator.workload import Workload
        names = _policy_list(policies)
        if not profile.exists():
            raise LatsimError("file not found", source=str(profile), field="--profile")
        prof = load_profile(profile)
        mdl = model or prof.get("meta", {}).get("model", {}).get("name")
        if not mdl:
            raise LatsimError("profile names no model; pass --model", source=str(profile))
        v = _engine_import("real_engine.validate")
        rng = np.random.default_rng(seed)
        if trace is not None:
            from simulator.workload.traces import TraceWorkload, build_trace
            cfg = TraceWorkload(path=str(trace), format=fmt, limit=limit,
                                max_prompt_tokens=max_prompt_tokens,
                                max_output_tokens=max_output_tokens)
            wl = build_trace(cfg, rng, Path.cwd())
        else:
            n = limit
            wl = Workload(arrival_s=np.cumsum(rng.exponential(1.0, n)),
                          prompt_tokens=rng.integers(16, max_prompt_tokens + 1, n),
                          output_tokens=rng.integers(2, max_output_tokens + 1, n),
                          priority=rng.integers(0, 3, n), class_names=("P0", "P1", "P2"))
        settings = v.engine_settings(max_num_seqs, max_num_batched_tokens, chunk_size, aging_s)
        if endpoint is not None:
            from simulator.cli.serve import _need
            _need("fastapi", "uvicorn", "httpx")
            ep = _engine_import("real_engine.endpoint")
            # A running server has one policy: --policies left at its default means "its own".
            asked = None if (ep.parse_endpoint(endpoint) is not None
                             and policies == _VALIDATE_POLICIES) else names
            res, meta = ep.run_endpoint_validation(endpoint, prof, wl, asked, model=mdl,
                                                   device=device, settings=settings, load=load,
                                                   seed=seed, log=console.print)
            table, lines, write = ep.error_table, ep.summary_lines, ep.write_endpoint
        else:
            res, meta = v.run_validation(prof, wl, names, model=mdl, device=device,
                                         settings=settings, load=load, seed=seed,
                                         log=console.print)
            table, lines, write = v.error_table, v.diagnosis_lines, v.write_validation
        meta.update(profile=str(profile), trace=str(trace))
        console.print(table(res))
        for line in lines(res):
            console.print(line, markup=False, highlight=False)
        files = write(out, res, meta)
        console.print(f"wrote {', '.join(str(f) for f in files)}")
    except LatsimError as e:
        _fail(e)


def _policy_list(text: str) -> list[str]:
    """``--policies a,b`` as a checked list."""
    from simulator.model.scheduling import check_policy_name
    names = [p.strip() for p in text.split(",") if p.strip()]
    try:
        return [check_policy_name(p) for p in names]
    except ValueError as e:
        raise LatsimError(str(e), source="--policies") from None


def _engine_import(name: str):
    """Import a real_engine module, or explain that the engine extra is missing."""
    import importlib
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == "torch":
            raise LatsimError("the real engine needs torch: pip install 'latsim[engine]' "
                              "(on CPU: pip install torch==2.13.0 first)") from None
        raise


def _mount() -> None:
    from simulator.cli.data import data
    from simulator.cli.plan import plan, sweep
    from simulator.cli.policies import policies
    from simulator.cli.report import report
    from simulator.cli.serve import bench, serve
    from simulator.cli.trace import trace_app
    app.command("sweep")(sweep)
    app.command("plan")(plan)
    app.command("report")(report)
    app.command("serve")(serve)
    app.command("bench")(bench)
    app.command("data")(data)
    app.command("policies")(policies)
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
