"""The waiting queue: the requests not yet admitted, in a policy's discipline order.

The order itself is the policy's (``Policy.order_kernel``, a key: lower first, ties to
the earlier arrival; ``Policy.requeue``: where a preempted request waits again). This
container only keeps it cheap to follow: one FIFO per priority class (or one FIFO for
the whole queue when the order ignores classes), whose heads are compared by key at
each decision, plus the "resumed" requests of an order whose key depends on progress,
each compared with the heads (see ``policy``). ``candidates(now)`` yields the requests
in the order the discipline would admit them at ``now``, without mutating the queue;
the executor removes the ones a plan admits.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

from simulator.kernel import kernel, python_of
from simulator.model.scheduling.plan import Seq
from simulator.model.scheduling.policy import REQUEUE_ARRIVAL, REQUEUE_FRONT

__all__ = ["WaitingQueue", "progress_of", "progress", "goes_before"]


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

    __slots__ = ("_key", "_p", "_requeue", "_by_class", "_classes", "_resumed", "_n")

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

    def _fifo(self, seq: Seq) -> deque:
        c = seq.priority if self._by_class else 0
        q = self._classes.get(c)
        if q is None:
            q = self._classes[c] = deque()
        return q

    def push(self, seq: Seq) -> None:
        """A request reaches the queue."""
        self._fifo(seq).append(seq)
        self._n += 1

    def requeue(self, seq: Seq) -> None:
        """A request preempted by recompute waits again, where the policy says."""
        self._n += 1
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
        for q in self._classes.values():
            yield from q
        yield from self._resumed

    def key(self, seq: Seq, now: float) -> float:
        """``seq``'s key in the order at ``now`` (``goes_before``: lower first, ties to
        the earlier arrival)."""
        if self._key is None:
            return 0.0
        return self._key(seq.priority, seq.enqueued, progress_of(seq), now, self._p)

    def candidates(self, now: float) -> Iterator[Seq]:
        """The waiting requests in the order the discipline admits them at ``now``: the
        lowest (key, arrival) among the classes' next requests and the resumed ones not
        yet offered; ties to the earlier class, then to a class over a resumed request."""
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
