"""The engine thread of ``latsim serve``: one thread owns the ``EngineCore`` (it is
not thread-safe), takes commands (add, cancel, resume) from a queue, steps the
engine while it has work, and hands each step's tokens to the per-request
inboxes (``streams.Inbox``) of the event loop. Send buffers and backpressure (``block``
pauses a request in the engine, ``buffer``, ``degrade``) are accounted here; see
``server`` for the HTTP side and the whole design.

A failure on one request fails that request only (``real_engine.isolation``): an
exception in a command (adding, cancelling or resuming a request) is that request's (a
500, the engine goes on); one in a step is blamed by elimination.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from typing import Optional

from real_engine.engine import EngineCore
from real_engine.openai_api import ApiError
from real_engine.isolation import MAX_BLAMED_IN_A_ROW, FailureIsolation, Failed  # noqa: F401
from real_engine.streams import Fanout, Inbox

_DONE = object()    # end-of-stream marker put on a request's queue
_ABORT = object()   # the engine stopped (shutdown or a crash): the request cannot finish

BACKPRESSURE = ("block", "buffer", "degrade")


class _Stream:
    """One open request as the two threads see it.

    ``delivered`` (tokens put on ``q``) is written by the engine thread only and
    ``written`` (tokens whose frame went out, or that were folded into a degraded
    response) by the event loop only: ``delivered - written`` is the request's
    send buffer. ``paused``/``wake_sent`` change under ``EngineLoop.lock`` (see
    ``EngineLoop.consumed``). ``timing``: server wall-clock times, for the
    ``latsim-timing`` trailer."""

    __slots__ = ("rid", "loop", "q", "fanout", "delivered", "written", "paused", "wake_sent",
                 "paused_at", "wake_at", "paused_s", "timing", "prompt_tokens", "last_at")

    def __init__(self, rid: int, loop: asyncio.AbstractEventLoop, received: float,
                 prompt_tokens: int = 0, fanout: Optional[Fanout] = None) -> None:
        self.rid, self.loop, self.q = rid, loop, Inbox(loop)
        self.fanout = fanout or Fanout(loop)      # the hand-over to ``loop``
        self.prompt_tokens = prompt_tokens
        self.last_at = 0.0          # wall time of its last token (inter-token latency)
        self.delivered = self.written = 0
        self.paused = self.wake_sent = False
        self.paused_at = self.wake_at = self.paused_s = 0.0
        self.timing = {"received": received}

    @property
    def buffered(self) -> int:
        return self.delivered - self.written


class EngineLoop(FailureIsolation):
    """The thread that owns an ``EngineCore``: commands in, tokens out to the event loop.

    ``backpressure`` (``block | buffer | degrade``) and ``stream_buffer_frames``:
    what a request whose client reads slowly runs into (module docstring).
    """

    def __init__(self, engine: EngineCore, backpressure: str = "buffer",
                 stream_buffer_frames: int = 256) -> None:
        if backpressure not in BACKPRESSURE:
            raise ValueError(f"backpressure must be one of {', '.join(BACKPRESSURE)}, "
                             f"not {backpressure!r}")
        if stream_buffer_frames < 1:
            raise ValueError("stream_buffer_frames must be >= 1")
        self.engine = engine
        self.backpressure = backpressure
        self.buffer_frames = stream_buffer_frames
        self.resume_frames = stream_buffer_frames // 2     # block: resume at or below this
        self.lock = threading.Lock()
        self.cmds: "queue.Queue[tuple]" = queue.Queue()
        self.streams: dict[int, _Stream] = {}      # engine thread only (len() read elsewhere)
        self.thread: Optional[threading.Thread] = None
        self.stop_flag = threading.Event()
        self.rids = itertools.count()
        self.served = 0
        self.cancelled = 0
        self.steps = 0
        # Backpressure accounting (engine thread, except the event-loop counters below).
        self.pauses = self.resumes = 0
        self.paused_s = 0.0
        self.resume_lag_max = 0.0
        self.buffered_peak = 0          # most frames buffered at once, all streams together
        self.stream_buffered_peak = 0   # most frames one stream had buffered
        self.degraded = 0               # event loop
        self.timed_out = 0              # event loop: requests cut by the server's timeout
        self.frames = self.frame_bytes = 0   # event loop: content frames written, their bytes
        # Engine clock -> wall clock (the timing trailer speaks time.time()).
        self.wall_offset = time.time() - engine.clock()
        self.snapshot: dict = {}
        self.failure: Optional[str] = None    # why the engine thread died, if it did
        # Failure isolation (module docstring): rid -> (ids, max_tokens, priority, engine
        # arrival time) of requests not yet through a good step; suspects taken out after
        # a failed step, put back one at a time (``trial``); requests failed so far.
        self.fresh: dict[int, tuple] = {}
        self.held: "collections.deque[int]" = collections.deque()
        self.held_args: dict[int, tuple] = {}
        self.trial: Optional[int] = None
        self.blamed_in_a_row = 0
        self.requests_failed = 0
        self.prompt_tokens = self.generation_tokens = 0
        # ``real_engine.metrics.ServerMetrics``: its histograms observe each handed-over token.
        self.observer = None
        self.fanouts: dict = {}         # event loop -> its ``Fanout`` (streams keep theirs)
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

    async def submit(self, ids: list[int], max_tokens: int, priority: int,
                     received: Optional[float] = None) -> _Stream:
        """Enqueue a request on the engine; returns its stream (id, token queue, counters).

        Waits for the engine thread to accept it, so an engine-side refusal
        becomes an ``ApiError`` (HTTP 400) before any response is started.
        """
        if not self.alive:
            raise ApiError(f"engine is not running ({self.failure or 'stopped'})", 503)
        loop = asyncio.get_running_loop()
        fanout = self.fanouts.get(loop)
        if fanout is None:
            fanout = self.fanouts[loop] = Fanout(loop)
        st = _Stream(next(self.rids), loop, time.time() if received is None else received,
                     len(ids), fanout)
        ack = loop.create_future()
        # Enqueued = handed to the engine: the engine thread takes it at its next step
        # boundary, as a simulated request waits for the step in flight (T_queue).
        st.timing["enqueued"] = time.time()
        self.cmds.put(("add", st, ids, max_tokens, priority, ack))
        err = await ack
        if err is not None:
            raise ApiError(*err)
        return st

    @property
    def alive(self) -> bool:
        """The engine thread is running (and has not failed: it may still be tidying up)."""
        return self.failure is None and self.thread is not None and self.thread.is_alive()

    def cancel(self, rid: int) -> None:
        """Ask the engine thread to drop ``rid`` (a no-op if it has finished)."""
        self.cmds.put(("cancel", rid))

    def consumed(self, st: _Stream, nbytes: int = 0) -> None:
        """A token of ``st`` left its send buffer (its frame was written, or it was
        folded into a degraded or non-streamed response). Under ``block``, the
        first time a paused stream is drained to ``resume_frames`` this asks the
        engine thread to resume it. The check and the engine thread's pause run
        under one lock, so a pause can never slip in unseen after the drain."""
        if nbytes:
            self.frames += 1
            self.frame_bytes += nbytes
        if self.backpressure != "block":
            st.written += 1
            return
        with self.lock:
            st.written += 1
            wake = st.paused and not st.wake_sent and st.buffered <= self.resume_frames
            if wake:
                st.wake_sent, st.wake_at = True, time.perf_counter()
        if wake:
            self.cmds.put(("resume", st.rid))

    # -- the engine thread ----------------------------------------------------------
    def _publish(self) -> None:
        e = self.engine
        buffered = sum(s.buffered for s in list(self.streams.values()))
        self.buffered_peak = max(self.buffered_peak, buffered)
        self.snapshot = {"kv_blocks_total": e.cache.num_blocks, "kv_blocks_free": e.cache.num_free,
                         "running": e.num_running, "waiting": len(e.waiting),
                         "paused": len(e.paused),
                         "requests_served": self.served, "requests_cancelled": self.cancelled,
                         "requests_failed": self.requests_failed,
                         "prompt_tokens": self.prompt_tokens,
                         "generation_tokens": self.generation_tokens,
                         "preemptions": e.stats["preemptions"],
                         "engine_steps": self.steps,
                         "backpressure": self.backpressure,
                         "stream_buffer_frames": self.buffer_frames,
                         "buffered_frames": buffered, "buffered_frames_peak": self.buffered_peak,
                         "stream_buffered_frames_peak": self.stream_buffered_peak,
                         "pauses": self.pauses, "resumes": self.resumes,
                         "paused_s_total": self.paused_s,
                         "resume_lag_ms_max": self.resume_lag_max * 1e3,
                         "time": time.time()}

    def _command(self, cmd: tuple) -> None:
        """One command; an exception in it fails the request it is about, only."""
        try:
            self._do_command(cmd)
        except Exception as e:     # a bug or a value the engine cannot take
            rid = cmd[1].rid if cmd[0] == "add" else cmd[1]
            logging.getLogger("latsim.server").exception("engine failed on request %s", rid)
            why = f"the engine failed on this request ({type(e).__name__}: {e})"
            if cmd[0] == "add" and rid not in self.streams:
                self._drop(rid)
                self.requests_failed += 1
                cmd[1].loop.call_soon_threadsafe(_resolve, cmd[5], (why, 500))
            else:
                self._fail(rid, why)

    def _do_command(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, st, ids, max_tokens, priority, ack = cmd
            try:
                if self.held:
                    # Suspects are being put back one per step: a new request waits behind
                    # them, or a failing step could not tell it from the one on trial.
                    why = self.engine.never_runs(len(ids), max_tokens)
                    if why is not None:
                        raise ValueError(why)
                    self._hold(st.rid, (ids, max_tokens, priority, self.engine.clock()))
                else:
                    seq = self.engine.add_request(st.rid, ids, max_tokens, priority)
                    self.fresh[st.rid] = (ids, max_tokens, priority, seq.enqueued)
                self.streams[st.rid] = st
                err = None
            except ValueError as e:        # too long for max_seq_len or for the cache
                err = (str(e), 400)
            st.loop.call_soon_threadsafe(_resolve, ack, err)
        elif cmd[0] == "cancel":
            st = self.streams.pop(cmd[1], None)
            if st is not None and st.paused:
                self.paused_s += self.engine.clock() - st.paused_at
            self.fresh.pop(cmd[1], None)
            if self.trial == cmd[1]:
                self.trial = None
            if self.held_args.pop(cmd[1], None) is not None:
                self.cancelled += 1        # taken out of the engine already
            elif self.engine.cancel(cmd[1]):
                self.cancelled += 1
        elif cmd[0] == "resume":
            st = self.streams.get(cmd[1])
            with self.lock:
                if st is None or not st.paused or not self.engine.resume(st.rid):
                    return
                st.paused = st.wake_sent = False
            now = self.engine.clock()
            st.paused_s += now - st.paused_at
            self.paused_s += now - st.paused_at
            self.resumes += 1
            self.resume_lag_max = max(self.resume_lag_max, time.perf_counter() - st.wake_at)

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
                if self.held and self.trial is None:
                    self._put_back()      # the next suspect (failure isolation)
                if not eng.has_work:      # idle, or every running request is paused
                    self._publish()
                    try:
                        self._command(self.cmds.get(timeout=0.5))
                    except queue.Empty:
                        pass
                    continue
                try:
                    res = eng.step()
                except Exception as e:
                    if not self._isolate(e):
                        raise
                    continue
                self.steps += 1
                self.trial = None
                self.blamed_in_a_row = 0
                for rid in res.admitted:
                    self.fresh.pop(rid, None)
                if res.plan.is_empty and not res.admitted:
                    # Nothing could run: what is waiting needs memory that paused
                    # requests hold. Wait for a command (a resume or a cancel) instead
                    # of spinning on empty steps.
                    self._publish()
                    try:
                        self._command(self.cmds.get(timeout=0.05))
                    except queue.Empty:
                        pass
                    continue
                if res.admitted:
                    t = res.t_start + self.wall_offset
                    for rid in res.admitted:
                        # A request preempted and readmitted keeps its first admission.
                        if rid in self.streams:
                            self.streams[rid].timing.setdefault("scheduled", t)
                if res.tokens:
                    self._deliver(res.tokens, set(res.finished), res.t_end)
                else:
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
        for st in streams.values():
            try:
                st.fanout.post([(st.q, (_ABORT,))])
            except RuntimeError:
                pass
        while True:                 # adds still queued: refuse them
            try:
                cmd = self.cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                try:
                    cmd[1].loop.call_soon_threadsafe(_resolve, cmd[5], "engine stopped")
                except RuntimeError:
                    pass

    def _deliver(self, tokens: dict, finished: set, t: float) -> None:
        """Hand one step's tokens to their request inboxes (one thread hop per event
        loop: ``streams.Fanout``), after publishing the metrics they change; under
        ``block``, pause every request whose buffer is now full, so it sits out the next
        step."""
        by_fanout: dict = {}
        wall = t + self.wall_offset
        block = self.backpressure == "block"
        obs = self.observer
        for rid, tok in tokens.items():
            st = self.streams.get(rid)
            if st is None:
                continue                  # cancelled meanwhile
            last = rid in finished
            by_fanout.setdefault(st.fanout, []).append((st.q, (tok, _DONE) if last else (tok,)))
            st.delivered += 1
            self.generation_tokens += 1
            if st.delivered == 1:
                st.timing["first_token"] = wall
                self.prompt_tokens += st.prompt_tokens
                if obs is not None:
                    obs.observe_first(st.timing)
            elif obs is not None:
                obs.observe_gap(wall - st.last_at)
            st.last_at = wall
            self.stream_buffered_peak = max(self.stream_buffered_peak, st.buffered)
            if last:
                st.timing["last_token"] = wall
                st.timing["paused_s"] = st.paused_s
                self.streams.pop(rid, None)
                self.served += 1
                if obs is not None:
                    obs.observe_done(st.timing)
            elif block and st.buffered >= self.buffer_frames:
                with self.lock:
                    # Re-checked under the lock: ``consumed`` may have drained it since.
                    if st.buffered >= self.buffer_frames and self.engine.pause(rid):
                        st.paused, st.paused_at = True, self.engine.clock()
                        self.pauses += 1
        # The metrics first: a client that has read a request's last frame then finds
        # it counted (published after the hand-over, a quick client could read the
        # metrics of the step before).
        self._publish()
        for fanout, pairs in by_fanout.items():
            try:
                fanout.post(pairs)
            except RuntimeError:          # that event loop is closed: nobody is listening
                pass


def _resolve(fut: asyncio.Future, err) -> None:
    if not fut.done():
        fut.set_result(err)
