"""One request's SSE stream from the server to its client, token by token.

``ClientStream`` is a pure model (no SimPy, no clock of its own): the engine tells
it when each token is produced (``emit``), asks whether it may produce the next
one (``blocked`` / ``unblock_time``, for the ``block`` policy) and ends it
(``close``), which returns a ``StreamResult`` with what the client saw.

What it models (seconds and bytes throughout):

- **Frames.** Tokens are written as SSE ``data:`` frames of ``frame_overhead_bytes``
  (the JSON envelope) plus ``bytes_per_token`` per token. With coalescing a frame
  is written when ``every_tokens`` tokens are pending, or ``every_ms`` after the
  oldest pending token (a flush timer), whichever comes first; ``close`` flushes
  what is left. Tokens in one frame reach the client together.
- **The connection.** Frames queue on the connection in write order and leave at
  the client's downlink rate: ``D = max(enter, D_prev) + bytes * 8 / bps``; they
  arrive ``one_way`` later. Under HTTP/2 several streams share one ``Link`` (the
  client's one connection), so their frames queue behind each other.
- **The send buffer.** A frame occupies the buffer from when it is written until
  its last byte has left (``D``); whole frames, because a server writes and a
  kernel releases memory frame by frame to within a segment, and because it makes
  the buffer a step function whose changes are departure times.
- **Backpressure** when a write would take the buffer over ``buffer_bytes``:
  ``block``: the write waits until enough has left, and while it waits the engine
  must not produce tokens for this request (``blocked``); ``buffer``: no limit, the
  peak is reported; ``degrade``: streaming stops, the remaining tokens are held and
  sent as one non-streamed body at ``close``.
- **Heartbeats.** When nothing was written for ``heartbeat_s`` (from ``t_open``, when
  the request reached the server, so the waits in queue and prefill count), a
  ``: ping`` comment frame of ``heartbeat_bytes`` is written. A heartbeat due while
  this stream still has bytes queued is skipped (the bytes in flight already prove
  the connection alive), and its timer restarts.
- **Client gone.** After ``disconnect(t)`` nothing more leaves the buffer (no
  acknowledgements come back) and nothing arriving later is delivered, so a
  ``block`` stream fills up and stays blocked (``unblock_time`` is infinite) until
  the server notices and cancels.

Timers (flush, heartbeat) are processed lazily at the next call, in time order.
A flush timer that blocks a write between two calls therefore takes effect from
the engine's next call: at most one more token is produced, and its frame still
waits its turn, so the buffer never exceeds ``buffer_bytes`` (unless a single frame
is larger than the buffer: it is then written alone into the empty buffer).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

POLICIES = ("block", "buffer", "degrade")
INF = math.inf


@dataclass(frozen=True)
class StreamParams:
    """Everything one stream needs to know: frame sizes, the client's downlink,
    coalescing, heartbeats, the send buffer and its backpressure policy, latency."""

    frame_overhead_bytes: float = 80.0
    bytes_per_token: float = 4.0
    downlink_bps: float = 50e6
    every_tokens: Optional[int] = 1        # write a frame once this many tokens are pending
    every_ms: Optional[float] = None       # ... or this long after the oldest pending token
    heartbeat_s: Optional[float] = None    # comment frame after this long without a write
    heartbeat_bytes: float = 8.0           # ": ping\n\n"
    buffer_bytes: Optional[float] = None   # send-buffer capacity (None: unbounded)
    backpressure: str = "buffer"           # block | buffer | degrade
    one_way: float = 0.0                   # server-to-client latency

    def __post_init__(self) -> None:
        if self.backpressure not in POLICIES:
            raise ValueError(f"backpressure must be one of {POLICIES}, not {self.backpressure!r}")
        if self.every_tokens is None and self.every_ms is None:
            raise ValueError("coalescing needs every_tokens or every_ms")
        if self.every_tokens is not None and self.every_tokens < 1:
            raise ValueError("every_tokens must be >= 1")
        if self.every_ms is not None and self.every_ms <= 0:
            raise ValueError("every_ms must be > 0")
        if self.heartbeat_s is not None and self.heartbeat_s <= 0:
            raise ValueError("heartbeat_s must be > 0")
        if self.downlink_bps <= 0:
            raise ValueError("downlink_bps must be > 0")
        if self.backpressure != "buffer" and self.buffer_bytes is None:
            raise ValueError(f"backpressure {self.backpressure!r} needs buffer_bytes")

    def frame_bytes(self, tokens: int) -> float:
        """Bytes of one data frame carrying ``tokens`` tokens."""
        return self.frame_overhead_bytes + tokens * self.bytes_per_token


class Link:
    """The client's downlink as one FIFO: ``busy`` is when its last queued byte leaves.

    One per stream under HTTP/1.1 (each stream has its connection); one per client
    under HTTP/2, shared by all its streams."""

    __slots__ = ("busy",)

    def __init__(self) -> None:
        self.busy = -INF


@dataclass
class StreamResult:
    """What a stream delivered and what it cost (seconds, bytes)."""

    first_arrival: float          # client receives token 1 (NaN if never)
    last_arrival: float           # client receives the last delivered token (NaN if none)
    gaps: np.ndarray              # client-observed gaps between consecutive tokens
    tokens_emitted: int           # tokens the engine produced
    tokens_delivered: int         # tokens that reached the client
    frames: int                   # data frames written (the degraded body counts as one)
    bytes: float                  # data + heartbeat bytes written
    heartbeats: int               # heartbeat comment frames written
    peak_buffer_bytes: float      # most bytes queued on the connection at once
    degraded: bool                # switched to a non-streamed body (degrade policy)
    blocked_s: float              # time writes waited for buffer room (block policy)
    last_depart: float            # last byte written left the server (NaN if nothing)
    cancelled: bool = False
    over_capacity: bool = False   # buffer policy: the peak exceeded buffer_bytes


class ClientStream:
    """One request's SSE stream; see the module docstring for the model."""

    __slots__ = ("p", "t_open", "link", "on_first_token", "_pending", "_pending_t0",
                 "_q", "_qbytes", "_last_write", "_entered", "_last_depart", "_arr", "_cnt",
                 "_tokens", "_held", "_frames", "_bytes", "_hb", "_peak", "_degraded",
                 "_blocked_s", "_gone", "_first_done", "_every_s", "result")

    def __init__(self, params: StreamParams, t_open: float, link: Optional[Link] = None,
                 on_first_token: Optional[Callable[[float], None]] = None) -> None:
        """``params``: see ``StreamParams``; ``t_open``: when the request reached the
        server (the heartbeat clock starts); ``link``: a shared ``Link`` (HTTP/2),
        else the stream has its own; ``on_first_token(arrival)``: called once, when
        the first token's frame is written, with the client's arrival time of it."""
        self.p = params
        self.t_open = t_open
        self.link = link if link is not None else Link()
        self.on_first_token = on_first_token
        self._every_s = params.every_ms / 1000.0 if params.every_ms is not None else None
        self._pending = 0            # tokens produced, not yet in a frame
        self._pending_t0 = 0.0       # when the oldest of them was produced
        self._q: deque = deque()     # (departure, bytes) of frames still in the buffer
        self._qbytes = 0.0
        self._last_write = t_open    # heartbeat timer reference
        self._entered = -INF         # when the latest write entered the buffer
        self._last_depart = math.nan
        self._arr: list[float] = []  # arrival time of each token-carrying frame ...
        self._cnt: list[int] = []    # ... and how many tokens it carried
        self._tokens = 0
        self._held = 0               # degrade: tokens kept for the final body
        self._frames = 0
        self._bytes = 0.0
        self._hb = 0
        self._peak = 0.0
        self._degraded = False
        self._blocked_s = 0.0
        self._gone = INF             # client disconnect time
        self._first_done = False
        self.result: Optional[StreamResult] = None

    # -- the engine's side --------------------------------------------------------
    def emit(self, t: float) -> None:
        """The engine produced this request's next token at ``t`` (non-decreasing)."""
        if self.result is not None:
            return   # closed (e.g. cancelled while its last step was in flight)
        self._advance(t)
        self._tokens += 1
        if self._degraded:
            self._held += 1
            return
        if self._pending == 0:
            self._pending_t0 = t
        self._pending += 1
        k = self.p.every_tokens
        if k is not None and self._pending >= k:
            self._flush(t)

    def blocked(self, t: float) -> bool:
        """``block`` policy: True while a write waits for buffer room at ``t``, so the
        engine must not produce more tokens for this request (always False otherwise)."""
        if self.p.backpressure != "block":
            return False
        self._advance(t)
        return self._entered > t

    def unblock_time(self, t: float) -> float:
        """The earliest time >= ``t`` at which ``blocked`` turns False (``inf`` if the
        client is gone and the buffer will never drain)."""
        self._advance(t)
        return self._entered if self._entered > t else t

    def disconnect(self, t: float) -> None:
        """The client went away at ``t``: nothing leaves the buffer or is delivered later."""
        self._advance(t)
        self._gone = min(self._gone, t)

    def close(self, t: float, cancelled: bool = False) -> StreamResult:
        """The request ended at ``t``: its last token, or cancelled (``cancelled=True``:
        pending and held tokens are dropped). Idempotent: later calls return the result."""
        if self.result is not None:
            return self.result
        self._advance(t)
        if not cancelled:
            if self._degraded:
                self._held += self._pending
                self._pending = 0
                if self._held:
                    # The rest as one non-streamed body: written whatever the buffer holds.
                    self._write(t, self.p.frame_bytes(self._held), self._held, force=True)
                    self._held = 0
            elif self._pending:
                self._flush(t)
        arr = np.repeat(np.asarray(self._arr, dtype=np.float64),
                        np.asarray(self._cnt, dtype=np.int64))
        if self._gone < INF:
            # Frames written before the client left but arriving after it: lost.
            arr = arr[arr <= self._gone]
        cap = self.p.buffer_bytes
        self.result = StreamResult(
            first_arrival=float(arr[0]) if len(arr) else math.nan,
            last_arrival=float(arr[-1]) if len(arr) else math.nan,
            gaps=np.diff(arr),
            tokens_emitted=self._tokens,
            tokens_delivered=int(len(arr)),
            frames=self._frames,
            bytes=self._bytes,
            heartbeats=self._hb,
            peak_buffer_bytes=self._peak,
            degraded=self._degraded,
            blocked_s=self._blocked_s,
            last_depart=self._last_depart,
            cancelled=cancelled,
            over_capacity=(cap is not None and self.p.backpressure == "buffer"
                           and self._peak > cap),
        )
        self._q.clear()
        self._arr = self._cnt = []
        return self.result

    # -- internals -------------------------------------------------------------------
    def _advance(self, t: float) -> None:
        """Fire the flush and heartbeat timers due by ``t``, in time order."""
        every = self._every_s
        hb = self.p.heartbeat_s
        if every is None and hb is None:
            return
        while True:
            due_flush = self._pending_t0 + every if (every is not None and self._pending) else INF
            due_hb = self._last_write + hb if hb is not None else INF
            if due_flush <= due_hb:
                if due_flush > t:
                    return
                self._flush(due_flush)
            else:
                if due_hb > t:
                    return
                self._heartbeat(due_hb)

    def _flush(self, t: float) -> None:
        n = self._pending
        self._pending = 0
        self._write(t, self.p.frame_bytes(n), n)

    def _heartbeat(self, t: float) -> None:
        self._drain(t)
        if self._qbytes > 0 or self._entered > t:
            self._last_write = t   # bytes still queued: the connection is visibly alive
            return
        self._hb += 1
        self._write(t, self.p.heartbeat_bytes, 0)

    def _drain(self, t: float) -> None:
        """Drop the frames whose last byte left by ``t`` (and before the client left)."""
        q = self._q
        lim = t if t < self._gone else self._gone
        while q and q[0][0] <= lim:
            self._qbytes -= q.popleft()[1]
        if not q:
            self._qbytes = 0.0   # no float residue

    def _write(self, t: float, nbytes: float, ntok: int, force: bool = False) -> None:
        """Write a frame at ``t``: wait for room (block), switch (degrade), or enqueue."""
        p = self.p
        if self._entered == INF:
            return   # an earlier write waits forever (client gone): nothing more goes out
        # Writes are serialised: one cannot enter before the previous one did.
        r = t if t > self._entered else self._entered
        self._drain(r)
        cap = p.buffer_bytes
        if (not force and cap is not None and p.backpressure != "buffer"
                and self._qbytes + nbytes > cap):
            if p.backpressure == "degrade":
                # This frame and every later token go into one body sent at close.
                self._degraded = True
                self._held += ntok
                return
            # block: wait until enough queued frames have left.
            q = self._q
            e = r
            while q and self._qbytes + nbytes > cap:
                d, b = q[0]
                if d > self._gone:
                    e = INF     # the client is gone: the buffer never drains
                    break
                q.popleft()
                self._qbytes -= b
                e = d
            if not q:
                self._qbytes = 0.0
            if e == INF:
                self._entered = INF
                return
            self._blocked_s += e - r
            r = e
        self._entered = r
        self._last_write = r
        link = self.link
        start = r if r > link.busy else link.busy
        d = start + nbytes * 8.0 / p.downlink_bps
        link.busy = d
        self._last_depart = d
        self._q.append((d, nbytes))
        self._qbytes += nbytes
        if self._qbytes > self._peak:
            self._peak = self._qbytes
        self._bytes += nbytes
        if ntok:
            self._frames += 1
            a = d + p.one_way
            if a <= self._gone:
                self._arr.append(a)
                self._cnt.append(ntok)
            if not self._first_done:
                self._first_done = True
                if self.on_first_token is not None:
                    self.on_first_token(a)


@dataclass
class StreamStats:
    """Run-wide totals over closed streams, for ``Results.meta["stream"]``."""

    streams: int = 0
    frames: int = 0
    bytes: float = 0.0
    heartbeats: int = 0
    tokens_emitted: int = 0
    tokens_delivered: int = 0
    degraded: int = 0
    blocked: int = 0
    blocked_s: float = 0.0
    over_capacity: int = 0
    peak_buffer_bytes: list = field(default_factory=list)

    def add(self, r: StreamResult) -> None:
        """Count one closed stream."""
        self.streams += 1
        self.frames += r.frames
        self.bytes += r.bytes
        self.heartbeats += r.heartbeats
        self.tokens_emitted += r.tokens_emitted
        self.tokens_delivered += r.tokens_delivered
        self.degraded += r.degraded
        self.blocked += r.blocked_s > 0
        self.blocked_s += r.blocked_s
        self.over_capacity += r.over_capacity
        self.peak_buffer_bytes.append(r.peak_buffer_bytes)

    def as_dict(self) -> dict:
        """Totals plus the peak send-buffer bytes (max, P99, mean over streams)."""
        peaks = np.asarray(self.peak_buffer_bytes, dtype=np.float64)
        has = len(peaks) > 0
        return {
            "streams": self.streams,
            "frames": self.frames,
            "bytes": self.bytes,
            "heartbeats": self.heartbeats,
            "tokens_per_frame": (self.tokens_emitted / self.frames) if self.frames else math.nan,
            "tokens_emitted": self.tokens_emitted,
            "tokens_delivered": self.tokens_delivered,
            "degraded": self.degraded,
            "blocked_streams": self.blocked,
            "blocked_s": self.blocked_s,
            "over_capacity": self.over_capacity,
            "peak_buffer_bytes_max": float(peaks.max()) if has else math.nan,
            "peak_buffer_bytes_p99": float(np.percentile(peaks, 99)) if has else math.nan,
            "peak_buffer_bytes_mean": float(peaks.mean()) if has else math.nan,
        }
