"""The waiting queue: the requests not yet admitted, in a policy's discipline order.

The order itself is the policy's (``Policy.order_kernel`` or ``Policy.order_key``, a
key: lower first, ties to the earlier arrival; ``Policy.requeue``: where a preempted
request waits again). This container only keeps it cheap to follow, two ways:

- *heads*: for no key (arrival order) and for a key declared ``arrival_ordered``
  (within a class, an earlier arrival never has a higher key: the built-in aging and
  fair keys), one FIFO per priority class (or one for the whole queue when the policy
  is not ``by_class``), whose heads are compared by key at each decision, plus the
  "resumed" requests of an order whose key depends on progress, each compared with the
  heads (see ``policy``). The compiled loop keeps exactly this queue on arrays
  (``heads_suffice``).
- *every request*: any other key (a plug-in's: last-in-first-out, shortest prompt
  first, an SLO deadline) is compared over every waiting request, classes or not: kept
  sorted by key when the key does not change with time, sorted at each decision when
  it does (``Policy.time_dependent``). Ties go to the earlier arrival, then to a request
  requeued at the front (``REQUEUE_FRONT``/``REQUEUE_RESUMED``) over one that joined.

``candidates(now)`` yields the requests in the order the discipline would admit them
at ``now``, without mutating the queue; the executor removes the ones a plan admits.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Iterator

from simulator.errors import LatsimError
from simulator.kernel import kernel, python_of
from simulator.model.scheduling.plan import Seq
from simulator.model.scheduling.view import Waiting, class_info

# Where a request preempted by recompute waits again (a discipline's requeue rule):
# at the very front of the queue (vLLM's ``appendleft``), in its class in arrival order
# (it keeps the waiting time it earned), or among the "resumed" requests, which are
# compared with the classes' heads by key at every decision (for an order whose key
# depends on a request's progress, where arrival order within a class is not key order).
REQUEUE_FRONT, REQUEUE_ARRIVAL, REQUEUE_RESUMED = 0, 1, 2

__all__ = ["WaitingQueue", "progress_of", "progress", "goes_before", "arrival_ordered",
           "heads_suffice"]

# Order kernels declared ``arrival_ordered`` (compared by identity: kernels are numba
# dispatchers, or plain functions without numba).
_ARRIVAL_ORDERED: list = []


def arrival_ordered(order_kernel):
    """Declare (as a decorator) that ``order_kernel`` never puts a later arrival of a
    class before an earlier one of the same class and progress, at any ``now``: each
    class's FIFO is then in key order, and the queue compares only their heads."""
    _ARRIVAL_ORDERED.append(order_kernel)
    return order_kernel


def heads_suffice(policy) -> bool:
    """Whether ``policy``'s order is followed by comparing the heads of FIFOs (one per
    class when ``by_class``; module doc), as the compiled loop does: no key, or a key
    declared ``arrival_ordered`` over per-class FIFOs. A policy (or class) with an
    ``order_key`` method or a key of its own needs every request compared."""
    if getattr(policy, "order_key", None) is not None:
        return False
    k = policy.order_kernel
    return k is None or (bool(policy.by_class) and any(k is a for a in _ARRIVAL_ORDERED))


@kernel(inline=True)
def progress(generated, output_tokens):
    """A waiting request's progress: output tokens generated before it was preempted,
    over its output tokens (what the ``fair_score`` key rewards)."""
    return generated / output_tokens if output_tokens else 0.0


@kernel(inline=True)
def goes_before(key_a, enq_a, key_b, enq_b):
    """Whether request a comes before request b in a discipline's order: the lower key
    first, ties to the earlier arrival."""
    return key_a < key_b or (key_a == key_b and enq_a < enq_b)


# Once per waiting request offered: the plain functions (no compiled dispatch).
_progress, _goes_before = python_of(progress), python_of(goes_before)


def progress_of(seq: Seq) -> float:
    """``progress`` of ``seq``."""
    return _progress(seq.generated, seq.output_tokens)


class WaitingQueue:
    """The waiting queue of one replica or engine (see module doc)."""

    __slots__ = ("_key", "_p", "_requeue", "_by_class", "_classes", "_resumed", "_n",
                 "_policy", "_all", "_static", "_tick")

    def __init__(self, policy) -> None:
        self._key = policy.order_kernel
        self._p = policy.order_array
        self._requeue = policy.requeue
        self._by_class = policy.by_class
        # class -> FIFO, in the order the queue first held each class (ties between
        # classes' heads go to the earlier class in this order).
        self._classes: dict[int, deque] = {}
        self._resumed: list[Seq] = []
        self._n = 0
        # Every-request mode (module doc): entries (key, enqueued, tick, seq), sorted when
        # the key is computed once per wait (``_static``), else in the order they came;
        # ``tick`` breaks ties (negative: requeued at the front).
        self._policy = policy
        self._all = None if heads_suffice(policy) else []
        self._static = not policy.time_dependent
        self._tick = 0

    # -- every-request mode ---------------------------------------------------------------
    def _key_of(self, seq: Seq, now: float) -> float:
        """The policy's own key of ``seq`` at ``now`` (a finite number, else an error
        naming the policy and what to do)."""
        pol = self._policy
        try:
            if pol.order_key is not None:
                k = float(pol.order_key(Waiting(seq, now, class_info(pol.classes, seq.priority))))
            else:
                k = float(self._key(seq.priority, seq.enqueued, progress_of(seq), now, self._p))
        except LatsimError:
            raise
        except Exception as e:  # noqa: BLE001 - a plug-in's bug, reported as its own
            raise LatsimError(f"policy {pol.name!r}: its order key failed on request "
                              f"{seq.rid}: {type(e).__name__}: {e}") from None
        if not math.isfinite(k):
            hint = (" (a key that reads now or waited needs time_dependent = True)"
                    if self._static else "")
            raise LatsimError(f"policy {pol.name!r}: its order key gave {k} for request "
                              f"{seq.rid}; a key must be a finite number{hint}")
        return k

    def _enter(self, seq: Seq, front: bool) -> None:
        self._tick += 1
        tick = -self._tick if front else self._tick
        if self._static:
            bisect.insort(self._all, (self._key_of(seq, math.nan), seq.enqueued, tick, seq))
        else:
            self._all.append((0.0, seq.enqueued, tick, seq))

    def _fifo(self, seq: Seq) -> deque:
        c = seq.priority if self._by_class else 0
        q = self._classes.get(c)
        if q is None:
            q = self._classes[c] = deque()
        return q

    def push(self, seq: Seq) -> None:
        """A request reaches the queue."""
        self._n += 1
        if self._all is not None:
            self._enter(seq, front=False)
            return
        self._fifo(seq).append(seq)

    def requeue(self, seq: Seq) -> None:
        """A request preempted by recompute waits again, where the policy says."""
        self._n += 1
        if self._all is not None:
            self._enter(seq, front=self._requeue != REQUEUE_ARRIVAL)
            return
        if self._requeue == REQUEUE_FRONT:
            self._fifo(seq).appendleft(seq)
        elif self._requeue == REQUEUE_ARRIVAL:
            q = self._fifo(seq)
            i = 0
            while i < len(q) and q[i].enqueued <= seq.enqueued:
                i += 1
            q.insert(i, seq)
        else:
            # Newest first: the order ties between resumed requests are offered in.
            self._resumed.insert(0, seq)

    def remove(self, seq: Seq) -> None:
        if self._all is not None:
            # Admission takes one of the first entries: found at once in practice.
            a = self._all
            i = next(i for i, e in enumerate(a) if e[3] is seq)
            del a[i]
            self._n -= 1
            return
        if self._resumed and seq in self._resumed:
            self._resumed.remove(seq)
        else:
            q = self._classes[seq.priority if self._by_class else 0]
            # Admission nearly always takes a head, so this is O(1) in practice.
            if q and q[0] is seq:
                q.popleft()
            else:
                q.remove(seq)
        self._n -= 1

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Seq]:
        """Every waiting request (in no particular order)."""
        if self._all is not None:
            for e in self._all:
                yield e[3]
            return
        for q in self._classes.values():
            yield from q
        yield from self._resumed

    def key(self, seq: Seq, now: float) -> float:
        """``seq``'s key in the order at ``now`` (``goes_before``: lower first, ties to
        the earlier arrival)."""
        if self._all is not None:
            return self._key_of(seq, math.nan if self._static else now)
        if self._key is None:
            return 0.0
        return self._key(seq.priority, seq.enqueued, progress_of(seq), now, self._p)

    def candidates(self, now: float) -> Iterator[Seq]:
        """The waiting requests in the order the discipline admits them at ``now``: the
        lowest (key, arrival) among the classes' next requests and the resumed ones not
        yet offered; ties to the earlier class, then to a class over a resumed request.
        With a key of the policy's own: every request by (key, arrival, requeue tick)."""
        if self._all is not None:
            if self._static:
                for e in self._all:
                    yield e[3]
                return
            keyed = sorted((self._key_of(e[3], now), e[1], e[2], e[3]) for e in self._all)
            for e in keyed:
                yield e[3]
            return
        if len(self._classes) <= 1 and not self._resumed:
            # One FIFO: its order is the key's order (see module doc).
            for q in self._classes.values():
                yield from q
            return
        heads = {c: 0 for c, q in self._classes.items() if q}
        resumed = list(self._resumed)
        while heads or resumed:
            best = best_key = best_enq = None
            for c, i in heads.items():
                s = self._classes[c][i]
                k = self.key(s, now)
                if best_key is None or _goes_before(k, s.enqueued, best_key, best_enq):
                    best_key, best_enq, best = k, s.enqueued, c
            r_best = -1
            for j, s in enumerate(resumed):
                k = self.key(s, now)
                if best_key is None or _goes_before(k, s.enqueued, best_key, best_enq):
                    best_key, best_enq, r_best = k, s.enqueued, j
            if r_best >= 0:
                yield resumed.pop(r_best)
                continue
            q = self._classes[best]
            i = heads[best]
            yield q[i]
            if i + 1 < len(q):
                heads[best] = i + 1
            else:
                del heads[best]
