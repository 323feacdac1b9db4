"""``latsim serve`` and ``latsim bench``: the real server and the real load client.

Command functions only; ``simulator.cli.main`` registers them. The web stack
(FastAPI, uvicorn, httpx) is an optional extra (``serve``) and ``serve`` needs
torch too (``engine``): both commands import them lazily and turn a missing
package into a one-line ``LatsimError``, so the rest of latsim works without them.

Exit codes: 0 done; 1 ``bench`` ran but no request completed; 2 bad input (a flag
value, a missing package), printed as one ``latsim: error:`` line.
"""
from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from simulator.errors import LatsimError
from simulator.model.policies.priority_aging import DEFAULT_AGING_S

console = Console()
err_console = Console(stderr=True)

# What to run when packages are missing. torch comes first and pinned: left to pip,
# the engine extra pulls a CUDA build of torch (gigabytes) even on a CPU box.
_INSTALL_SERVE = "pip install -e \".[serve]\""
_INSTALL_ENGINE_SERVE = "pip install torch==2.13.0 && pip install -e \".[engine,serve]\""


def _need(*modules: str) -> None:
    """Raise a one-line error naming the install line when a package is missing."""
    import importlib.util
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        how = _INSTALL_ENGINE_SERVE if "torch" in missing else _INSTALL_SERVE
        raise LatsimError(f"needs {', '.join(missing)}: {how}")


def _short(value: object, n: int = 80) -> str:
    """A flag value as shown in an error: at most ``n`` characters."""
    text = str(value)
    return text if len(text) <= n else text[:n - 3] + "..."


def _warn(text: str) -> None:
    err_console.print(f"latsim: warning: {text}", markup=False, highlight=False,
                      soft_wrap=True)


def check_engine_flags(model: str, device: str) -> None:
    """``--model`` and ``--device`` as the real engine will need them (``serve``,
    ``profile``): a preset or a checkpoint folder it can load, and a device this
    machine has. Raises a one-line ``LatsimError`` naming the flag; needs torch."""
    if device not in ("cpu", "cuda"):
        raise LatsimError("must be cpu or cuda", source="--device", value=_short(device),
                          has_value=True)
    import torch

    from real_engine.model import PRESETS, resolve_config
    if device == "cuda" and not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "no CUDA device is visible")
        raise LatsimError(f"CUDA is not available ({why}, torch {torch.__version__}); "
                          f"use --device cpu", source="--device", value=device, has_value=True)
    try:
        # A folder's config.json: every type and range checked, or one line naming the
        # file, the field and the value (LatsimError), before anything is loaded.
        resolve_config(model)
    except ValueError:
        raise LatsimError(f"not a preset ({', '.join(PRESETS)}) nor a folder with a "
                          f"config.json", source="--model", value=_short(model),
                          has_value=True) from None
    except OSError as e:        # a path the OS refuses to look at (too long, no access)
        raise LatsimError(f"cannot read its config.json ({e.strerror or e})", source="--model",
                          value=_short(model), has_value=True) from None
    if model not in PRESETS:
        import importlib.util
        if not any(Path(model).glob("*.safetensors")):
            raise LatsimError("the folder has no *.safetensors weights", source="--model",
                              value=_short(model), has_value=True)
        if importlib.util.find_spec("safetensors") is None:
            raise LatsimError("loading a checkpoint needs safetensors: pip install "
                              "safetensors", source="--model", value=_short(model),
                              has_value=True)


def _api_key(key: Optional[str], flag: str = "--api-key") -> Optional[str]:
    """The API key as given (flag or ``LATSIM_API_KEY``); an empty one is an error, not
    "no key": an unset variable in a launch script must not open the server."""
    if key is None:
        return None
    if not key.strip():
        raise LatsimError("is empty (unset it to run without a key)",
                          source=f"{flag} / LATSIM_API_KEY")
    if not all(0x21 <= ord(c) <= 0x7e for c in key):
        raise LatsimError("must be printable ASCII without spaces (it travels in an HTTP "
                          "header)", source=f"{flag} / LATSIM_API_KEY")
    return key


def serve(
    model: str = typer.Option("tiny", "--model", help="preset (tiny, small, llama3-1b, "
                              "llama3-8b, llama3-70b) or a local checkpoint folder"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=0, max=65535),
    policy: str = typer.Option("chunked", "--policy", help="fifo | chunked | priority_aging"),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", min=1),
    max_num_batched_tokens: int = typer.Option(512, "--max-num-batched-tokens", min=1),
    chunk_size: Optional[int] = typer.Option(None, "--chunk-size", min=1),
    aging_s: float = typer.Option(DEFAULT_AGING_S, "--aging-s", min=0.001),
    num_blocks: Optional[int] = typer.Option(None, "--num-blocks", min=1,
                                             help="KV blocks (default: by device)"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch CPU threads"),
    served_name: Optional[str] = typer.Option(None, "--served-model-name"),
    heartbeat_s: float = typer.Option(15.0, "--heartbeat-s", min=0.0,
                                      help="SSE ': ping' after this long silent (0: never)"),
    backpressure: str = typer.Option("buffer", "--backpressure",
                                     help="a client slower than the engine: block (pause its "
                                     "request, KV kept) | buffer (unbounded) | degrade (send "
                                     "the rest as one frame)"),
    stream_buffer_frames: int = typer.Option(256, "--stream-buffer-frames", min=1,
                                             help="per-request send buffer bound (frames)"),
    socket_send_buffer: Optional[int] = typer.Option(None, "--socket-send-buffer", min=1,
                                                     help="SO_SNDBUF bytes per connection "
                                                     "(default: the OS autotunes it)"),
    preemption: str = typer.Option("recompute", "--preemption",
                                   help="KV full: recompute | swap (to CPU memory)"),
    prefix_caching: bool = typer.Option(False, "--prefix-caching/--no-prefix-caching",
                                        help="share KV blocks of identical prompt prefixes"),
    kv_allocation: str = typer.Option("paged", "--kv-allocation",
                                      help="paged | contiguous (reserve prompt + max_tokens)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="LATSIM_API_KEY",
                                          show_envvar=True,
                                          help="require 'Authorization: Bearer <key>' on "
                                          "every endpoint but /health (prefer the env "
                                          "variable: a flag shows in ps)"),
    max_body_mb: float = typer.Option(4.0, "--max-body-mb", min=0.001,
                                      help="request body limit, MiB (larger: 413)"),
    request_timeout_s: float = typer.Option(600.0, "--request-timeout-s", min=0.0,
                                            help="cancel a request (KV freed, 504) after "
                                            "this long (0: never)"),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Serve the real engine behind an OpenAI-compatible streaming API (blocks).

    Exit code 2 with one line for a bad flag value or a port it cannot bind."""
    from simulator.model.scheduling import check_policy_name
    if device not in ("cpu", "cuda"):
        raise LatsimError("must be cpu or cuda", source="--device", value=_short(device),
                          has_value=True)
    try:
        check_policy_name(policy)
    except ValueError as e:
        raise LatsimError(_short(e, 200), source="--policy") from None
    if backpressure not in ("block", "buffer", "degrade"):
        raise LatsimError("must be block, buffer or degrade", source="--backpressure",
                          value=_short(backpressure), has_value=True)
    for name, v, ok in (("--preemption", preemption, ("recompute", "swap")),
                        ("--kv-allocation", kv_allocation, ("paged", "contiguous"))):
        if v not in ok:
            raise LatsimError(f"must be {' or '.join(ok)}", source=name, value=_short(v),
                              has_value=True)
    if prefix_caching and kv_allocation == "contiguous":
        raise LatsimError("needs --kv-allocation paged", source="--prefix-caching")
    api_key = _api_key(api_key)
    _need("fastapi", "uvicorn", "prometheus_client", "torch")
    check_engine_flags(model, device)
    from real_engine.profile import build_engine
    from real_engine.hosting import is_loopback, listen_socket
    from real_engine.server import serve as _serve
    from simulator.model.kv.space import KVRules
    kv_rules = KVRules(allocation=kv_allocation, preemption=preemption,
                       prefix_caching=prefix_caching)
    try:
        # Bound before the engine is built: a taken port fails at once.
        sock = listen_socket(host, port, socket_send_buffer)
    except OSError as e:          # the port is taken, or the address is not this host's
        raise LatsimError(f"cannot listen on {_short(host)}:{port}: {e.strerror or e}",
                          source="--host/--port") from None
    except OverflowError as e:
        raise LatsimError(f"{e}", source="--socket-send-buffer",
                          value=socket_send_buffer, has_value=True) from None
    try:
        bound = sock.getsockname()[1]       # --port 0: the one the OS chose
        if not is_loopback(host) and not api_key:
            _warn(f"listening on {host}:{bound}, beyond loopback, without an API key: "
                  f"anyone who can reach it can use the engine (set LATSIM_API_KEY or "
                  f"--api-key)")
        try:
            engine = build_engine(model, device, policy=policy, seed=seed,
                                  max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  chunk_size=chunk_size, aging_s=aging_s,
                                  num_blocks=num_blocks, threads=threads, kv_rules=kv_rules)
        except (ValueError, OSError, ImportError) as e:
            # The flags passed the checks above, so what is left is the checkpoint's
            # content or the engine's limits (e.g. more blocks than memory allows).
            raise LatsimError(f"cannot build the engine: {_short(e, 200)}",
                              source="--model", value=_short(model), has_value=True) from None
        except (MemoryError, RuntimeError) as e:
            # torch reports a failed allocation as a RuntimeError (OutOfMemoryError on CUDA).
            if not isinstance(e, MemoryError) and "alloc" not in str(e) \
                    and "out of memory" not in str(e).lower():
                raise
            raise LatsimError(f"the model and KV cache do not fit in memory "
                              f"({_short(str(e) or type(e).__name__, 120)})",
                              source="--num-blocks", value=num_blocks, has_value=True) from None
        console.print(f"latsim serve: {model} on {device}, policy {policy}, backpressure "
                      f"{backpressure} ({stream_buffer_frames} frames), "
                      f"{'API key required' if api_key else 'no API key'}, "
                      f"http://{host}:{bound}/v1/completions", markup=False, highlight=False,
                      soft_wrap=True)
    except BaseException:
        sock.close()
        raise
    _serve(model, device, model_name=served_name, heartbeat_s=heartbeat_s or None,
           backpressure=backpressure, stream_buffer_frames=stream_buffer_frames,
           api_key=api_key, max_body_bytes=max(1, int(max_body_mb * (1 << 20))),
           request_timeout_s=request_timeout_s or None, sock=sock, engine=engine)


BENCH_OUTPUTS = ("requests.csv", "tokens.csv", "summary.json")   # what a bench run writes


def bench(
    url: str = typer.Option(..., "--url", help="server base URL (or a full .../completions URL)"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="trace file (any format "
                                         "`latsim trace` reads); default: synthetic Poisson"),
    fmt: Optional[str] = typer.Option(None, "--format", help="azure|mooncake|vidur|csv"),
    rate: Optional[float] = typer.Option(None, "--rate", min=1e-6,
                                         help="req/s: Poisson rate, or rescale the trace to it"),
    speedup: Optional[float] = typer.Option(None, "--speedup", min=1e-6,
                                            help="divide the trace's times by this"),
    limit: int = typer.Option(100, "--limit", "--max-requests", min=1, help="requests to send"),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", min=1, help="synthetic only"),
    output_tokens: int = typer.Option(64, "--output-tokens", min=1, help="synthetic only"),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens", min=1),
    max_output_tokens: Optional[int] = typer.Option(None, "--max-output-tokens", min=1),
    model: Optional[str] = typer.Option(None, "--model", help="model name to send "
                                        "(default: the first of GET /v1/models)"),
    pool_size: int = typer.Option(256, "--pool-size", min=1, help="keep-alive connections"),
    http2: bool = typer.Option(False, "--http2", help="offer HTTP/2 (needs the h2 package; "
                               "negotiated over https only)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="LATSIM_API_KEY",
                                          show_envvar=True,
                                          help="sent as 'Authorization: Bearer <key>'"),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos"),
    send_priority: bool = typer.Option(True, "--priority/--no-priority",
                                       help="send each request's class index as vLLM's "
                                       "'priority' (vLLM refuses a nonzero one unless "
                                       "started with --scheduling-policy priority)"),
    timeout: float = typer.Option(600.0, "--timeout", min=0.01, help="per request, s"),
    max_wall_s: Optional[float] = typer.Option(None, "--max-wall-s", min=0.01,
                                               help="stop the whole run after this long"),
    seed: int = typer.Option(0, "--seed"),
    out: Path = typer.Option(Path("results/bench"), "--out"),
    force: bool = typer.Option(False, "--force", help="--out may hold an earlier run: it is "
                               "replaced"),
) -> None:
    """Replay a trace over real HTTP/SSE against an OpenAI-compatible server.

    Exit code 0 when at least one request completed (failures are counted in the
    summary), 1 when none did, 2 for bad input (one line, before anything is sent)."""
    import numpy as np
    import pandas as pd

    from simulator.wire.benchclient import bench_outputs, check_url, need_h2, run_bench
    from simulator.report.files import StagedDir, check_out_dir, json_safe
    from simulator.report.tables import latency_table, throughput_table
    from simulator.workload import Workload
    _need("httpx")
    check_out_dir(out, force=force)
    check_url(url)
    for opt, v in (("--rate", rate), ("--speedup", speedup)):
        if v is not None and not math.isfinite(v):
            raise LatsimError("must be a finite number", source=opt, value=v, has_value=True)
    if http2:
        need_h2()
    api_key = _api_key(api_key)
    if trace is not None:
        if rate is not None and speedup is not None:
            raise LatsimError("give at most one of --rate and --speedup", source="--rate")
        from simulator.cli.trace import load_trace
        wl = load_trace(trace, fmt, speedup=speedup, rate=rate, limit=limit, seed=seed)
        if max_prompt_tokens or max_output_tokens:
            wl.prompt_tokens = np.minimum(wl.prompt_tokens, max_prompt_tokens or 1 << 62)
            wl.output_tokens = np.minimum(wl.output_tokens, max_output_tokens or 1 << 62)
    else:
        rng = np.random.default_rng(seed)
        wl = Workload(arrival_s=np.cumsum(rng.exponential(1.0 / (rate or 1.0), limit)),
                      prompt_tokens=np.full(limit, prompt_tokens),
                      output_tokens=np.full(limit, output_tokens), priority=np.zeros(limit))
        wl.arrival_s -= wl.arrival_s[0]         # first request at t = 0
    recs, facts = asyncio.run(run_bench(url, wl, model=model, pool_size=pool_size, http2=http2,
                                        timeout=timeout, max_wall_s=max_wall_s,
                                        ignore_eos=ignore_eos, seed=seed, api_key=api_key,
                                        send_priority=send_priority))
    facts["trace"] = str(trace) if trace is not None else None
    df, summary = bench_outputs(recs, wl, facts)
    with StagedDir(out, BENCH_OUTPUTS) as staged:   # moved into place whole, at once
        df.to_csv(staged.path / "requests.csv", index=False, float_format="%.9g")
        # Every content frame's arrival (what ``latsim calibrate`` reads to time the steps).
        pd.DataFrame([(i, k, t) for i, r in enumerate(recs) for k, t in enumerate(r.times)],
                     columns=["request_id", "token_index", "time_s"]).to_csv(
            staged.path / "tokens.csv", index=False, float_format="%.9g")
        (staged.path / "summary.json").write_text(json.dumps(json_safe(summary), indent=2)
                                                  + "\n")
    s, run = summary["overall"], summary["run"]
    console.print(f"bench: {s['num_requests']} sent, {s['completed']} completed, "
                  f"{run['failed']} failed ({run['errors']} with an error) in "
                  f"{facts['wall_s']:.2f} s -> {facts['url']}", markup=False, highlight=False)
    if run["first_error"]:
        console.print(f"first error: {run['first_error']}", markup=False)
    versions = ", ".join(f"{k} x{v}" for k, v in run["http_versions"].items()) or "-"
    asked = ""
    if http2:
        asked = (" (HTTP/2 asked for; the server answered HTTP/1.1)" if run["http2_fallback"]
                 else " (HTTP/2 offered)")
    console.print(f"HTTP: {versions}{asked}; server timing: {run['server_timing']}",
                  markup=False, highlight=False)
    console.print(latency_table("Latency (client side)", {"bench": s}))
    console.print(throughput_table({"bench": s}))
    console.print(f"wrote {out / 'requests.csv'}, {out / 'tokens.csv'}, {out / 'summary.json'}")
    if run["http2_fallback"]:
        why = (": over http:// httpx never upgrades, HTTP/2 needs an https:// server offering "
               "it" if facts["url"].startswith("http://") else "")
        _warn(f"--http2 was asked for but the server answered with HTTP/1.1, so this run "
              f"measured HTTP/1.1{why}")
    if run["failed"] and s["completed"]:
        _warn(f"{run['failed']} of {s['num_requests']} requests failed (the error column of "
              f"{out / 'requests.csv'} says why)")
    if not s["completed"]:
        what = (f"all {s['num_requests']} requests failed, none completed (first error: "
                f"{run['first_error'] or 'none recorded'})" if s["num_requests"] else
                "no request was sent before --max-wall-s")
        err_console.print(f"latsim: bench: {what}", markup=False, highlight=False,
                          soft_wrap=True)
        raise typer.Exit(1)
