"""An OpenAI-compatible streaming HTTP server over ``EngineCore`` (``latsim serve``).

Endpoints: ``POST /v1/completions`` (``prompt``: a string or a list of token
ids), ``POST /v1/chat/completions`` (``messages``), both with ``max_tokens``
and ``stream: true|false``; ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (JSON: KV blocks total/free, running/waiting requests,
requests served and cancelled).

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
``data: {chunk}\\n\\n`` per generated token, then ``data: [DONE]\\n\\n``.

Threads. The engine is not thread-safe, so ONE background thread owns it: it
takes commands (add, cancel) from a queue, steps the engine while it has work
and hands each step's tokens to per-request ``asyncio.Queue`` s on the event
loop with ``loop.call_soon_threadsafe`` (one call per step, not per token).
The event loop never touches the engine; ``/metrics`` reads a snapshot the
thread publishes after every step and command.

Disconnects. When a client goes away mid-stream, Starlette cancels the
streaming generator; its ``finally`` sends a cancel command, and the engine
thread calls ``engine.cancel(rid)`` before its next step, so the request's KV
blocks are free within one engine step of the disconnect being noticed.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import queue
import socket
import threading
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .engine import EngineCore
from .openai_api import ApiError, Parsed, chunk, completion, detokenize, error_body, parse_request

_DONE = object()    # end-of-stream marker put on a request's queue
_ABORT = object()   # the engine stopped (shutdown or a crash): the request cannot finish


def _error(message: str, status: int = 400, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


class EngineLoop:
    """The thread that owns an ``EngineCore``: commands in, tokens out to the event loop."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.cmds: "queue.Queue[tuple]" = queue.Queue()
        self.streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.thread: Optional[threading.Thread] = None
        self.stop_flag = threading.Event()
        self.rids = itertools.count()
        self.served = 0
        self.cancelled = 0
        self.steps = 0
        self.snapshot: dict = {}
        self.failure: Optional[str] = None    # why the engine thread died, if it did
        self._publish()

    # -- called from the event loop ----------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self.thread is None or not self.thread.is_alive():
            self.stop_flag.clear()
            self.thread = threading.Thread(target=self._run, name="latsim-engine", daemon=True)
            self.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread; requests still in the engine are cancelled."""
        self.stop_flag.set()
        self.cmds.put(("wake",))
        if self.thread is not None:
            self.thread.join(timeout)

    async def submit(self, ids: list[int], max_tokens: int, priority: int) -> tuple[int, asyncio.Queue]:
        """Enqueue a request on the engine; returns its id and its token queue.

        Waits for the engine thread to accept it, so an engine-side refusal
        becomes an ``ApiError`` (HTTP 400) before any response is started.
        """
        if not self.alive:
            raise ApiError(f"engine is not running ({self.failure or 'stopped'})", 503)
        loop = asyncio.get_running_loop()
        rid = next(self.rids)
        q: asyncio.Queue = asyncio.Queue()
        ack = loop.create_future()
        self.streams[rid] = (loop, q)
        self.cmds.put(("add", rid, ids, max_tokens, priority, loop, ack))
        err = await ack
        if err is not None:
            self.streams.pop(rid, None)
            raise ApiError(err)
        return rid, q

    @property
    def alive(self) -> bool:
        """The engine thread is running (and has not failed: it may still be tidying up)."""
        return self.failure is None and self.thread is not None and self.thread.is_alive()

    def cancel(self, rid: int) -> None:
        """Ask the engine thread to drop ``rid`` (a no-op if it has finished)."""
        self.cmds.put(("cancel", rid))

    # -- the engine thread ----------------------------------------------------------
    def _publish(self) -> None:
        e = self.engine
        self.snapshot = {"kv_blocks_total": e.cache.num_blocks, "kv_blocks_free": e.cache.num_free,
                         "running": e.num_running, "waiting": len(e.waiting),
                         "requests_served": self.served, "requests_cancelled": self.cancelled,
                         "engine_steps": self.steps, "time": time.time()}

    def _command(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, ids, max_tokens, priority, loop, ack = cmd
            try:
                self.engine.add_request(rid, ids, max_tokens, priority)
                err = None
            except ValueError as e:        # too long for max_seq_len or for the cache
                err = str(e)
            loop.call_soon_threadsafe(_resolve, ack, err)
        elif cmd[0] == "cancel":
            if self.engine.cancel(cmd[1]):
                self.cancelled += 1
            self.streams.pop(cmd[1], None)

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self.stop_flag.is_set():
                # Commands first: a cancel frees its blocks before the next step plans.
                try:
                    while True:
                        self._command(self.cmds.get_nowait())
                except queue.Empty:
                    pass
                if not eng.has_work:
                    self._publish()
                    try:
                        self._command(self.cmds.get(timeout=0.5))
                    except queue.Empty:
                        pass
                    continue
                res = eng.step()
                self.steps += 1
                if res.tokens:
                    self._deliver(res.tokens, set(res.finished), res.t_end)
                self._publish()
        except Exception as e:      # a bug or device error: fail requests, don't hang them
            self.failure = f"{type(e).__name__}: {e}"
            logging.getLogger("latsim.server").exception("engine thread failed")
        finally:
            eng.clear()
            self._abort_all()
            self._publish()

    def _abort_all(self) -> None:
        """End every open stream with ``_ABORT`` (the engine is gone)."""
        streams, self.streams = self.streams, {}
        for loop, q in streams.values():
            try:
                loop.call_soon_threadsafe(q.put_nowait, _ABORT)
            except RuntimeError:
                pass
        while True:                 # adds still queued: refuse them
            try:
                cmd = self.cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                try:
                    cmd[5].call_soon_threadsafe(_resolve, cmd[6], "engine stopped")
                except RuntimeError:
                    pass

    def _deliver(self, tokens: dict, finished: set, t: float) -> None:
        """Hand one step's tokens to their request queues: one thread hop per loop."""
        by_loop: dict = {}
        for rid, tok in tokens.items():
            s = self.streams.get(rid)
            if s is None:
                continue                  # cancelled meanwhile
            by_loop.setdefault(s[0], []).append((s[1], tok, rid in finished))
            if rid in finished:
                self.streams.pop(rid, None)
                self.served += 1
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:          # that event loop is closed: nobody is listening
                pass


def _resolve(fut: asyncio.Future, err) -> None:
    if not fut.done():
        fut.set_result(err)


def _put_all(items) -> None:
    for q, tok, last in items:
        q.put_nowait(tok)
        if last:
            q.put_nowait(_DONE)


class _Getter:
    """``q.get()`` with a timeout that never loses an item: the pending get survives
    a timeout (``asyncio.wait_for`` would cancel it, and a cancelled get can race
    with a put)."""

    def __init__(self, q: asyncio.Queue) -> None:
        self.q, self.task = q, None

    async def get(self, timeout: Optional[float]):
        """The next item, or ``_Getter`` itself if ``timeout`` s passed first."""
        if timeout is None and self.task is None:
            return await self.q.get()
        if self.task is None:
            self.task = asyncio.ensure_future(self.q.get())
        done, _ = await asyncio.wait({self.task}, timeout=timeout)
        if not done:
            return _Getter
        item, self.task = self.task.result(), None
        return item

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()


def make_app(engine: EngineCore, model_name: str = "latsim",
             heartbeat_s: Optional[float] = 15.0) -> FastAPI:
    """A FastAPI app serving ``engine``; the engine thread runs for the app's lifespan.

    ``heartbeat_s``: a stream that has sent nothing for this long (typically a
    request still queued) gets an SSE comment ``: ping`` so proxies and clients
    keep the connection; None disables them.
    """
    from contextlib import asynccontextmanager

    loop_ = EngineLoop(engine)
    cfg, cache = engine.model.cfg, engine.cache

    @asynccontextmanager
    async def lifespan(app):
        loop_.start()
        try:
            yield
        finally:
            loop_.stop()

    app = FastAPI(title="latsim real engine", lifespan=lifespan)
    app.state.engine_loop = loop_

    @app.get("/health")
    async def health():
        if loop_.alive:
            return {"status": "ok"}
        return JSONResponse({"status": "down", "reason": loop_.failure}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return dict(loop_.snapshot, active_streams=len(loop_.streams))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "owned_by": "latsim", "max_model_len": cfg.max_seq_len}]}

    async def handle(request: Request, chat: bool):
        try:
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError):
                raise ApiError("request body is not valid JSON") from None
            p = parse_request(body, chat, cfg.vocab, cfg.max_seq_len, cache.block_size,
                       cache.num_blocks, model_name)
            rid, q = await loop_.submit(p.ids, p.max_tokens, p.priority)
        except ApiError as e:
            return _error(str(e), e.status, e.param)
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if p.stream:
            return StreamingResponse(_stream(loop_, rid, q, cid, created, p, chat,
                                             heartbeat_s),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(request, loop_, rid, q, cid, created, p, chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


async def _stream(loop_: EngineLoop, rid: int, q: asyncio.Queue, cid: str, created: int,
                  p: Parsed, chat: bool, heartbeat_s: Optional[float] = None):
    """SSE frames, one per token (and ``: ping`` comments after ``heartbeat_s`` of
    silence); cancels the request if the generator is torn down early."""
    done = False
    getter = _Getter(q)
    try:
        n = 0
        while True:
            tok = await getter.get(heartbeat_s)
            if tok is _Getter:
                yield ": ping\n\n"
                continue
            if tok is _DONE:
                break
            if tok is _ABORT:
                done = True              # nothing left to cancel; no [DONE]: it did not finish
                yield "data: " + json.dumps(error_body("engine stopped", 503)) + "\n\n"
                return
            n += 1
            c = chunk(cid, created, p.model, detokenize(tok), n == 1, n == p.max_tokens, chat)
            yield "data: " + json.dumps(c, separators=(",", ":")) + "\n\n"
        done = True
        yield "data: [DONE]\n\n"
    finally:
        getter.close()
        if not done:
            # Client went away (Starlette cancelled us) or the write failed: free the KV now.
            loop_.cancel(rid)


async def _collect(request: Request, loop_: EngineLoop, rid: int, q: asyncio.Queue, cid: str,
                   created: int, p: Parsed, chat: bool):
    """A non-streamed response: every token, then one JSON (cancelled on disconnect)."""
    toks: list[int] = []
    next_check = time.monotonic() + 0.1
    getter = _Getter(q)
    try:
        while True:
            tok = await getter.get(0.1)
            # Nothing cancels a plain endpoint when its client leaves: check every 0.1 s
            # (whether tokens are flowing or the request is still queued).
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.1
                if await request.is_disconnected():
                    loop_.cancel(rid)
                    return _error("client disconnected", 499)
            if tok is _Getter:
                continue
            if tok is _DONE:
                break
            if tok is _ABORT:
                return _error("engine stopped", 503)
            toks.append(tok)
    except asyncio.CancelledError:
        loop_.cancel(rid)
        raise
    finally:
        getter.close()
    return completion(cid, created, p.model, "".join(detokenize(t) for t in toks), len(p.ids),
                      len(toks), chat)


class BackgroundServer:
    """Run an app under uvicorn in a background thread (tests, loopback benchmarks).

    ``with BackgroundServer(app) as s: ... s.url`` binds ``host:port`` (port 0:
    a free one, taken before the thread starts so there is no race), waits for
    startup and shuts down on exit. Signal handlers are left alone (not the
    main thread).
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout: float = 30.0) -> None:
        import uvicorn
        # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on sockets whose proto says
        # TCP, and without it every keep-alive response after the first waits ~40 ms
        # (Nagle vs delayed ACK).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.startup_timeout = startup_timeout
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name="latsim-uvicorn")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        t_end = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def serve(model: str = "tiny", device: str = "cpu", host: str = "127.0.0.1", port: int = 8000,
          model_name: Optional[str] = None, log_level: str = "info",
          heartbeat_s: Optional[float] = 15.0, access_log: bool = False,
          **engine_kwargs) -> None:
    """Build the engine (``build_engine`` options in ``engine_kwargs``) and serve it (blocks).

    The access log is off by default: one log line per request is work on the
    event loop that serves the streams, i.e. measured latency.
    """
    import uvicorn

    from .profile import build_engine
    engine = build_engine(model, device, **engine_kwargs)
    name = model_name or engine.model.cfg.name
    uvicorn.run(make_app(engine, name, heartbeat_s), host=host, port=port, log_level=log_level,
                access_log=access_log)
