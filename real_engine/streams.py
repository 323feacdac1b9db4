"""What ``latsim serve``'s event loop does per streamed token, made cheap: the hand-over
of an engine step's tokens (``Fanout``), a request's inbox (``Inbox``: the engine
thread's tokens in, the response's reads out) and its SSE frames (``Frames``).

Both run once per token per stream on the one event loop that also answers
``/health``: during a burst of 300 streams every engine step hands the loop ~256
tokens, so what each costs is how long everything else waits (a profile of that burst
found a quarter of the loop's time in ``asyncio.Queue.get`` under ``asyncio.wait``, a
task and a timer per token, and a tenth in ``json.dumps`` of each chunk).

``Fanout`` wakes at most ``FANOUT_SLICE`` inboxes per event-loop iteration: each woken
stream writes its frames in the next iteration, so a step that wakes all 256 at once
made one iteration of ~256 writes, and a ``/health`` arriving meanwhile waited for all
of them; in slices, the loop polls its sockets between them, and ``/health`` waits for
a slice or two. What it defers is a few slices' worth of writes, which every woken
stream costs anyway.

``Inbox`` is a deque and at most one waiting future: a put wakes the reader without a
task, and a read with a timeout (the heartbeat, the request's deadline) keeps one
timer per stream, re-armed only when it fires before the read is due (a stream that
gets a token every step re-arms once per heartbeat period, not once per token).
``Frames`` renders a middle token's frame from a template cut out of the chunk's JSON,
byte for byte what ``json.dumps`` writes (the first frame, with the chat role, and
the last, with ``finish_reason``, take the full path).
"""
from __future__ import annotations

import asyncio
import collections
import json
from json.encoder import encode_basestring_ascii
from typing import Optional

from real_engine.openai_api import chunk

TIMEOUT = object()      # what ``Inbox.get`` returns when its timeout passed first
# Inboxes woken per event-loop iteration: ~32 frames of work (a few ms on a loaded CPU)
# between two polls of the sockets.
FANOUT_SLICE = 32


class Fanout:
    """The engine thread's hand-over to the inboxes on one event loop: ``post`` (from
    the engine thread, one ``call_soon_threadsafe`` per step) queues ``(inbox, items)``
    pairs; the loop puts them, in order, ``FANOUT_SLICE`` inboxes per iteration. Every
    hand-over to this loop goes through here, end markers included, so nothing
    overtakes a request's earlier tokens."""

    __slots__ = ("loop", "pending", "draining")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: collections.deque = collections.deque()   # event loop only
        self.draining = False

    def post(self, pairs: list) -> None:
        """Engine thread: hand ``[(inbox, items), ...]`` over (``RuntimeError`` if the
        loop is closed)."""
        self.loop.call_soon_threadsafe(self._arrive, pairs)

    def _arrive(self, pairs: list) -> None:
        self.pending.extend(pairs)
        if not self.draining:
            self.draining = True
            self._drain()

    def _drain(self) -> None:
        pending = self.pending
        for _ in range(min(FANOUT_SLICE, len(pending))):
            inbox, items = pending.popleft()
            inbox.put_all(items)
        if pending:
            self.loop.call_soon(self._drain)
        else:
            self.draining = False


class Inbox:
    """A request's tokens (and end markers), put by callbacks on ``loop`` (the engine
    thread's ``call_soon_threadsafe``) and read by its response, on the same loop.

    The subset of ``asyncio.Queue`` the server uses (``put_nowait``, ``get_nowait``,
    ``empty``, ``await get()``), plus ``get(timeout)``, which returns ``TIMEOUT``
    instead of raising, and never loses an item (nothing is cancelled to time out)."""

    __slots__ = ("loop", "items", "waiter", "timer", "timer_at")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.waiter: Optional[asyncio.Future] = None
        self.timer: Optional[asyncio.TimerHandle] = None
        self.timer_at = 0.0

    def put_nowait(self, item) -> None:
        self.items.append(item)
        self._wake()

    def put_all(self, items) -> None:
        """Several items, one wake-up."""
        self.items.extend(items)
        self._wake()

    def empty(self) -> bool:
        return not self.items

    def get_nowait(self):
        """The next item (``IndexError`` if there is none)."""
        return self.items.popleft()

    async def get(self, timeout: Optional[float] = None):
        """The next item, or ``TIMEOUT`` once ``timeout`` s (None: never) passed first."""
        if self.items:
            return self.items.popleft()
        loop = self.loop
        due = None if timeout is None else loop.time() + timeout
        while not self.items:
            if due is not None:
                if loop.time() >= due:
                    return TIMEOUT
                self._arm(due)
            fut = self.waiter = loop.create_future()
            try:
                await fut
            finally:
                if self.waiter is fut:
                    self.waiter = None
        return self.items.popleft()

    def close(self) -> None:
        """Drop the timer (the response is done with this inbox)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def _arm(self, due: float) -> None:
        # A timer firing no later than ``due`` is kept: if it fires early, the reader
        # wakes, finds nothing due and re-arms for its own time.
        if self.timer is not None:
            if self.timer_at <= due:
                return
            self.timer.cancel()
        self.timer_at = due
        self.timer = self.loop.call_at(due, self._fire)

    def _fire(self) -> None:
        self.timer = None
        self._wake()


class Frames:
    """A streamed request's SSE frames (``data: {chunk}\\n\\n``), one per token."""

    __slots__ = ("args", "head", "tail")

    def __init__(self, cid: str, created: int, model: str, chat: bool) -> None:
        # The text's place in the chunk's JSON, found by a sentinel that must appear
        # there once: the chunk's other strings are the id, the object type and the model
        # name, which could hold it only by design (checked: else every frame takes the
        # full path).
        mark = "\x00latsim-text\x00"
        whole = frame(chunk(cid, created, model, mark, False, False, chat))
        cut = json.dumps(mark)
        self.head = self.tail = None
        if whole.count(cut) == 1:
            self.head, self.tail = whole.split(cut)
        self.args = (cid, created, model, chat)

    def frame(self, text: str, first: bool, last: bool) -> str:
        """The frame of one token's ``text`` (``first``: the request's first; ``last``:
        its last, which carries ``finish_reason``)."""
        if first or last or self.head is None:
            cid, created, model, chat = self.args
            return frame(chunk(cid, created, model, text, first, last, chat))
        return self.head + encode_basestring_ascii(text) + self.tail


def frame(obj: dict) -> str:
    """One SSE event carrying ``obj`` as compact JSON."""
    return "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"
