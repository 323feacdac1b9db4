"""``latsim serve`` and ``latsim bench``: the real server and the real load client.

Command functions only; ``simulator.cli.main`` registers them. The web stack
(FastAPI, uvicorn, httpx) is an optional extra (``pip install 'latsim[serve]'``):
both commands import it lazily and turn a missing package into a one-line
``LatsimError``, so the rest of latsim works without it.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from simulator.errors import LatsimError

console = Console()


def _need(*modules: str) -> None:
    """Raise a one-line error naming the extra when a web-stack package is missing."""
    import importlib.util
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise LatsimError(f"needs {', '.join(missing)}: pip install 'latsim[serve]'")


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
    aging_s: float = typer.Option(30.0, "--aging-s", min=0.001),
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
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Serve the real engine behind an OpenAI-compatible streaming API (blocks)."""
    from simulator.model.scheduling import POLICIES
    if device not in ("cpu", "cuda"):
        raise LatsimError("must be cpu or cuda", source="--device", value=device, has_value=True)
    if policy not in POLICIES:
        raise LatsimError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}",
                          source="--policy")
    if backpressure not in ("block", "buffer", "degrade"):
        raise LatsimError("must be block, buffer or degrade", source="--backpressure",
                          value=backpressure, has_value=True)
    for name, v, ok in (("--preemption", preemption, ("recompute", "swap")),
                        ("--kv-allocation", kv_allocation, ("paged", "contiguous"))):
        if v not in ok:
            raise LatsimError(f"must be {' or '.join(ok)}", source=name, value=v, has_value=True)
    if prefix_caching and kv_allocation == "contiguous":
        raise LatsimError("needs --kv-allocation paged", source="--prefix-caching")
    _need("fastapi", "uvicorn", "torch")
    from real_engine.server import serve as _serve
    from simulator.model.kv.space import KVRules
    kv_rules = KVRules(allocation=kv_allocation, preemption=preemption,
                       prefix_caching=prefix_caching)
    console.print(f"latsim serve: {model} on {device}, policy {policy}, backpressure "
                  f"{backpressure} ({stream_buffer_frames} frames), "
                  f"http://{host}:{port}/v1/completions")
    try:
        _serve(model, device, host, port, model_name=served_name, policy=policy, seed=seed,
               heartbeat_s=heartbeat_s or None, backpressure=backpressure,
               stream_buffer_frames=stream_buffer_frames, send_buffer_bytes=socket_send_buffer,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
               chunk_size=chunk_size, aging_s=aging_s, num_blocks=num_blocks, threads=threads,
               kv_rules=kv_rules)
    except OSError as e:          # the port is taken, or the address is not this host's
        raise LatsimError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                          source="--port") from None


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
    http2: bool = typer.Option(False, "--http2", help="HTTP/2 (needs the h2 package)"),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos"),
    timeout: float = typer.Option(600.0, "--timeout", min=0.01, help="per request, s"),
    max_wall_s: Optional[float] = typer.Option(None, "--max-wall-s", min=0.01,
                                               help="stop the whole run after this long"),
    seed: int = typer.Option(0, "--seed"),
    out: Path = typer.Option(Path("results/bench"), "--out"),
) -> None:
    """Replay a trace over real HTTP/SSE against an OpenAI-compatible server."""
    import numpy as np

    from simulator.wire.benchclient import bench_outputs, run_bench
    from simulator.report.output import json_safe, latency_table, throughput_table
    from simulator.workload import Workload
    _need("httpx")
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
                                        ignore_eos=ignore_eos, seed=seed))
    facts["trace"] = str(trace) if trace is not None else None
    df, summary = bench_outputs(recs, wl, facts)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "requests.csv", index=False, float_format="%.9g")
    (out / "summary.json").write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    s = summary["overall"]
    console.print(f"bench: {s['num_requests']} sent, {s['completed']} completed, "
                  f"{summary['run']['errors']} errors in {facts['wall_s']:.2f} s -> {facts['url']}")
    if summary["run"]["first_error"]:
        console.print(f"first error: {summary['run']['first_error']}", markup=False)
    run = summary["run"]
    versions = ", ".join(f"{k} x{v}" for k, v in run["http_versions"].items()) or "-"
    console.print(f"HTTP: {versions}{' (HTTP/2 offered)' if http2 else ''}; server timing: "
                  f"{run['server_timing']}", markup=False, highlight=False)
    console.print(latency_table("Latency (client side)", {"bench": s}))
    console.print(throughput_table({"bench": s}))
    console.print(f"wrote {out / 'requests.csv'}, {out / 'summary.json'}")
