"""Failure isolation of ``latsim serve``'s engine thread (``EngineLoop`` inherits it): a
failure on one request fails that request only.

An exception in a command (adding, cancelling or resuming a request) is that request's:
it gets a 500 and the engine goes on (``EngineLoop._command``). An exception in a step is
found out by elimination: the requests that have not yet been through a good step
(``fresh``) are taken out of the engine (none has had a token) and put back one per
step; the one whose step fails again is failed (500), the others run as if nothing
happened (each keeps its arrival time). A failing step with no such request to blame
(the engine itself, e.g. a lost device), or ``MAX_BLAMED_IN_A_ROW`` requests blamed with
no good step between them, stops the engine thread: ``/health`` then answers 503 and
every open request ends with an error.

State (set up by ``EngineLoop``): ``fresh`` (rid -> (ids, max_tokens, priority, engine
arrival time) of requests not yet through a good step), ``held`` / ``held_args`` (the
suspects taken out after a failed step), ``trial`` (the one put back for the next step),
``blamed_in_a_row``, ``requests_failed``; and the loop's ``engine`` and ``streams``.
"""
from __future__ import annotations

import logging

# Requests blamed one after another with no good step between them: past this the fault
# is the engine's, not theirs (every request failing alone means nothing can run).
MAX_BLAMED_IN_A_ROW = 3


class Failed:
    """Put on a request's queue instead of a token: the engine failed on this request
    (it alone is ended, with ``message``; the engine goes on)."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


class FailureIsolation:
    """The engine thread's side of failure isolation (module docstring)."""

    def _hold(self, rid: int, args: tuple) -> None:
        self.held.append(rid)
        self.held_args[rid] = args

    def _drop(self, rid: int) -> None:
        """Take ``rid`` out of the engine, whatever state a failure left it in."""
        self.fresh.pop(rid, None)
        try:
            self.engine.cancel(rid)
        except Exception:          # its own failure may be what breaks cancelling it
            self.engine.seqs.pop(rid, None)

    def _fail(self, rid: int, why: str) -> None:
        """End request ``rid`` alone with a 500 (the engine goes on)."""
        self._drop(rid)
        self.held_args.pop(rid, None)
        if self.trial == rid:
            self.trial = None
        st = self.streams.pop(rid, None)
        self.requests_failed += 1
        if st is not None:
            try:
                st.fanout.post([(st.q, (Failed(why),))])
            except RuntimeError:
                pass

    def _isolate(self, e: Exception) -> bool:
        """A step raised ``e``: blame the request on trial (failed alone), and take
        every other fresh request out, to be put back one at a time. False when no
        request can be blamed: the fault is the engine's (its thread then stops)."""
        if self.trial is not None:
            rid, self.trial = self.trial, None
            self.blamed_in_a_row += 1
            if self.blamed_in_a_row >= MAX_BLAMED_IN_A_ROW:
                return False
            logging.getLogger("latsim.server").error(
                "engine step failed on request %s alone (%s: %s): that request is failed, "
                "the engine goes on", rid, type(e).__name__, e)
            self._fail(rid, f"the engine failed on this request ({type(e).__name__}: {e})")
        elif not any(rid in self.streams for rid in self.fresh):
            return False
        for rid in [r for r in self.fresh if r in self.streams]:
            args = self.fresh.pop(rid)
            self._drop(rid)
            self._hold(rid, args)
        return True

    def _put_back(self) -> None:
        """Put the next suspect back into the engine, on trial for the next step."""
        while self.held:
            rid = self.held.popleft()
            args = self.held_args.pop(rid, None)
            if args is None or rid not in self.streams:
                continue                   # cancelled while held
            ids, max_tokens, priority, enq = args
            try:
                self.engine.add_request(rid, ids, max_tokens, priority, now=enq)
            except Exception as e:
                self._fail(rid, f"the engine failed on this request ({type(e).__name__}: "
                                f"{e})")
                continue
            self.fresh[rid] = args
            self.trial = rid
            return
