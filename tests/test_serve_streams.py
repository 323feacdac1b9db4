"""``real_engine.streams``: what serve's event loop does per streamed token.

- ``Frames`` writes byte for byte what ``json.dumps`` of the chunk writes, for every
  kind of frame (first, middle, last; completion and chat; model names JSON escapes).
- ``Inbox``: a read with a timeout returns ``TIMEOUT`` and loses nothing; one timer per
  inbox, re-armed when it fires before the read is due, moved earlier for a nearer one.
- ``Fanout``: hand-overs reach the inboxes in order, ``FANOUT_SLICE`` inboxes per loop
  iteration, with the loop polling its sockets (``/health``) between slices.

No wall-clock assertion: timeouts are checked against the loop's own clock, and the
slicing by counting loop iterations.
"""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from real_engine.openai_api import chunk  # noqa: E402
from real_engine.streams import FANOUT_SLICE, TIMEOUT, Fanout, Frames, Inbox, frame  # noqa: E402


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("model", ["tiny", 'a "quoted" \\ name', "modèle-ü", "x\x00latsim"])
def test_frames_are_what_json_dumps_writes(chat, model):
    f = Frames("cmpl-1", 1700000000, model, chat)
    for text in (" t1", " t511", "", 'q"\\', "é\n"):
        for first, last in ((True, False), (False, False), (False, True), (True, True)):
            want = "data: " + json.dumps(chunk("cmpl-1", 1700000000, model, text, first, last,
                                               chat), separators=(",", ":")) + "\n\n"
            assert f.frame(text, first, last) == want
            assert frame(chunk("cmpl-1", 1700000000, model, text, first, last, chat)) == want


def test_a_middle_frame_takes_the_template():
    """The fast path is the one taken (else the test above checks only the slow one)."""
    f = Frames("cmpl-1", 1, "tiny", False)
    assert f.head is not None and f.frame(" t5", False, False).startswith(f.head)


def _run(coro):
    return asyncio.run(coro)


def test_inbox_timeout_loses_nothing_and_keeps_one_timer():
    async def main():
        loop = asyncio.get_running_loop()
        box = Inbox(loop)
        t0 = loop.time()
        assert await box.get(0.01) is TIMEOUT
        assert loop.time() - t0 >= 0.01          # the loop's clock: never early
        box.put_nowait(1)
        assert await box.get(0.01) == 1          # queued: no wait, no timer
        # A read due later keeps the timer of an earlier one (fires early, re-arms).
        reader = asyncio.ensure_future(box.get(5.0))
        await asyncio.sleep(0)
        first = box.timer
        assert first is not None and box.timer_at > loop.time()
        box.put_all([2, 3])                      # one wake for both
        assert await reader == 2 and box.get_nowait() == 3 and box.empty()
        reader = asyncio.ensure_future(box.get(60.0))
        await asyncio.sleep(0)
        assert box.timer is first                # the later read kept it
        # A nearer read moves it earlier.
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert box.waiter is None                # a cancelled read leaves nothing behind
        assert await box.get(0.001) is TIMEOUT
        assert box.timer is not first
        box.put_nowait(4)
        assert await box.get() == 4
        box.close()
        assert box.timer is None
    _run(main())


def test_inbox_under_wait_for_loses_no_item():
    """``asyncio.wait_for(inbox.get(), ...)`` cancelled by its timeout: the item put
    afterwards is still read (an ``asyncio.Queue.get`` cancelled while an item arrives
    could drop it)."""
    async def main():
        box = Inbox(asyncio.get_running_loop())
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(box.get(), 0.001)
        box.put_nowait("x")
        assert await asyncio.wait_for(box.get(), 5) == "x"
    _run(main())


def test_fanout_is_in_order_and_in_slices_with_polls_between():
    async def main():
        loop = asyncio.get_running_loop()
        fan = Fanout(loop)
        boxes = [Inbox(loop) for _ in range(3 * FANOUT_SLICE + 5)]
        # Two steps posted before the loop runs: every box's step-1 token before its
        # step-2 token, however the slices fall.
        fan.post([(b, (i, "s1")) for i, b in enumerate(boxes)])
        fan.post([(b, ("s2",)) for b in boxes])
        # A socket made readable meanwhile (a /health request arriving): its callback
        # must run before the whole hand-over is done.
        r, w = __import__("socket").socketpair()
        polled_at = []
        loop.add_reader(r, lambda: (polled_at.append(sum(not b.empty() for b in boxes)),
                                    loop.remove_reader(r)))
        w.send(b"x")
        counts = []
        while not all(len(b.items) == 3 for b in boxes):
            counts.append(sum(not b.empty() for b in boxes))
            await asyncio.sleep(0)
        r.close()
        w.close()
        assert [list(b.items) for b in boxes] == [[i, "s1", "s2"] for i in range(len(boxes))]
        # The first post reached FANOUT_SLICE more boxes per iteration, never more.
        steps = [b - a for a, b in zip(counts, counts[1:])]
        assert max(steps) <= FANOUT_SLICE and len(counts) >= len(boxes) // FANOUT_SLICE
        assert polled_at and polled_at[0] < len(boxes)
        assert not fan.draining and not fan.pending
    _run(main())


def test_serve_freezes_its_start_up_heap_and_shortens_the_gil_switch(monkeypatch):
    """``serve`` hands uvicorn a process whose start-up objects (model, torch, imports)
    are out of the collector's sight and whose GIL switch interval is
    ``SWITCH_INTERVAL_S``: else the first full collection of a burst walked them all on
    the event loop (137 ms CPU at the start of ``benchmarks/serve_health.py``'s 300
    streams, the burst's worst /health), and each socket write could wait 5 ms to take
    the GIL back from the engine thread. uvicorn's run is replaced by a probe of both."""
    import gc
    import sys

    pytest.importorskip("torch")
    import uvicorn

    from real_engine import server
    from real_engine.hosting import listen_socket
    from real_engine.profile import build_engine

    seen = {}

    def run(self, sockets=None):
        seen.update(frozen=gc.get_freeze_count(), switch=sys.getswitchinterval())

    monkeypatch.setattr(uvicorn.Server, "run", run)
    before = sys.getswitchinterval()
    try:
        server.serve(engine=build_engine("tiny", "cpu", num_blocks=64),
                     sock=listen_socket("127.0.0.1", 0))
    finally:
        gc.unfreeze()
        sys.setswitchinterval(before)
    assert seen["frozen"] > 10_000            # the model, torch and the imports
    assert seen["switch"] == server.SWITCH_INTERVAL_S < before


def test_admission_gate_lets_requests_in_a_few_per_iteration_in_order():
    """``guards.AdmissionGate``: of 10 POSTs arriving at once, at most ``per_turn`` enter
    the app per loop iteration, in arrival order; a GET (``/health``) is never held; a
    waiter that gives up (its client left) takes no place. (A 300-connection burst had
    196 requests routed and parsed in one iteration: 36 ms of CPU before a /health.)"""
    from real_engine.guards import AdmissionGate

    async def main():
        entered, tick = [], [0]

        async def app(scope, receive, send):
            entered.append((tick[0], scope["path"]))

        gate = AdmissionGate(app, per_turn=4)
        post = [asyncio.ensure_future(gate({"type": "http", "method": "POST",
                                            "path": f"/p{i}"}, None, None))
                for i in range(10)]
        health = asyncio.ensure_future(gate({"type": "http", "method": "GET",
                                             "path": "/health"}, None, None))
        await asyncio.sleep(0)           # every task has run to the gate once
        post[5].cancel()                 # its client went away while it waited
        while not all(t.done() for t in post + [health]):
            tick[0] += 1
            await asyncio.sleep(0)
        paths = [p for _, p in entered]
        assert paths.index("/health") <= 4                   # not behind the queue
        assert [p for p in paths if p != "/health"] == [f"/p{i}" for i in range(10) if i != 5]
        per_tick = {}
        for t, p in entered:
            if p != "/health":
                per_tick[t] = per_tick.get(t, 0) + 1
        assert max(per_tick.values()) <= 4 and len(per_tick) >= 3
        assert not gate.waiters
        with pytest.raises(ValueError):
            AdmissionGate(app, per_turn=0)
    _run(main())
