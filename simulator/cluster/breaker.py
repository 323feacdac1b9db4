"""A circuit breaker per replica in the gateway (熔断): the classic three states
(Nygard, "Release It!", Circuit Breaker; as Hystrix, Resilience4j and Envoy's outlier
detection run it).

- ``closed``: requests are routed to the replica. ``failures`` consecutive failures
  (a success resets the count) open it; so does the P99 of the TTFTs observed on it
  over the last ``window_s`` exceeding ``p99_ms``, once the window holds
  ``min_samples`` of them (a slow replica, not a dead one).
- ``open``: not routed to, for ``cooldown_s``; then ``half_open``.
- ``half_open``: ``probes`` requests are let through (no more until they resolve); it
  closes when all of them succeed, and opens again (a fresh cool-down) on one failure.

The state machine (``Breaker``) is pure: every call takes the time; ``poll(now)`` makes
the open -> half-open move due by then. ``log`` keeps every transition as ``(time,
state)``, and ``on_change(now, state)`` (when set) hears of each. ``Breakers`` runs one per
replica in the simulated gateway: a timer half-opens an open breaker when its cool-down
ends (so that requests held for a routable replica are released on time), and a probe
whose client gave up before it resolved (it never succeeds nor fails) counts as a
failure, checked every cool-down, so a half-open breaker never waits forever.
"""
from __future__ import annotations

from collections import deque

import numpy as np

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class Breaker:
    """One replica's breaker (see module doc); ``cfg``: ``config.faults.BreakerConfig``."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.state = CLOSED
        self.fails = 0                 # consecutive failures while closed
        self.reopen_at = float("inf")  # open: when it half-opens
        self.sent = 0                  # half-open: probes let through
        self.ok = 0                    # half-open: probes that succeeded
        self.ttfts: deque = deque()    # (time, ttft s) in the window
        self.log: list[tuple[float, str]] = []
        self.opens = 0
        self.on_change = None

    def _go(self, now: float, state: str) -> None:
        self.state = state
        self.log.append((float(now), state))
        if state == OPEN:
            self.opens += 1
            self.reopen_at = now + self.cfg.cooldown_s
        elif state == HALF_OPEN:
            self.sent = self.ok = 0
        else:
            self.fails = 0
            self.ttfts.clear()
            self.reopen_at = float("inf")
        if self.on_change is not None:
            self.on_change(now, state)

    def poll(self, now: float) -> str:
        """The state at ``now`` (an open breaker whose cool-down ended is half-open)."""
        if self.state == OPEN and now >= self.reopen_at:
            self._go(now, HALF_OPEN)
        return self.state

    def allows(self, now: float) -> bool:
        """Whether a request may be routed to the replica now."""
        s = self.poll(now)
        return s == CLOSED or (s == HALF_OPEN and self.sent < self.cfg.probes)

    def routed(self, now: float) -> bool:
        """A request was routed to the replica now; True when it is a half-open probe."""
        if self.poll(now) == HALF_OPEN:
            self.sent += 1
            return True
        return False

    def failure(self, now: float) -> None:
        """A request routed to the replica failed now."""
        s = self.poll(now)
        if s == HALF_OPEN:
            self._go(now, OPEN)
        elif s == CLOSED:
            self.fails += 1
            if self.fails >= self.cfg.failures:
                self._go(now, OPEN)

    def success(self, now: float, ttft: float) -> None:
        """A request routed to the replica completed now, its TTFT there ``ttft`` (s)."""
        s = self.poll(now)
        if s == HALF_OPEN:
            self.ok += 1
            if self.ok >= self.cfg.probes:
                self._go(now, CLOSED)
            return
        if s != CLOSED:
            return      # routed before it opened: no news about the replica now
        self.fails = 0
        bound = self.cfg.p99_ms
        if bound is None:
            return
        w = self.ttfts
        w.append((now, ttft))
        while w and w[0][0] <= now - self.cfg.window_s:
            w.popleft()
        if len(w) >= self.cfg.min_samples:
            p99 = float(np.percentile([v for _, v in w], 99)) * 1000.0
            if p99 > bound:
                self._go(now, OPEN)


class Breakers:
    """A breaker per replica slot in the simulated gateway (module doc). ``log(slot,
    event)`` records a move; ``release()`` is called (at the same instant, after the
    event in progress) when a breaker half-opens or closes; ``abandoned(aid)``: whether
    attempt ``aid`` ended without a success or failure the breaker hears of."""

    def __init__(self, env, cfg, n_slots: int, log, release, abandoned) -> None:
        self.env, self.cfg = env, cfg
        self.each = [Breaker(cfg) for _ in range(n_slots)]
        self.probes: list[list[int]] = [[] for _ in range(n_slots)]
        self._log, self._release, self._abandoned = log, release, abandoned
        for slot, b in enumerate(self.each):
            b.on_change = lambda now, state, s=slot: self._moved(s, state)

    def allows(self, slot: int, now: float) -> bool:
        return self.each[slot].allows(now)

    def routed(self, slot: int, aid: int, now: float) -> None:
        if self.each[slot].routed(now):
            self.probes[slot].append(aid)

    def failure(self, slot: int, now: float) -> None:
        self.each[slot].failure(now)

    def success(self, slot: int, aid: int, now: float, ttft: float) -> None:
        b = self.each[slot]
        if b.poll(now) == HALF_OPEN and aid not in self.probes[slot]:
            return      # routed before it opened: says nothing of the replica now
        b.success(now, ttft)

    @property
    def opens(self) -> list[int]:
        return [b.opens for b in self.each]

    def _moved(self, slot: int, state: str) -> None:
        self._log(slot, f"breaker_{state}")
        b, env = self.each[slot], self.env
        k = b.opens
        if state == OPEN:
            env.timeout(self.cfg.cooldown_s).callbacks.append(
                lambda _e: b.poll(env.now) if b.opens == k else None)
            return
        if state == HALF_OPEN:
            self.probes[slot] = []
            env.timeout(self.cfg.cooldown_s).callbacks.append(
                lambda _e: self._check_probes(slot, k))
        # Routable again: the held requests, once the event in progress is done.
        env.timeout(0).callbacks.append(lambda _e: self._release())

    def _check_probes(self, slot: int, k: int) -> None:
        b = self.each[slot]
        if b.state != HALF_OPEN or b.opens != k:
            return
        if any(self._abandoned(a) for a in self.probes[slot]):
            b.failure(self.env.now)
        else:
            self.env.timeout(self.cfg.cooldown_s).callbacks.append(
                lambda _e: self._check_probes(slot, k))
