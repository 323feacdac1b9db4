"""A stream's connection dropping mid-stream, and an SSE client reconnecting
(``stream.reconnect``; the run-wide side is ``wire.reconnect``). A mixin of
``clientstream.ClientStream``: its state lives in the stream's slots.

A plan (``reconnect.StreamPlan``) gives the drop times: a Poisson process over the
stream's seconds of streaming (``drop_per_s``; a segment of streaming starts when the
connection's first token reaches the client, or when a reconnection reaches the server,
and the gaps are drawn up front, one row per request), and the scheduled drops
(``drops_at_s``: every stream the server holds at that time). A drop at ``cut`` loses
every frame that reaches the client after ``cut``; the client notices ``detect`` later.
A write timeout (``write_timeout_s``) is a drop too: the server closes at ``tc``, the
frames not yet departed are lost (they would arrive after ``tc + one way``) and the
client sees the close one way later.

- ``resume`` (EventSource with ``Last-Event-ID``; a server that keeps the generation
  apart from the connection): the engine goes on; what it writes while the client is
  away goes to the server's replay log, after the lost frames. The reconnection reaches
  the server at ``notice + gap`` (``gap`` = ``retry:`` delay + the new connection's
  handshake + one way, from ``StreamPlan``), which writes the log's frames again, one
  per original frame, on the new connection (its own downlink FIFO under HTTP/1.1), then
  streams on. No token is lost: delivered == emitted. Under ``degrade`` the replayed
  frames are written whatever the buffer holds. While the client is away the engine is
  never blocked on it (the log is server memory) and heartbeats are not written.
- ``restart`` / ``none`` / reconnections used up: this stream is over at ``cut`` (as a
  client that left: nothing later reaches it); ``on_drop`` tells the wire, which
  cancels the request and, for ``restart``, sends it again.

Drop and resume times are timers like the flush and heartbeat ones: processed in time
order at the next call, and at ``close`` up to the last arrival (so a drop during the
last frames' flight is seen). The times they produce are exact whenever processed; what
the wire does at a drop (``on_drop``: the cancel of a stream that is over) waits for
that call: the wire calls (``poke``) at each scheduled drop, and a drawn one, which
hits a decoding request (its segment starts at a token's arrival), is seen at the
request's next token (at most one step late) or when a blocked engine wakes
(``unblock_time`` is at most the next drop).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right

from simulator.wire.streamparams import INF, Link


class StreamDrops:
    """Mixin of ``ClientStream``: connection drops and reconnections (module doc)."""

    __slots__ = ()

    def attach_reconnect(self, plan, on_drop=None) -> None:
        """Turn on drops for this stream: ``plan`` (``reconnect.StreamPlan``);
        ``on_drop(cut, notice, resumed, closed_at, drops)`` is called at each drop
        (``closed_at``: when the server closed it, for a write timeout; ``drops``: the
        request's drops so far)."""
        self.rc, self.on_drop = plan, on_drop
        self._drops = plan.prior
        self._sched_i = bisect_left(plan.scheduled, self.t_open)
        self._set_next()

    def poke(self, t: float) -> None:
        """Process the timers due by ``t`` (the wire calls at drop times)."""
        if self.result is None:
            self._advance(t)

    # -- internals -------------------------------------------------------------------
    def _rc_due(self) -> float:
        if self._gone < INF or self.result is not None:
            return INF
        return self._resume_at if self._down else self._next_drop

    def _set_next(self) -> None:
        """The next drop: the earlier of the next scheduled one and, once a segment of
        streaming has started, its start + this drop's drawn gap."""
        rc = self.rc
        k = self._drops
        rand = INF
        if rc.draws is not None and self._seg is not None and k < len(rc.draws):
            rand = self._seg + float(rc.draws[k])
        i = self._sched_i
        sched = rc.scheduled[i] if i < len(rc.scheduled) else INF
        self._next_drop = rand if rand < sched else sched

    def _drop_at(self, t: float) -> None:
        """A drop on the network at ``t`` (drawn or scheduled)."""
        sched = self.rc.scheduled
        if self._sched_i < len(sched) and sched[self._sched_i] <= t:
            self._sched_i += 1
        self._drop(t, t + self.rc.detect_s)

    def _drop(self, cut: float, notice: float, closed_at=None) -> None:
        """The connection is lost: frames reaching the client after ``cut`` are lost;
        the client notices at ``notice``. Resume, or end this stream (module doc)."""
        rc = self.rc
        self._drops += 1
        self._next_drop = INF
        resumed = rc.mode == "resume" and self._drops <= rc.max_reconnects
        if resumed:
            lost = []
            arr, cnt = self._arr, self._cnt
            while arr and arr[-1] > cut:
                arr.pop()
                self._wt.pop()
                lost.append(cnt.pop())
            lost.reverse()
            w = self._wait_until
            if cut < w < INF:
                # The blocked write's wait ends at the drop (its frame is replayed).
                self._blocked_s -= w - (cut if cut > self._wait_from else self._wait_from)
            self._q.clear()
            self._qbytes = 0.0
            self._wait_until = -INF
            self._down = True
            self._replay = lost
            self._resume_at = notice + rc.gap_s
            self._gap_s += self._resume_at - cut
            self._seg = None
        else:
            self._gone = min(self._gone, cut)
        if self.on_drop is not None:
            self.on_drop(cut, notice, resumed, closed_at, self._drops)

    def _resume(self, t: float) -> None:
        """The reconnection reaches the server at ``t``: it writes the replay log on the
        new connection, then streams on."""
        self._down = False
        self._resume_at = INF
        if not self._shared:
            self.link = Link()       # HTTP/1.1: a new connection, its own FIFO
        self._entered = -INF
        self._last_write = t
        self._seg = t
        self._sched_i = max(self._sched_i, bisect_right(self.rc.scheduled, t))
        replay, self._replay = self._replay, []
        force = self.p.backpressure == "degrade"
        for n in replay:
            self._replayed += n
            self._write(t, self.p.frame_bytes(n), n, force=force)
        if not self._down and self._gone == INF:
            self._set_next()

    def _settle(self) -> None:
        """At close: the resumes still due, and the drops before the last arrival."""
        while self._gone == INF:
            if self._down:
                self._resume(self._resume_at)
            elif self._arr and self._next_drop < self._arr[-1]:
                self._drop_at(self._next_drop)
            else:
                return

    def _timeout_drop(self, tc: float, ntok: int) -> bool:
        """A write timed out at ``tc`` with reconnections on: a drop (True; past the
        last reconnection a drop that ends the stream, the wire cancelling), or False
        (none asked for: the stream closes as before)."""
        rc = self.rc
        if rc is None or rc.mode == "none" or self._gone < INF:
            return False
        a = tc + self.p.one_way
        self._drop(a, a, tc)
        if self._down:
            if ntok:
                self._replay.append(ntok)     # this frame waits for the reconnection
        else:
            self._entered = self._wait_until = INF   # over: nothing more goes out
            self._timed_out = True
        return True
