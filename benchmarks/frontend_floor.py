"""The HTTP software floor under a streamed completion, measured: what opening a
connection per request costs a Python load generator and a Python server, and what one
request on a kept-alive connection costs them before its first SSE line arrives.

Why: the recorded vLLM runs in ``data/vllm-h100-runs`` were driven by inference-perf at
commit 3b6f82a (``inference_perf/client/modelserver/openai_client.py``), which opens a
new ``aiohttp.ClientSession`` (its own ``TCPConnector`` and resolver) for every request,
so every request pays a connection's set-up (inference-perf PR #282, merged after that
commit, describes exactly this and shares sessions per worker). latsim prices a new
connection's round trips (``network.tls``, ``base_rtt_ms``) and, with ``network.
connect_ms``, the software's own part of it; this benchmark measures that part with the
same stacks: an aiohttp client (as inference-perf) against uvicorn + FastAPI with
uvloop and httptools (as ``vllm serve``), the body parsed into a pydantic model shaped
like vLLM's ``CompletionRequest``, and the first SSE chunk written at once (no model, no
tokeniser: those are ``engine.frontend``'s other terms).

It prints, per mode, the median, P10 and minimum of the client's time from just before
``session.post`` to the first line of the body (inference-perf's TTFT clock):

- ``fresh``: a new ClientSession and TCPConnector per request (inference-perf at 3b6f82a);
- ``keepalive``: one session for every request (a pooled client).

``fresh - keepalive`` is the connection's software set-up on loopback (round trips of a
real network and a real DNS server come on top: ``base_rtt_ms``, ``dns_ms``). A loaded
machine inflates every figure; the P10 is the estimate quoted in
``benchmarks/vllm_runs.py``.

    pip install aiohttp aiodns fastapi "uvicorn[standard]"
    python benchmarks/frontend_floor.py [--requests 400]

Measured on the 2-core development box (2026-12-04, loaded by other work), P10 of 380
requests each, four rounds: fresh 1.525 / 1.761 / 1.414 / 1.265 ms, keepalive 0.774 /
1.030 / 0.666 / 0.672 ms, so the set-up is 0.59-0.75 ms (0.7 ms is what
``benchmarks/vllm_runs.py`` uses).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Union

WARMUP = 20


def _serve(port: int) -> None:
    """uvicorn + FastAPI: parse the body into a CompletionRequest-shaped model, stream
    one completion chunk at once, then ``[DONE]``."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from pydantic import BaseModel

    class StreamOptions(BaseModel):
        include_usage: Optional[bool] = True
        continuous_usage_stats: Optional[bool] = False

    class CompletionRequest(BaseModel):
        # The fields of vLLM's OpenAI CompletionRequest that a request like
        # inference-perf's touches, with their types and defaults.
        model: Optional[str] = None
        prompt: Union[List[int], List[List[int]], str, List[str], None] = None
        best_of: Optional[int] = None
        echo: Optional[bool] = False
        frequency_penalty: Optional[float] = 0.0
        logit_bias: Optional[Dict[str, float]] = None
        logprobs: Optional[int] = None
        max_tokens: Optional[int] = 16
        n: int = 1
        presence_penalty: Optional[float] = 0.0
        seed: Optional[int] = None
        stop: Optional[Union[str, List[str]]] = []
        stream: Optional[bool] = False
        stream_options: Optional[StreamOptions] = None
        suffix: Optional[str] = None
        temperature: Optional[float] = None
        top_p: Optional[float] = None
        user: Optional[str] = None
        top_k: Optional[int] = None
        min_p: Optional[float] = None
        repetition_penalty: Optional[float] = None
        length_penalty: float = 1.0
        stop_token_ids: Optional[List[int]] = []
        include_stop_str_in_output: bool = False
        ignore_eos: bool = False
        min_tokens: int = 0
        skip_special_tokens: bool = True
        spaces_between_special_tokens: bool = True
        truncate_prompt_tokens: Optional[int] = None
        allowed_token_ids: Optional[List[int]] = None
        prompt_logprobs: Optional[int] = None
        add_special_tokens: bool = True
        response_format: Optional[Dict[str, Any]] = None
        priority: int = 0
        request_id: str = "bench"

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        async def frames():
            chunk = {"id": "cmpl-bench", "object": "text_completion", "created": 0,
                     "model": req.model, "choices": [{"index": 0, "text": " hello",
                                                      "logprobs": None, "finish_reason": None,
                                                      "stop_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(0.001)
            yield "data: [DONE]\n\n"
        return StreamingResponse(frames(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")


async def _first_line(session, url: str, body: str) -> float:
    t0 = time.perf_counter()
    async with session.post(url, headers={"Content-Type": "application/json"},
                            data=body) as r:
        async for _ in r.content:
            t1 = time.perf_counter()
            break
        await r.text()
    return (t1 - t0) * 1000.0


async def _client(port: int, n: int, fresh: bool) -> List[float]:
    import aiohttp
    # A prompt of inference-perf's size here (~2.5 KB of text), its request keys.
    body = json.dumps({"model": "m", "prompt": "lorem ipsum dolor " * 140, "max_tokens": 247,
                       "ignore_eos": True, "stream": True})
    url = f"http://localhost:{port}/v1/completions"
    out: List[float] = []
    shared = None if fresh else aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=10))
    try:
        for _ in range(n + WARMUP):
            if fresh:
                async with aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(limit=10)) as s:
                    out.append(await _first_line(s, url, body))
            else:
                out.append(await _first_line(shared, url, body))
            await asyncio.sleep(0.005)
    finally:
        if shared is not None:
            await shared.close()
    return out[WARMUP:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--port", type=int, default=18731)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    try:
        import aiohttp  # noqa: F401
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"needs {e.name}: pip install aiohttp aiodns fastapi 'uvicorn[standard]'")
        return 2
    server = mp.Process(target=_serve, args=(args.port,), daemon=True)
    server.start()
    time.sleep(3.0)
    try:
        p10 = {"fresh": [], "keepalive": []}
        for _ in range(args.rounds):
            for mode in ("fresh", "keepalive"):
                ts = asyncio.run(_client(args.port, args.requests, mode == "fresh"))
                q = statistics.quantiles(ts, n=10)
                p10[mode].append(q[0])
                print(f"{mode:10s} median {statistics.median(ts):6.3f} ms  P10 {q[0]:6.3f}  "
                      f"min {min(ts):6.3f}  P90 {q[-1]:6.3f}  (n={len(ts)})")
        d = [f - k for f, k in zip(p10["fresh"], p10["keepalive"])]
        print(f"connection set-up (fresh - keepalive, P10): "
              + ", ".join(f"{x:.3f}" for x in d) + " ms")
    finally:
        server.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
