"""An OpenAI-compatible streaming HTTP server over ``EngineCore`` (``latsim serve``).

Endpoints: ``POST /v1/completions`` (``prompt``: a string or a list of token
ids), ``POST /v1/chat/completions`` (``messages``), both with ``max_tokens``
and ``stream: true|false``; ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus text format, vLLM's metric names where vLLM has
the metric, the engine's settings and backpressure counters as ``latsim:*``:
``real_engine.metrics``).

Tokens. The weights are random, so text means nothing to the model; what
matters for latency is the number of tokens. The tokenizer is therefore a
trivial deterministic one: the prompt is split on whitespace and every word
becomes one token, ``crc32(word) % vocab`` (so a prompt of N words is N prompt
tokens, which is what ``latsim bench`` sends). Chat messages are tokenized as
``"<role>: <content>"`` per message, concatenated. A generated id ``i`` is
rendered as the text ``" t<i>"``.

Generation. The engine always generates exactly ``max_tokens`` tokens (it
ignores EOS), so ``ignore_eos`` is accepted and has no further effect;
``finish_reason`` is ``"length"``. Streaming sends one SSE frame
``data: {chunk}\\n\\n`` per generated token, then (``stream_options:
{"include_usage": true}``) a chunk with the usage, then ``data: [DONE]\\n\\n``.

Fields (``openai_api.parse_request``). Every field the API accepts is checked for
type and range, and a bad one is a 400 naming it (``param``). ``priority`` is an
integer in [0, ``MAX_PRIORITY``], the simulator's class range. Sampling fields
(``temperature``, ``top_p``, ``top_k``, ``seed``, penalties) are checked and then
have no effect: sampling is greedy. What the server cannot honour (``n`` or
``best_of`` above 1, a ``stop``, ``echo``, ``logprobs``...) is refused with a 400
unless it asks for nothing. Unknown fields are ignored, as vLLM ignores them.

Threads. The engine is not thread-safe, so ONE background thread owns it: it
takes commands (add, cancel) from a queue, steps the engine while it has work
and hands each step's tokens to per-request inboxes (``streams.Inbox``) on the event
loop with ``loop.call_soon_threadsafe`` (one call per step, not per token).
The event loop never touches the engine; ``/metrics`` reads a snapshot the
thread publishes after every step and command. The loop's per-token work (the
hand-over in slices, the inbox, the frame) is kept small in ``real_engine.streams``,
so ``/health`` waits behind a slice of streams, not a step's worth; ``serve`` shortens
the GIL's switch interval (``SWITCH_INTERVAL_S``) so the loop, which gives the GIL up
at every write, gets it back from the engine thread within half a millisecond, and
freezes the start-up heap (``gc.freeze``), so no full garbage collection walks the
model and torch on the loop mid-burst. ``benchmarks/serve_health.py`` measures it.

Disconnects. When a client goes away mid-stream, Starlette cancels the
streaming generator; its ``finally`` sends a cancel command, and the engine
thread calls ``engine.cancel(rid)`` before its next step, so the request's KV
blocks are free within one engine step of the disconnect being noticed.

Backpressure. A request's send buffer is its tokens produced by the engine but
whose frame has not yet been written to the response (Starlette asks for the
next frame only once the previous one is written, and uvicorn's write waits
while the socket and its 64 KiB transport buffer are full, so a client that
reads slowly makes this buffer grow). ``backpressure`` decides what happens
when it reaches ``stream_buffer_frames``:

- ``buffer`` (default): nothing; the buffer is unbounded and ``/metrics``
  reports what it costs (buffered frames now, their peak, estimated bytes);
- ``block``: the engine thread pauses the request (``EngineCore.pause``: off
  the schedule, KV blocks kept) before its next step, so the buffer never
  exceeds the bound; once the client has drained it to half the bound, the
  stream asks the engine thread to resume it (half, not "one below": a client
  reading at about the engine's pace would flip the request every step);
- ``degrade``: the request leaves streaming: its remaining tokens are
  collected and sent as one final frame (as a non-streamed response would
  carry them), so the engine never waits for it.

Limits, authentication, timeouts and the admission of a burst (16 new requests per
loop iteration): ``real_engine.guards``. Binding and running
the server in a thread: ``real_engine.hosting``.

Timing. A request carrying the header ``x-latsim-timing`` gets, just before
``data: [DONE]``, one SSE comment ``: latsim-timing {json}`` with the server's
wall-clock times (``time.time()``) of the request: ``received`` (body read),
``enqueued`` (handed to the engine thread), ``scheduled`` (admitted), ``first_token``
and ``last_token`` (end of the steps that made them), and ``paused_s``. A
comment is ignored by every SSE client, so the stream stays OpenAI-compatible;
``latsim bench`` uses it to measure T_net, T_queue, T_prefill and T_stream
(on one host, where client and server share the clock).
"""
from __future__ import annotations

import asyncio
import gc
import json
import socket
import sys
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from simulator.wire.benchclient import TIMING_COMMENT, TIMING_HEADER

from real_engine.engine import EngineCore
from real_engine.engineloop import _ABORT, _DONE, EngineLoop, Failed, _Stream
from real_engine.guards import (MAX_BODY_BYTES, AdmissionGate, ApiKeyGuard, Deadline,
                                DeadlineStream, read_body)
from real_engine.hosting import listen_socket
from real_engine.metrics import ServerMetrics
from real_engine.openai_api import (MAX_JSON_DEPTH, ApiError, Parsed, chunk, completion,
                                   detokenize, error_body, loads_body, parse_request,
                                   usage_chunk)
from real_engine.streams import TIMEOUT, Frames, frame as _frame



SWITCH_INTERVAL_S = 0.0005     # ``serve``'s GIL switch interval (Python's default: 5 ms)


def _error(message: str, status: int = 400, param: Optional[str] = None,
           close: bool = False) -> JSONResponse:
    # ``close``: the body was not (fully) read; draining it would be the work refused.
    headers = {"Connection": "close"} if close else None
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def make_app(engine: EngineCore, model_name: str = "latsim",
             heartbeat_s: Optional[float] = 15.0, backpressure: str = "buffer",
             stream_buffer_frames: int = 256, *, api_key: Optional[str] = None,
             max_body_bytes: int = MAX_BODY_BYTES, request_timeout_s: Optional[float] = None,
             max_json_depth: int = MAX_JSON_DEPTH) -> FastAPI:
    """A FastAPI app serving ``engine``; the engine thread runs for the app's lifespan.

    ``heartbeat_s``: a stream that has sent nothing for this long (typically a
    request still queued) gets an SSE comment ``: ping`` so proxies and clients
    keep the connection; None disables them. ``backpressure`` and
    ``stream_buffer_frames``: what a slow reader runs into. ``api_key``,
    ``max_body_bytes``, ``request_timeout_s`` (None: none) and ``max_json_depth``:
    what a request must satisfy (module docstring).
    """
    if max_body_bytes < 1:
        raise ValueError("max_body_bytes must be >= 1")
    if request_timeout_s is not None and request_timeout_s <= 0:
        raise ValueError("request_timeout_s must be > 0 (None: no timeout)")
    from contextlib import asynccontextmanager

    loop_ = EngineLoop(engine, backpressure, stream_buffer_frames)
    cfg, cache = engine.model.cfg, engine.cache
    pol = engine.policy
    # What a client needs to simulate this server (``real_engine.endpoint``).
    settings = {"model": cfg.name, "device": str(engine.device), "policy": pol.name,
                "max_num_seqs": pol.limits.max_num_seqs,
                "max_num_batched_tokens": pol.limits.max_num_batched_tokens,
                "chunk_size": getattr(pol, "chunk_size", None),
                "aging_s": getattr(pol, "aging_s", None),
                "num_blocks": cache.num_blocks, "block_size": cache.block_size,
                "backpressure": backpressure, "stream_buffer_frames": stream_buffer_frames}
    server_metrics = ServerMetrics(loop_, settings, model_name)
    loop_.observer = server_metrics

    @asynccontextmanager
    async def lifespan(app):
        loop_.start()
        try:
            yield
        finally:
            loop_.stop()

    app = FastAPI(title="latsim real engine", lifespan=lifespan)
    app.state.engine_loop = loop_
    app.state.metrics = server_metrics
    app.add_middleware(AdmissionGate)
    if api_key:                 # outside the gate: a refused request is never held
        app.add_middleware(ApiKeyGuard, key=api_key)

    @app.get("/health")
    async def health():
        if loop_.alive:
            return {"status": "ok"}
        return JSONResponse({"status": "down", "reason": loop_.failure}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        # Event-loop counters are read here, the engine's from its last snapshot.
        body, ctype = server_metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "owned_by": "latsim", "max_model_len": cfg.max_seq_len}]}

    async def handle(request: Request, chat: bool):
        deadline = Deadline(loop_, request_timeout_s) if request_timeout_s else None
        try:
            try:
                raw = await read_body(request, max_body_bytes, deadline)
            except ClientDisconnect:
                return _error("client disconnected", 499)
            received = time.time()
            body = loads_body(raw, max_json_depth)
            p = parse_request(body, chat, cfg.vocab, cfg.max_seq_len, engine.never_runs,
                              model_name)
            st = await loop_.submit(p.ids, p.max_tokens, p.priority, received)
        except ApiError as e:
            return _error(str(e), e.status, e.param, close=e.status in (408, 413))
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if p.stream:
            timing = TIMING_HEADER in request.headers
            return DeadlineStream(_stream(loop_, st, cid, created, p, chat, heartbeat_s,
                                           timing, deadline),
                                   deadline, media_type="text/event-stream",
                                   headers={"Cache-Control": "no-cache"})
        return await _collect(request, loop_, st, cid, created, p, chat, deadline)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


async def _stream(loop_: EngineLoop, st: _Stream, cid: str, created: int, p: Parsed,
                  chat: bool, heartbeat_s: Optional[float] = None, timing: bool = False,
                  deadline: Optional[Deadline] = None):
    """SSE frames, one per token (and ``: ping`` comments after ``heartbeat_s`` of
    silence); under ``degrade``, once the send buffer is full, the rest as one frame.
    At ``deadline`` the request is cancelled and the stream ends with an error event.
    Cancels the request if the generator is torn down early.

    The frames of every token already queued are written together, in one write: an
    event loop that fell behind the engine (many streams, one write and one wake-up
    each per token) then catches up by writing fewer, larger chunks, instead of
    staying behind with every other request (``/health`` included) queued behind it.
    Each frame is still its own SSE event, so what a client parses is unchanged."""
    done = False
    inbox = st.q
    frames = Frames(cid, created, p.model, chat)
    degrade = loop_.backpressure == "degrade"
    held: Optional[list] = None          # degraded: the text not streamed yet
    pending = None                       # an end marker met while taking queued tokens
    try:
        n = 0
        while True:
            wait, expires = heartbeat_s, False
            if deadline is not None:
                left = deadline.left()
                expires = heartbeat_s is None or left <= heartbeat_s
                wait = max(0.0, left) if expires else heartbeat_s
            if pending is not None:
                tok, pending = pending, None
            else:
                tok = await inbox.get(wait) if wait is None or wait > 0 else TIMEOUT
            if tok is TIMEOUT:
                if expires:
                    # Freed before the error event is written: that write may block.
                    loop_.cancel(st.rid)
                    done = True          # no [DONE]: the request did not finish
                    yield "data: " + json.dumps(error_body(deadline.expire(), 504)) + "\n\n"
                    return
                yield ": ping\n\n"
                continue
            if tok is _DONE:
                break
            if tok is _ABORT or isinstance(tok, Failed):
                done = True              # nothing left to cancel; no [DONE]: it did not finish
                err = (error_body("engine stopped", 503) if tok is _ABORT
                       else error_body(tok.message, 500))
                yield "data: " + json.dumps(err) + "\n\n"
                return
            batch = []
            while True:
                n += 1
                if held is None and degrade and st.buffered >= loop_.buffer_frames:
                    held = []
                    loop_.degraded += 1
                if held is not None:
                    held.append(detokenize(tok))
                    loop_.consumed(st)
                else:
                    batch.append(frames.frame(detokenize(tok), n == 1, n == p.max_tokens))
                if inbox.empty():
                    break
                tok = inbox.get_nowait()
                if tok is _DONE or tok is _ABORT or isinstance(tok, Failed):
                    pending = tok
                    break
            if batch:
                yield "".join(batch)
                # Starlette asks for the next chunk only after this one was written.
                for f in batch:
                    loop_.consumed(st, len(f))
        if held:
            f = _frame(chunk(cid, created, p.model, "".join(held), n == len(held), True, chat))
            yield f
            loop_.frames += 1
            loop_.frame_bytes += len(f)
        done = True
        if p.include_usage:
            yield _frame(usage_chunk(cid, created, p.model, len(p.ids), n, chat))
        if timing:
            yield f": {TIMING_COMMENT} {json.dumps(st.timing, separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        inbox.close()
        if not done:
            # Client went away (Starlette cancelled us) or the write failed: free the KV now.
            loop_.cancel(st.rid)


async def _collect(request: Request, loop_: EngineLoop, st: _Stream, cid: str,
                   created: int, p: Parsed, chat: bool,
                   deadline: Optional[Deadline] = None):
    """A non-streamed response: every token, then one JSON (cancelled on disconnect,
    or with a 504 at ``deadline``)."""
    toks: list[int] = []
    next_check = time.monotonic() + 0.1
    inbox = st.q
    try:
        while True:
            wait = 0.1 if deadline is None else min(0.1, max(0.0, deadline.left()))
            tok = await inbox.get(wait) if wait > 0 else TIMEOUT
            if tok is _DONE:
                break
            if deadline is not None and deadline.left() <= 0:
                loop_.cancel(st.rid)
                return _error(deadline.expire(), 504)
            # Nothing cancels a plain endpoint when its client leaves: check every 0.1 s
            # (whether tokens are flowing or the request is still queued).
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.1
                if await request.is_disconnected():
                    loop_.cancel(st.rid)
                    return _error("client disconnected", 499)
            if tok is TIMEOUT:
                continue
            if tok is _ABORT:
                return _error("engine stopped", 503)
            if isinstance(tok, Failed):
                return _error(tok.message, 500)
            toks.append(tok)
            loop_.consumed(st)      # taken off the buffer: a whole response never blocks
    except asyncio.CancelledError:
        loop_.cancel(st.rid)
        raise
    finally:
        inbox.close()
    return completion(cid, created, p.model, "".join(detokenize(t) for t in toks), len(p.ids),
                      len(toks), chat)


def serve(model: str = "tiny", device: str = "cpu", host: str = "127.0.0.1", port: int = 8000,
          model_name: Optional[str] = None, log_level: str = "info",
          heartbeat_s: Optional[float] = 15.0, access_log: bool = False,
          backpressure: str = "buffer", stream_buffer_frames: int = 256,
          send_buffer_bytes: Optional[int] = None, *, api_key: Optional[str] = None,
          max_body_bytes: int = MAX_BODY_BYTES, request_timeout_s: Optional[float] = None,
          sock: Optional[socket.socket] = None, engine: Optional[EngineCore] = None,
          **engine_kwargs) -> None:
    """Build the engine (``build_engine`` options in ``engine_kwargs``) and serve it (blocks).

    ``sock``: an already bound socket (``listen_socket``; ``host``, ``port`` and
    ``send_buffer_bytes`` are then unused); ``engine``: an already built engine
    (``model``, ``device`` and ``engine_kwargs`` are then unused). The socket is
    closed on return either way. The access log is off by default: one log line
    per request is work on the event loop that serves the streams, i.e. measured
    latency.
    """
    import uvicorn

    from real_engine.profile import build_engine
    # The event loop gives up the GIL on every socket write and select and must take it
    # back from the engine thread: with Python's 5 ms switch interval, each of ~256
    # writes per step could wait that long behind the engine's Python between two torch
    # ops. 0.5 ms bounds the wait (this process serves; nothing else shares its GIL).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Bound first: a taken port fails at once, not after building the model.
    if sock is None:
        sock = listen_socket(host, port, send_buffer_bytes)
    try:
        if engine is None:
            engine = build_engine(model, device, **engine_kwargs)
        name = model_name or engine.model.cfg.name
        app = make_app(engine, name, heartbeat_s, backpressure, stream_buffer_frames,
                       api_key=api_key, max_body_bytes=max_body_bytes,
                       request_timeout_s=request_timeout_s)
        # Everything built so far (the model, torch, the imports) lives as long as the
        # server: out of the collector's sight (vLLM freezes its heap once warmed up too).
        # Else the first full collection of a burst walks it all, on the event loop: 137 ms
        # at the start of serve_health.py's 300 streams (the burst's worst /health).
        gc.collect()
        gc.freeze()
        uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=access_log,
                                      lifespan="on")).run(sockets=[sock])
    finally:
        sock.close()
