"""Admission control in front of the replicas (rate limiting): per-class token buckets
on requests and on tokens, a queue-length and an estimated-wait limit per class, and
what happens past them: refuse the newcomer with 429 and a Retry-After, or shed the
lowest-class waiting request (503) to make room. Also the queue-wait estimate a server
publishes to its clients at admission (an ``estimate_wait_time`` from prompt tokens and
chunk time; ``data/README.md``, *Facts from two design articles*).

Token bucket (the classic shaper, e.g. Tanenbaum, "Computer Networks", 5.4): a bucket
of ``burst`` tokens refilled at ``rate`` per second, starting full; a request passes
when the bucket holds its cost (1 for the request bucket, prompt + output tokens for
the token bucket) and takes it. Over any interval of length ``T`` at most ``burst +
rate x T`` passes, and under sustained overload exactly that in the long run: the
admitted rate tends to ``rate``. A cost above ``burst`` passes once the bucket is full
and leaves it in debt (as Guava's RateLimiter: the next requests pay for it), so a
large request is delayed, never refused forever; the bound then grows by one cost.
A request is charged only when it is admitted (a refusal for another reason leaves
the buckets alone), so the bound is on admissions.

Limits are per class (``cluster.admission.classes``, ``default`` for the rest); the
buckets are the gateway's, shared by all replicas; the queue and wait limits look at
the replica the router chose.
"""
from __future__ import annotations

import math

from collections import deque
from dataclasses import dataclass
from typing import Optional

# Why an attempt was refused (codes stored per request; -1: not refused).
REASONS = ("too_large", "rate_limited", "token_limited", "queue_full", "wait_too_long", "shed")
TOO_LARGE, RATE_LIMITED, TOKEN_LIMITED, QUEUE_FULL, WAIT_TOO_LONG, SHED = range(len(REASONS))
# The HTTP status a client sees for each (413: never retried).
STATUS = {TOO_LARGE: 413, RATE_LIMITED: 429, TOKEN_LIMITED: 429, QUEUE_FULL: 429,
          WAIT_TOO_LONG: 429, SHED: 503}


class TokenBucket:
    """``burst`` tokens, refilled continuously at ``rate`` per second, starting full."""

    __slots__ = ("rate", "burst", "level", "last")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = float(rate), float(burst)
        self.level, self.last = float(burst), 0.0

    def _refill(self, now: float) -> None:
        if now > self.last:
            self.level = min(self.burst, self.level + self.rate * (now - self.last))
            self.last = now

    def wait(self, now: float, cost: float) -> float:
        """Seconds until the bucket holds ``cost`` (or is full, for a cost above
        ``burst``); 0 when it does now."""
        self._refill(now)
        need = min(cost, self.burst)
        if self.level >= need:
            return 0.0
        return (need - self.level) / self.rate

    def take(self, now: float, cost: float) -> None:
        """Take ``cost`` tokens (after ``wait`` said 0)."""
        self._refill(now)
        self.level -= cost


@dataclass
class Decision:
    """The gateway's answer to one attempt: admitted (``reason`` None), or refused with
    ``reason`` and the ``retry_after`` it sends; ``victim``: a waiting request to shed."""

    reason: Optional[int] = None
    retry_after: float = 0.0
    victim: object = None


class WaitEstimator:
    """The queue-wait estimate a replica publishes for a newcomer (seconds, P50 and P99).

    - ``seed`` (the ``estimate_wait_time`` of ``data/README.md``, *Facts from two design
      articles*): the waiting requests' prompt tokens left to prefill / the chunk size x
      the replica's mean step time so far (before its first step: the cost model's time
      for one chunk); P99 = ``p99_factor`` x that. It ignores the running batch's
      decodes, which is what a user can judge from the error this reports.
    - ``little`` (Little's law, ``W = L / lambda``): waiting requests / the replica's
      completion rate over the last ``window_s`` (the seed estimate while nothing has
      completed in the window);
    - ``work`` (the default, ``cluster.waitest``): the queued prefill and the running
      requests' remaining decode projected on the replica's step costs, not waiting
      for requests ahead whose clients will have left (``patience``)."""

    def __init__(self, cfg, chunk: int, n_replicas: int) -> None:
        self.kind = cfg.kind
        self.p99_factor = cfg.p99_factor
        self.window = cfg.window_s
        self.chunk = max(1, int(chunk))
        self._done = [deque() for _ in range(n_replicas)]
        self._first_chunk: dict[int, float] = {}
        # How long clients wait for a first byte before they leave (``work``: the
        # requests ahead that will have left by their turn are not waited for).
        self.patience = math.inf

    def completed(self, replica: int, now: float) -> None:
        """A request finished on ``replica`` at ``now`` (for ``little``)."""
        self._done[replica].append(now)

    def _mean_step(self, rep) -> float:
        if rep.steps_run:
            return rep.busy_s / rep.steps_run
        k = rep.index
        if k not in self._first_chunk:
            cost = rep.cost
            # A look-up for the estimate, not for the run: the run's tallies stay as they are.
            tally = (cost.lookups, cost.extrapolations)
            ms = cost.prefill_ms(self.chunk, 0) if hasattr(cost, "prefill_ms") else 0.0
            cost.lookups, cost.extrapolations = tally
            self._first_chunk[k] = ms / 1000.0
        return self._first_chunk[k]

    def estimate(self, rep, waiting, now: float) -> tuple[float, float]:
        """``(p50, p99)`` wait for a request joining ``rep`` now behind ``waiting``."""
        if self.kind == "little":
            done = self._done[rep.index]
            while done and done[0] < now - self.window:
                done.popleft()
            if done:
                w = len(waiting) / (len(done) / self.window)
                return w, w * self.p99_factor
        if self.kind == "work":     # the work ahead on the step costs (``waitest``)
            from simulator.cluster.waitest import work_wait
            w = work_wait(rep, waiting, now, self.patience)
            return w, w * self.p99_factor
        tokens = sum(s.remaining_prefill for s in waiting)
        w = tokens / self.chunk * self._mean_step(rep)
        return w, w * self.p99_factor


class Admission:
    """The admission rules of ``cluster.admission`` (see module doc) for a workload
    whose classes are ``class_names`` (priority index -> name)."""

    def __init__(self, cfg, class_names) -> None:
        self.cfg = cfg
        self.limits = [cfg.limits(str(nm)) for nm in class_names]
        self.req_bucket, self.tok_bucket = [], []
        for lim in self.limits:
            rb = tb = None
            if lim is not None and lim.rate is not None:
                rb = TokenBucket(lim.rate, lim.burst or max(1.0, lim.rate))
            if lim is not None and lim.tokens_per_s is not None:
                tb = TokenBucket(lim.tokens_per_s, lim.token_burst or lim.tokens_per_s)
            self.req_bucket.append(rb)
            self.tok_bucket.append(tb)

    def _limits(self, prio: int):
        i = min(prio, len(self.limits) - 1)
        return i, self.limits[i]

    def decide(self, seq, now: float, waiting: list, estimate: float) -> Decision:
        """Admit ``seq`` now or refuse it. ``waiting``: the chosen replica's waiting
        requests (those not already being shed); ``estimate``: the P50 wait published
        for ``seq`` there."""
        i, lim = self._limits(seq.priority)
        if lim is None:
            return Decision()
        cost = seq.prompt_tokens + seq.output_tokens
        rb, tb = self.req_bucket[i], self.tok_bucket[i]
        w_req = rb.wait(now, 1.0) if rb is not None else 0.0
        w_tok = tb.wait(now, cost) if tb is not None else 0.0
        if w_req > 0 or w_tok > 0:
            reason = RATE_LIMITED if w_req >= w_tok else TOKEN_LIMITED
            return Decision(reason, max(w_req, w_tok))
        over = None
        if lim.max_queue is not None and len(waiting) >= lim.max_queue:
            over = QUEUE_FULL
        elif lim.max_wait_s is not None and estimate > lim.max_wait_s:
            over = WAIT_TOO_LONG
        victim = None
        if over is not None:
            victim = shed_victim(waiting, seq.priority) if self.cfg.action == "shed" else None
            if victim is None:
                after = self.cfg.retry_after_s if self.cfg.retry_after_s is not None else estimate
                return Decision(over, after)
        if rb is not None:
            rb.take(now, 1.0)
        if tb is not None:
            tb.take(now, cost)
        return Decision(None, 0.0, victim)


def shed_victim(waiting, priority: int):
    """The waiting request to shed for a newcomer of class ``priority``: of those of a
    lower class (a larger index) that have not started (nothing prefilled or
    generated), the lowest class, then the latest to arrive; None if there is none."""
    best, key = None, None
    for s in waiting:
        if s.priority <= priority or s.prefilled or s.generated:
            continue
        k = (s.priority, s.enqueued, s.rid)
        if key is None or k > key:
            best, key = s, k
    return best
