"""``latsim validate --endpoint``: the simulator against the real server over real HTTP.

Where ``real_engine.validate`` replays a trace through the engine in-process
(no wire), this replays it with ``latsim bench`` against ``latsim serve``, so
the measured side includes everything between the client and the engine:
connection set-up, the request's upload, HTTP parsing, the hop to the engine
thread (T_net), and each token's way back as an SSE frame (T_stream). Both
are measured from the server's timing trailer (``x-latsim-timing``: server
wall-clock times), which needs client and server on one host (loopback) so
that they share the clock.

The simulated side runs the same workload with the server's policy and limits,
the profile as cost model, and a network that is the loopback the bench
crossed: distance 0, no TLS, one client with the bench's keep-alive pool, and
a base RTT *measured* before the run as the median round trip of a minimal
HTTP request on a kept-alive connection (what a request and a frame pay on
top of the kernel: the server's event loop and the client's). Bandwidth is
not what limits loopback, so links are set to ``LOOPBACK_MBPS``.

Endpoints: ``local`` starts ``latsim serve`` in this process on a free
loopback port, one server per policy (the engine, its model and KV cache are
built once; its policy is swapped while idle, as ``validate`` does); a URL
uses a running ``latsim serve``, whose ``GET /metrics`` says which policy and
limits it runs, so that one policy is compared.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd

from simulator.wire.benchclient import _WORDS, bench_outputs, check_url, run_bench
from simulator.config.scenario import validate_scenario
from simulator.errors import LatsimError
from simulator.report.metrics import BREAKDOWN, requests_table, summarize
from simulator.report.percentile import pct_ms
from simulator.loops.simulate import simulate
from simulator.workload import Workload

from real_engine.metrics import mean_frame_bytes
from real_engine.validate import compare, policy_kwargs, write_results

STAGES = BREAKDOWN   # the E2E stages, all measured over the wire
LOOPBACK_MBPS = 10_000.0     # nominal: on loopback a frame's transmit time is negligible
POOL_SIZE = 32               # the bench's keep-alive connections (the simulated client's pool)
# What latsim bench sends besides the prompt's words (headers + JSON envelope), bytes.
REQUEST_OVERHEAD_BYTES = 300
BYTES_PER_WORD = float(np.mean([len(w) + 1 for w in _WORDS]))


def parse_endpoint(text: str) -> Optional[str]:
    """``local`` -> None (start a server here); an http(s) URL -> its base URL."""
    t = text.strip()
    if t == "local":
        return None
    if not t.startswith(("http://", "https://")) or len(t.split("://", 1)[1]) == 0:
        raise LatsimError("must be 'local' or an http(s)://host:port URL",
                          source="--endpoint", value=text, has_value=True)
    check_url(t, source="--endpoint")
    return t.rstrip("/")


def measure_rtt(url: str, n: int = 30, timeout: float = 5.0) -> float:
    """Median round trip (s) of ``GET /health`` on one kept-alive connection.

    The first request (connection set-up) is not counted. An unreachable or
    non-answering URL is a one-line ``LatsimError``."""
    import httpx
    times = []
    try:
        with httpx.Client(base_url=url, timeout=timeout) as c:
            for i in range(n + 1):
                t0 = time.perf_counter()
                r = c.get("/health")
                dt = time.perf_counter() - t0
                if r.status_code != 200:
                    raise LatsimError(f"GET /health answered HTTP {r.status_code}", source=url)
                if i:
                    times.append(dt)
    except httpx.HTTPError as e:
        raise LatsimError(f"cannot reach the server ({type(e).__name__}: {e})",
                          source=url) from None
    return statistics.median(times)


def server_info(url: str, timeout: float = 5.0) -> dict:
    """``GET /metrics`` of a ``latsim serve`` (Prometheus text, ``real_engine.metrics``),
    parsed; its engine settings (``latsim:engine_info``, required) under ``engine``."""
    import httpx

    from real_engine.metrics import engine_settings, parse
    try:
        m = parse(httpx.get(url + "/metrics", timeout=timeout).text)
    except (httpx.HTTPError, ValueError) as e:
        raise LatsimError(f"cannot read GET /metrics ({type(e).__name__})", source=url) from None
    eng = engine_settings(m)
    if eng is None:
        raise LatsimError("not a latsim serve endpoint: GET /metrics names no engine "
                          "settings (latsim:engine_info)", source=url)
    return dict(m, engine=eng)


def wire_scenario(policy: str, settings: dict, num_blocks: int, rtt_s: float,
                  frame_bytes: float, pool_size: int = POOL_SIZE):
    """The simulated side: the server's limits, and the loopback wire the bench used."""
    return validate_scenario({
        "name": "validate-endpoint", "seed": 0,
        "workload": {"kind": "synthetic", "num_requests": 1},   # replaced by the trace
        "network": {"distance_km": 0, "base_rtt_ms": rtt_s * 1e3, "tls": "none",
                    "gateway_ms": 0, "connection_reuse": True, "clients": 1,
                    "pool_size": pool_size, "keepalive_s": 3600, "uplink_mbps": LOOPBACK_MBPS,
                    "request_overhead_bytes": REQUEST_OVERHEAD_BYTES,
                    "bytes_per_prompt_token": BYTES_PER_WORD},
        "stream": {"frame_overhead_bytes": int(round(frame_bytes)), "bytes_per_token": 0,
                   "downlink_mbps": LOOPBACK_MBPS},
        "engine": {**policy_kwargs(settings), "policy": policy, "kv": {"num_blocks": num_blocks}},
        "model": {"cost": {"kind": "profile", "path": "<profile>"}},
    }, source="validate --endpoint")


def stage_errors(real_df: pd.DataFrame, sim_df: pd.DataFrame) -> dict:
    """P50/P99 (ms) of every E2E stage, real and simulated, and the relative error
    (finished requests; a stage the real side could not measure is None)."""
    out = {}
    rf, sf = real_df[real_df["finished"]], sim_df[sim_df["finished"]]
    for st in STAGES:
        r = rf[st].to_numpy(dtype=float)
        s = sf[st].to_numpy(dtype=float)
        r, s = r[~np.isnan(r)], s[~np.isnan(s)]
        for label, q in (("median", 50), ("p99", 99)):
            rv = pct_ms(r, q, empty=None)
            sv = pct_ms(s, q, empty=None)
            err = (sv - rv) / rv if rv and sv is not None and rv > 0 else None
            out[f"{label}_{st}_ms"] = {"real": rv, "sim": sv, "rel_err": err}
    return out


def bench_and_simulate(url: str, profile: dict, wl: Workload, policy: str, settings: dict,
                       num_blocks: int, *, pool_size: int = POOL_SIZE, warmup_requests: int = 4,
                       timeout: float = 600.0, seed: int = 0,
                       log: Callable[[str], None] = lambda s: None) -> dict:
    """Bench ``wl`` against the server at ``url`` and simulate it; both tables and the errors."""
    if warmup_requests:
        # Lazy allocations and first-request paths, outside the measured run.
        k = min(warmup_requests, len(wl))
        warm = Workload(arrival_s=np.zeros(k), prompt_tokens=wl.prompt_tokens[:k],
                        output_tokens=wl.output_tokens[:k], priority=wl.priority[:k])
        asyncio.run(run_bench(url, warm, pool_size=pool_size, timeout=timeout, seed=seed + 1))
    rtt = measure_rtt(url)
    log(f"{policy}: loopback RTT (HTTP round trip) {rtt * 1e3:.3f} ms; benching {len(wl)} "
        f"requests against {url} ...")
    recs, facts = asyncio.run(run_bench(url, wl, pool_size=pool_size, timeout=timeout,
                                        seed=seed))
    rdf, real = bench_outputs(recs, wl, facts)
    if real["run"]["errors"]:
        raise LatsimError(f"{real['run']['errors']} of {len(rdf)} requests failed; first: "
                          f"{real['run']['first_error']}", source=url)
    if rdf["enqueued"].isna().all():
        raise LatsimError("the server sent no usable timing trailer (not latsim serve, or "
                          "not on this host's clock)", source=url)
    info = server_info(url)
    frame_bytes = mean_frame_bytes(info) or 150.0
    sc = wire_scenario(policy, settings, num_blocks, rtt, frame_bytes, pool_size)
    res = simulate(sc, 0, workload=wl, profile=profile)
    sdf = requests_table(res)
    sim = summarize(sdf, res.rec.itl)
    log(f"{policy}: done in {facts['wall_s']:.1f} s wall")
    return {"real": real["overall"], "sim": sim, "errors": compare(real["overall"], sim),
            "stages": stage_errors(rdf, sdf), "real_table": rdf, "sim_table": sdf,
            "rtt_ms": rtt * 1e3, "frame_bytes": frame_bytes, "real_wall_s": facts["wall_s"],
            "http_versions": real["run"]["http_versions"],
            "extrapolations": res.extrapolations, "server": {k: info.get(m) for k, m in (
                ("pauses", "latsim:backpressure_pauses_total"),
                ("degraded", "latsim:streams_degraded_total"),
                ("buffered_frames_peak", "latsim:stream_buffered_frames_peak"),
                ("requests_cancelled", 'vllm:request_success_total{finished_reason="abort"}'))}}


def run_local(engine, profile: dict, wl: Workload, policies: Sequence[str], *,
              settings: dict, seed: int = 0, log: Callable[[str], None] = lambda s: None,
              **kw) -> dict:
    """One in-process ``latsim serve`` of ``engine`` per policy, on a free loopback
    port, benched and simulated; the results per policy."""
    from simulator.model.scheduling import make_policy

    from real_engine.hosting import BackgroundServer
    from real_engine.server import make_app
    out = {}
    for name in policies:
        pol = make_policy(name, **policy_kwargs(settings))
        engine.policy, engine.waiting = pol, pol.new_queue()     # the engine is idle here
        with BackgroundServer(make_app(engine, engine.model.cfg.name)) as srv:
            out[name] = bench_and_simulate(srv.url, profile, wl, name, settings,
                                           engine.cache.num_blocks, seed=seed, log=log, **kw)
    return out


def run_remote(url: str, profile: dict, wl: Workload, policies: Optional[Sequence[str]],
               *, seed: int = 0, log: Callable[[str], None] = lambda s: None,
               **kw) -> tuple[dict, dict]:
    """Bench and simulate a running ``latsim serve``: its own policy and limits (from
    ``GET /metrics``). ``policies``, if given, must be exactly that policy."""
    measure_rtt(url, n=1)                  # reachable? (a one-line error if not)
    eng = server_info(url)["engine"]
    if policies and list(policies) != [eng["policy"]]:
        raise LatsimError(f"the server runs policy {eng['policy']!r}; --policies asks for "
                          f"{','.join(policies)} (a running server has one policy)",
                          source="--policies")
    settings = {k: eng.get(k) for k in ("max_num_seqs", "max_num_batched_tokens",
                                        "chunk_size", "aging_s")}
    res = bench_and_simulate(url, profile, wl, eng["policy"], settings, int(eng["num_blocks"]),
                             seed=seed, log=log, **kw)
    return {eng["policy"]: res}, eng


def run_endpoint_validation(endpoint: str, profile: dict, wl: Workload,
                            policies: Optional[Sequence[str]], *, model: str,
                            device: str = "cpu", settings: dict, load: Optional[float] = None,
                            seed: int = 0, log: Callable[[str], None] = lambda s: None,
                            **kw) -> tuple[dict, dict]:
    """Everything ``latsim validate --endpoint`` does short of printing and writing.

    ``endpoint``: ``local`` or a URL (``parse_endpoint``); ``policies``: every one
    to compare (local), or None / the server's own (URL). ``load`` rescales the
    arrivals to that fraction of the simulated saturation throughput (as
    ``validate --load``). Returns ``(results, meta)`` for ``write_endpoint``."""
    from real_engine.validate import at_load, saturation_throughput
    url = parse_endpoint(endpoint)
    meta = {"endpoint": endpoint, "requests": len(wl), "seed": seed}

    def rescale(num_blocks: int, sett: dict) -> Workload:
        if load is None:
            return wl
        cap = saturation_throughput(profile, policy_kwargs(sett), num_blocks, wl)
        meta.update(load=load, saturation_rps=cap, rate_rps=load * cap)
        log(f"saturation throughput (simulated) {cap:.2f} req/s; replaying at "
            f"{load:.0%} = {load * cap:.2f} req/s")
        return at_load(wl, load * cap)

    if url is None:
        from real_engine.profile import build_engine
        pols = list(policies or ["chunked"])
        engine = build_engine(model, device, seed=seed, policy=pols[0],
                              max_num_seqs=settings["max_num_seqs"],
                              max_num_batched_tokens=settings["max_num_batched_tokens"])
        nb = engine.cache.num_blocks
        res = run_local(engine, profile, rescale(nb, settings), pols, settings=settings,
                        seed=seed, log=log, **kw)
        meta.update(model=model, device=device, settings=settings, num_blocks=nb)
    else:
        measure_rtt(url, n=1)
        eng = server_info(url)["engine"]
        sett = {k: eng.get(k) for k in ("max_num_seqs", "max_num_batched_tokens",
                                        "chunk_size", "aging_s")}
        wl2 = rescale(int(eng["num_blocks"]), sett)
        res, eng = run_remote(url, profile, wl2, policies, seed=seed, log=log, **kw)
        meta.update(server=eng)
    return res, meta


def error_table(results: dict, title: str = "Simulated vs real, over the wire"):
    """``validate.error_table`` with every E2E stage too (the wire's are measured here)."""
    from real_engine.validate import error_table as table
    return table(results, title, stages=STAGES, digits=3)


def summary_lines(results: dict) -> list[str]:
    """Per policy: the measured wire (RTT, HTTP version, frame size) and wall time."""
    return [f"{name}: RTT {r['rtt_ms']:.3f} ms, {r['frame_bytes']:.0f} B/frame, "
            f"{', '.join(f'{k} x{v}' for k, v in r['http_versions'].items())}; "
            f"real run {r['real_wall_s']:.1f} s" for name, r in results.items()]


def write_endpoint(out_dir: Path, results: dict, meta: dict) -> list[Path]:
    """``real-<policy>.csv`` (bench table), ``sim-<policy>.csv`` and ``endpoint.json``."""
    return write_results(out_dir, results, meta, "endpoint.json")
