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
- **Pacing** (``target_tpot_s``; ``target_tpot_ms`` in ``data/README.md``'s article):
  token k is released at ``R_k = max(t_k, R_{k-1} + target)``, early tokens held in
  server memory (not the send buffer: pacing never blocks the engine). Faster
  generation: token k leaves at ``R_1 + (k-1) x target``; slower: ``R_k = t_k``. The
  delay is part of ``T_stream``.
  A cancel drops the tokens not yet released.
- **Write timeout** (``write_timeout_s``, ``block``): a write waiting for room longer
  than the timeout (client not draining, or gone) closes the stream at ``r + timeout``
  (``r``: when it began waiting); ``on_write_timeout(t)`` lets the caller cancel.
- **Framing**: ``sse`` / ``websocket`` wrap each payload (``framing.framing_bytes``).
- **Drops and reconnection** (``attach_reconnect``, ``streamdrop``): the connection
  drops (drawn per second of streaming, scheduled, or the write timeout); an SSE client
  reconnects after its retry delay and either resumes from its last event id (the
  server replays the frames after it: no token lost, the gap lands in ``T_stream``) or
  the wire restarts the request.
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
from typing import Callable, Optional

import numpy as np

from simulator.wire.framing import framing_bytes  # noqa: F401  (re-exported)
from simulator.wire.streamdrop import StreamDrops
from simulator.wire.streamparams import (INF, POLICIES, Link, StreamParams,  # noqa: F401
                                         StreamResult)
from simulator.wire.streamstats import StreamStats  # noqa: F401  (re-exported)


class ClientStream(StreamDrops):
    """One request's SSE stream; see the module docstring for the model."""

    __slots__ = ("p", "t_open", "link", "on_first_token", "_pending", "_pending_t0",
                 "_q", "_qbytes", "_last_write", "_entered", "_last_depart", "_arr", "_cnt",
                 "_tokens", "_held", "_frames", "_bytes", "_hb", "_peak", "_degraded",
                 "_blocked_s", "_gone", "_first_done", "_every_s", "result", "on_write_timeout",
                 "_rel", "_wait_until", "_timed_out", "_wt",
                 # drops and reconnections (``streamdrop``)
                 "rc", "on_drop", "on_closed", "_shared", "_down", "_resume_at",
                 "_replay", "_drops", "_seg", "_next_drop", "_sched_i", "_gap_s",
                 "_replayed", "_wait_from")

    def __init__(self, params: StreamParams, t_open: float, link: Optional[Link] = None,
                 on_first_token: Optional[Callable[[float], None]] = None,
                 on_write_timeout: Optional[Callable[[float], None]] = None) -> None:
        """``params``: see ``StreamParams``; ``t_open``: when the request reached the
        server (the heartbeat clock starts); ``link``: a shared ``Link`` (HTTP/2),
        else the stream has its own; ``on_first_token(arrival)``: called once, when
        the first token's frame is written, with the client's arrival time of it;
        ``on_write_timeout(t)``: called once, when a write is found to wait past the
        write timeout, with the time ``t`` the server closes the stream."""
        self.p = params
        self.on_write_timeout = on_write_timeout
        self._rel = -INF             # pacing: when the latest token was released
        self._wait_until = -INF      # block: until when a write waits for room
        self._timed_out = False
        self._wt: list[float] = []   # write time of each token-carrying frame
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
        # Drops and reconnections (``streamdrop``; off until ``attach_reconnect``).
        self.rc = self.on_drop = self.on_closed = None
        self._shared = link is not None
        self._down = False           # the connection is lost, the client reconnecting
        self._resume_at = INF        # ... until the reconnection reaches the server
        self._replay: list[int] = []  # tokens of each frame to write again on resuming
        self._drops = 0
        self._seg = None             # when the current segment of streaming started
        self._next_drop = INF
        self._sched_i = 0
        self._gap_s = 0.0
        self._replayed = 0
        self._wait_from = -INF       # block: when the latest wait for room began

    # -- the engine's side --------------------------------------------------------
    def emit(self, t: float) -> None:
        """The engine produced this request's next token at ``t`` (non-decreasing)."""
        if self.result is not None:
            return   # closed (e.g. cancelled while its last step was in flight)
        tp = self.p.target_tpot_s
        if tp is not None:
            # Released no sooner than one target TPOT after the previous token.
            r = self._rel + tp
            t = r if r > t else t
            self._rel = t
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
        return self._wait_until > t

    def unblock_time(self, t: float) -> float:
        """The earliest time >= ``t`` at which ``blocked`` turns False (``inf`` if the
        client is gone and the buffer will never drain, or the write timed out); with
        drops on, at most the next drop (which may end the wait)."""
        self._advance(t)
        w = self._wait_until if self._wait_until > t else t
        if self.rc is not None and w > t:
            d = self._rc_due()
            w = d if d < w else w
        return w

    def disconnect(self, t: float) -> None:
        """The client went away at ``t``: nothing leaves the buffer or is delivered later."""
        self._advance(t)
        self._gone = min(self._gone, t)

    def close(self, t: float, cancelled: bool = False) -> StreamResult:
        """The request ended at ``t``: its last token, or cancelled (``cancelled=True``:
        pending and held tokens are dropped). Idempotent: later calls return the result."""
        if self.result is not None:
            return self.result
        t_cancel = t
        if self._rel > t:
            t = self._rel   # paced: the last tokens are released after the engine's end
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
        if self.rc is not None:
            self._settle()
        arr = np.repeat(np.asarray(self._arr, dtype=np.float64),
                        np.asarray(self._cnt, dtype=np.int64))
        if self._gone < INF:
            # Frames written before the client left but arriving after it: lost.
            arr = arr[arr <= self._gone]
        if cancelled and self.p.target_tpot_s is not None:
            # Paced tokens not yet released when the request was cancelled: dropped.
            wt = np.repeat(np.asarray(self._wt, dtype=np.float64),
                           np.asarray(self._cnt, dtype=np.int64))[:len(arr)]
            arr = arr[wt <= t_cancel]
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
            timed_out=self._timed_out,
            drops=self._drops - (self.rc.prior if self.rc is not None else 0),
            replayed_tokens=self._replayed,
            reconnect_s=self._gap_s,
        )
        self._q.clear()
        self._arr = self._cnt = self._wt = []
        if self.on_closed is not None:
            self.on_closed()
        return self.result

    # -- internals -------------------------------------------------------------------
    def _advance(self, t: float) -> None:
        """Fire the flush and heartbeat timers due by ``t``, and with ``stream.reconnect``
        the drop and resume timers (``streamdrop``), in time order (a flush or heartbeat
        due at the same time as a drop goes first)."""
        every = self._every_s
        hb = self.p.heartbeat_s
        rc = self.rc is not None
        if not rc and every is None and hb is None:
            return
        while True:
            due_flush = self._pending_t0 + every if (every is not None and self._pending) else INF
            due_hb = self._last_write + hb if hb is not None else INF
            due_rc = self._rc_due() if rc else INF
            if due_rc < due_flush and due_rc < due_hb:
                if due_rc > t:
                    return
                if self._down:
                    self._resume(due_rc)
                else:
                    self._drop_at(due_rc)
            elif due_flush <= due_hb:
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
        if self._down:
            self._last_write = t     # no connection to keep alive
            return
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
        if self._down:
            # The client is reconnecting: into the replay log (``streamdrop``).
            self._last_write = t
            if ntok:
                self._replay.append(ntok)
            return
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
            wto = p.write_timeout_s
            if wto is not None and e - r > wto:
                # The client has not drained its socket for the write timeout: the
                # server closes the stream; nothing more goes out.
                self._blocked_s += wto
                if self._timeout_drop(r + wto, ntok):
                    return   # ... and the client reconnects (``streamdrop``)
                self._entered = self._wait_until = INF
                self._timed_out = True
                if self.on_write_timeout is not None:
                    self.on_write_timeout(r + wto)
                return
            if e == INF:
                self._entered = self._wait_until = INF
                return
            self._wait_until = e
            self._wait_from = r
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
                self._wt.append(r)
            if self.rc is not None and self._seg is None:
                self._seg = a        # a segment of streaming starts (``streamdrop``)
                self._set_next()
            if not self._first_done:
                self._first_done = True
                if self.on_first_token is not None:
                    self.on_first_token(a)
