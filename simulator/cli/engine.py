"""``latsim profile`` and ``latsim validate``: the commands that drive the real engine.

``profile`` measures the engine's step costs into a profile; ``validate`` replays one
trace through the engine (in process, or over HTTP with ``--endpoint``) and the
simulator and prints the errors, or compares a recorded run (``--run DIR SCENARIO``,
no engine needed). Command functions only; ``simulator.cli.main`` registers them.
The engine modules (``real_engine.*``) are imported only when a command runs.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from simulator.cli.common import _fail, _policy_list
from simulator.errors import LatsimError

console = Console()


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


# validate's options that only a replay through the engine reads (not --run).
_REPLAY_ONLY = frozenset({"trace", "fmt", "model", "device", "limit", "load", "max_prompt_tokens",
                          "max_output_tokens", "max_num_seqs", "max_num_batched_tokens",
                          "chunk_size", "aging_s", "seed"})


def validate(
    ctx: typer.Context,
    scenario: Optional[Path] = typer.Argument(None, help="with --run: the scenario that "
                                              "describes the server that recorded it"),
    run: Optional[Path] = typer.Option(None, "--run", help="a recorded run folder (refbench "
                                       "or `latsim bench --out`): compare it with the "
                                       "simulated SCENARIO, no engine needed"),
    profile: Optional[Path] = typer.Option(None, "--profile", help="profile the engine "
                                           "produced (real-engine mode)"),
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
    out: Path = typer.Option(Path("results/validate"), "--out", help="folder for the "
                             "comparison's files (a file of the same run or trace is replaced)"),
    endpoint: Optional[str] = typer.Option(
        None, "--endpoint", help="over real HTTP: 'local' (serve each policy here on a "
        "loopback port) or the URL of a running `latsim serve` (its own policy)"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="with --run: scenario "
                                             "override a.b=value (the server's settings)"),
) -> None:
    """Replay one trace through the real engine and the simulator; print the errors.

    With ``--endpoint`` the real side is ``latsim bench`` against ``latsim serve``,
    so the wire (T_net, T_stream) is measured too (``real_engine.endpoint``). With
    ``--run DIR SCENARIO`` the real side is a recorded run and nothing is served
    (``simulator.cli.fidelity.validate_run``)."""
    from simulator.report.files import check_out_dir
    try:
        if run is not None or scenario is not None:
            if run is None or scenario is None:
                raise LatsimError("--run DIR and a SCENARIO go together", source="--run")
            if profile is not None or endpoint is not None:
                raise LatsimError("a recorded run needs no engine: drop --profile/--endpoint "
                                  "(the scenario's model.cost is the model)", source="--run")
            # The options of a replay through the engine do not apply to a recorded run:
            # its own requests are compared, under the scenario's settings (--set).
            for param in ctx.command.params:
                # Given on the command line (typer ships its own click: compare by name).
                src = ctx.get_parameter_source(param.name)
                if param.name in _REPLAY_ONLY and src is not None and src.name != "DEFAULT":
                    raise LatsimError("applies to a replay through the engine, not to --run "
                                      "(the run's own requests are compared; give the "
                                      "server's settings with --set a.b=value)",
                                      source=param.opts[0], value=ctx.params[param.name],
                                      has_value=True)
            from simulator.cli.fidelity import validate_run
            label = None if policies == _VALIDATE_POLICIES else policies.strip()
            validate_run(run, scenario, label, out, set_)
            return
        if set_:
            raise LatsimError("--set overrides the SCENARIO of --run DIR SCENARIO",
                              source="--set")
        if profile is None:
            raise LatsimError("give --profile (run the real engine) or --run DIR SCENARIO "
                              "(a recorded run)", source="--profile")
        import numpy as np
        from simulator.cost import load_profile
        from simulator.workload import Workload
        names = _policy_list(policies)
        if not profile.exists():
            raise LatsimError("file not found", source=str(profile), field="--profile")
        check_out_dir(out, keep=True)
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
            _need("fastapi", "uvicorn", "httpx", "prometheus_client")
            ep = _engine_import("real_engine.endpoint")
            if ep.parse_endpoint(endpoint) is None:     # 'local': the engine runs here
                _warn_if_busy(device)
        else:
            _warn_if_busy(device)
        if endpoint is not None:
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


def _warn_if_busy(device: str) -> None:
    """Validation against a real engine compares wall-clock times with a profile timed on
    an idle machine: other work on a CPU box stretches every step and the errors then
    measure the load, not the simulator. Say so when the load average shows it
    (``LATSIM_NO_LOAD_WARNING=1`` silences it: the tests do, so that what they read
    never depends on the machine's load)."""
    import os
    if (device != "cpu" or not hasattr(os, "getloadavg")
            or os.environ.get("LATSIM_NO_LOAD_WARNING")):
        return
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * cores:
        console.print(f"warning: load average {load:.1f} on {cores} cores: the real engine's "
                      f"times will include that load; validate on a quiet machine",
                      style="yellow", highlight=False)
