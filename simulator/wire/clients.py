"""Clients that give up and retry: what a client does when an attempt fails.

A client as an httpx one with ``Timeout(connect=5.0, read=120.0)`` (``data/README.md``,
*Facts from two design articles*) gives up on an attempt when setting up its connection
takes longer than the connect timeout, or when no byte of the response has arrived
within the read timeout of it finishing sending the request (httpx's read timeout is the
longest wait for the next byte; here the first one: the model does not track a gap
between later tokens per request). It may also give up on the whole request at a
deadline. When it gives up it closes the connection; the server learns that one way
later and cancels the request (``Replica.cancel``: dropped from the queue, or its KV
freed at the next step boundary).

A client may also act on the wait estimate the gateway publishes when it exceeds its
patience: give up, go to another replica, or come back later (``cluster.patience``).

After a 429 (rate or queue limit), a 503 (shed) or a timeout, a client retries when
its retry policy says so (``client.retry.retry_on``), while attempts remain and the retry
budget allows, after an exponential backoff with jitter (and at least the server's
Retry-After, when it honours it). The budget is shared by all clients: in the last
``window_s``, the retries decided (each counted when its client learns of the failure,
before the backoff) may not exceed ``ratio`` x the first attempts sent + ``min_per_s``
x ``window_s`` (Finagle's RetryBudget), which is what bounds a retry storm.
"""
from __future__ import annotations

import math
from collections import deque

from simulator.cluster.admission import STATUS

# How an attempt ended (per attempt; ``OPEN`` while in flight).
# ``BALKED``: its client was told a wait past its patience and left (``cluster.patience``).
OPEN, COMPLETED, REFUSED, CONNECT_TIMEOUT, READ_TIMEOUT, DEADLINE, FAILED, BALKED = range(8)
ATTEMPT_OUTCOMES = ("open", "completed", "refused", "connect_timeout", "read_timeout",
                    "deadline", "failed", "balked")


def backoff_delay(cfg, retry: int, rng) -> float:
    """The pause before retry number ``retry`` (1, 2, ...): ``min(max_s, initial_s x
    multiplier^(retry-1))`` with ``full`` (uniform over [0, d]), ``equal`` (d/2 plus
    uniform over [0, d/2]) or no jitter."""
    d = min(cfg.max_s, cfg.initial_s * cfg.multiplier ** (retry - 1))
    if cfg.jitter == "full":
        return float(rng.uniform(0.0, d)) if d > 0 else 0.0
    if cfg.jitter == "equal":
        return d / 2.0 + (float(rng.uniform(0.0, d / 2.0)) if d > 0 else 0.0)
    return d


class RetryBudget:
    """Finagle's retry budget over a sliding window (see module doc)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self._first: deque = deque()
        self._retries: deque = deque()
        self.denied = 0

    def _trim(self, now: float) -> None:
        lo = now - self.cfg.window_s
        for q in (self._first, self._retries):
            while q and q[0] <= lo:
                q.popleft()

    def first_attempt(self, now: float) -> None:
        """A first attempt was sent at ``now``: it deposits ``ratio`` of a retry."""
        self._first.append(now)

    def allow(self, now: float) -> bool:
        """Whether a retry may be sent at ``now`` (it is then counted)."""
        self._trim(now)
        cap = self.cfg.ratio * len(self._first) + self.cfg.min_per_s * self.cfg.window_s
        if len(self._retries) + 1 > cap:
            self.denied += 1
            return False
        self._retries.append(now)
        return True


class Clients:
    """The clients' side of the traffic model: their timeouts and retry decisions
    (``client`` config, or None: patient clients that never retry)."""

    def __init__(self, cfg, rng) -> None:
        self.cfg = cfg
        self.rng = rng
        retry = cfg.retry if cfg is not None else None
        self.retry = retry
        self.budget = RetryBudget(retry.budget) if retry is not None and retry.budget else None
        self.max_attempts = cfg.max_attempts if cfg is not None else 1
        # Acting on the published wait estimate (``cluster.patience``): the tallies.
        self.balked = self.moved = self.came_back = 0

    @property
    def patience(self) -> float:
        """The wait estimate past which a client acts (``client.wait_patience_s``)."""
        c = self.cfg.wait_patience_s if self.cfg is not None else None
        return math.inf if c is None else c

    @property
    def connect_timeout(self) -> float:
        c = self.cfg.connect_timeout_s if self.cfg is not None else None
        return math.inf if c is None else c

    @property
    def read_timeout(self) -> float:
        c = self.cfg.read_timeout_s if self.cfg is not None else None
        return math.inf if c is None else c

    @property
    def deadline(self) -> float:
        c = self.cfg.deadline_s if self.cfg is not None else None
        return math.inf if c is None else c

    def first_attempt(self, now: float) -> None:
        if self.budget is not None:
            self.budget.first_attempt(now)

    def retry_delay(self, attempts: int, failure: str, retry_after: float,
                    now: float, first_sent: float):
        """The pause before the next attempt of a request that has made ``attempts``
        attempts and whose last one failed with ``failure`` (``"429"``, ``"503"``,
        ``"timeout"``, or ``"413"``) at ``now``; None when it does not retry (its policy,
        its attempts, its deadline or the retry budget says no)."""
        r = self.retry
        if r is None or failure not in r.retry_on or attempts >= self.max_attempts:
            return None
        if not math.isfinite(retry_after):
            return None
        d = backoff_delay(r.backoff, attempts, self.rng)
        if r.honour_retry_after:
            d = max(d, retry_after)
        if now + d >= first_sent + self.deadline:
            return None
        # Counted when decided (as Finagle's retry filter withdraws from its budget on
        # the failure, before the backoff): the budget's clock then only moves forward.
        if self.budget is not None and not self.budget.allow(now):
            return None
        return d


def failure_of(reason: int) -> str:
    """The retry-policy name of an admission refusal (``"429"``, ``"503"`` or ``"413"``)."""
    return str(STATUS[reason])
