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

The state machine is pure: every call takes the time; ``poll(now)`` makes the
open -> half-open move due by then (the gateway also sets a timer at ``reopen_at`` so
that requests held for a routable replica are released on time). ``log`` keeps every
transition as ``(time, state)``.
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
