"""What guards ``latsim serve`` against its clients: a body size limit, an API key, a
request timeout (``real_engine.server`` applies them).

Limits. A request body larger than ``max_body_bytes`` gets 413 before it is read
(from its ``Content-Length``; a chunked body is counted while it is read and
refused when it crosses the limit), and the connection is closed rather than
drained; a body that is not JSON, not UTF-8 or nested deeper than
``MAX_JSON_DEPTH`` gets 400. A prompt plus ``max_tokens`` beyond the model's
context gets 400 naming the field and the limits.

Authentication. With ``api_key`` set, every endpoint but ``GET /health`` needs
``Authorization: Bearer <key>`` (checked before the body is read, compared in
constant time); anything else gets 401.

Bursts. New requests enter the app at most ``ADMIT_PER_TURN`` per event-loop
iteration (``AdmissionGate``), in arrival order: a burst of 300 connections otherwise
had all 300 requests routed and parsed in one iteration (~0.4 ms each on a loaded
CPU), and a ``/health`` arriving meanwhile waited for all of them. ``GET`` requests
(``/health``, ``/metrics``) are not held.

Timeouts. With ``request_timeout_s`` set, a request is cancelled (its KV blocks
freed, like a disconnect) once that long has passed since its handler started,
reading its body included: a streamed request ends with an error event (code
504, no ``[DONE]``), a plain one gets 504, a body still arriving gets 408. A
stream whose client stopped reading cannot take an error event: its write is
cut ``STUCK_WRITE_GRACE_S`` later and the connection dropped, so a client that
never reads cannot hold KV blocks past the timeout either.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import time
from typing import Optional

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from real_engine.engineloop import EngineLoop
from real_engine.openai_api import ApiError, error_body

MAX_BODY_BYTES = 4 << 20          # default request body limit (4 MiB)
STUCK_WRITE_GRACE_S = 1.0         # a timed-out stream still stuck in a write after this: cut
OPEN_PATHS = frozenset({"/health"})   # reachable without the API key (load balancers probe it)


ADMIT_PER_TURN = 16     # new requests let into the app per event-loop iteration


class AdmissionGate:
    """ASGI middleware: lets at most ``per_turn`` new non-GET requests through per
    event-loop iteration, the rest in arrival order in the iterations after (each
    waits on a future; the loop polls its sockets between turns). What it defers is
    work the loop does for those requests anyway, one after another."""

    def __init__(self, app, per_turn: int = ADMIT_PER_TURN) -> None:
        if per_turn < 1:
            raise ValueError("per_turn must be >= 1")
        self.app, self.per_turn = app, per_turn
        self.used = 0                   # let through since the last turn began
        self.waiters: "collections.deque[asyncio.Future]" = collections.deque()
        self.turn_scheduled = False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "GET":
            await self._enter()
        await self.app(scope, receive, send)

    async def _enter(self) -> None:
        loop = asyncio.get_running_loop()
        self._schedule(loop)
        if self.used < self.per_turn and not self.waiters:
            self.used += 1
            return
        fut = loop.create_future()
        self.waiters.append(fut)
        await fut                       # cancelled (client gone): ``_turn`` skips it

    def _schedule(self, loop) -> None:
        if not self.turn_scheduled:
            self.turn_scheduled = True
            loop.call_soon(self._turn, loop)

    def _turn(self, loop) -> None:
        """A new iteration: let the next ``per_turn`` waiters through."""
        self.turn_scheduled = False
        self.used = 0
        while self.waiters and self.used < self.per_turn:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self.used += 1
        if self.used or self.waiters:
            self._schedule(loop)


class ApiKeyGuard:
    """ASGI middleware: 401 unless ``Authorization: Bearer <key>`` (paths in
    ``OPEN_PATHS`` excepted). Runs before any route, so an unauthenticated request
    never has its body read. Both sides are hashed first, so the comparison takes
    the same time whatever the length or content of what was sent."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                ok = hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self.digest)
                return ok and scheme.lower() == b"bearer"
        return False

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope["path"] in OPEN_PATHS
                or self._authorized(scope)):
            await self.app(scope, receive, send)
            return
        body = error_body("missing or invalid API key: send 'Authorization: Bearer <key>'", 401)
        await JSONResponse(body, status_code=401,
                           headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


class Deadline:
    """A request's timeout: when it expires (``time.monotonic``), counted once in
    ``EngineLoop.timed_out`` however it is noticed."""

    def __init__(self, loop_: EngineLoop, timeout_s: float) -> None:
        self.loop_, self.timeout_s = loop_, timeout_s
        self.at = time.monotonic() + timeout_s
        self.counted = False

    def left(self) -> float:
        return self.at - time.monotonic()

    def expire(self) -> str:
        """Count the timeout (once); the message for the client."""
        if not self.counted:
            self.counted = True
            self.loop_.timed_out += 1
        return f"request timed out after {self.timeout_s:g} s; it was cancelled"


class DeadlineStream(StreamingResponse):
    """A streamed response that cannot outlive its deadline by more than
    ``STUCK_WRITE_GRACE_S``: the generator ends a timed-out stream itself with an
    error event, but not while it waits on a write to a client that stopped
    reading; then the response is cut here, and closing the generator cancels the
    request (its ``finally``). Uvicorn drops a connection whose response is cut."""

    def __init__(self, content, deadline: Optional[Deadline], **kw) -> None:
        super().__init__(content, **kw)
        self.deadline = deadline

    async def __call__(self, scope, receive, send) -> None:
        if self.deadline is None:
            await super().__call__(scope, receive, send)
            return
        with anyio.move_on_after(max(0.0, self.deadline.left()) + STUCK_WRITE_GRACE_S) as cut:
            await super().__call__(scope, receive, send)
        if cut.cancelled_caught:
            self.deadline.expire()
            await self.body_iterator.aclose()


async def read_body(request: Request, limit: int, deadline: Optional[Deadline]) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed ``limit``
    bytes: from ``Content-Length`` before anything is read, or while a chunked body
    is read; 408 if it has not all arrived by ``deadline``."""
    big = f"request body exceeds the server's limit of {limit} bytes"
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise ApiError(f"{big} (Content-Length: {int(cl)})", 413)

    async def read() -> bytes:
        parts, total = [], 0
        async for part in request.stream():
            total += len(part)
            if total > limit:
                raise ApiError(big, 413)
            parts.append(part)
        return b"".join(parts)

    if deadline is None:
        return await read()
    try:
        return await asyncio.wait_for(read(), max(0.0, deadline.left()))
    except asyncio.TimeoutError:
        deadline.expire()
        raise ApiError(f"request body not received within the request timeout "
                       f"({deadline.timeout_s:g} s)", 408) from None
