"""Waiting-queue disciplines, as small pure selectors (Ciw style).

A queue holds the requests not yet admitted. ``candidates(now)`` yields them in
the order the discipline would admit them *at time now*, without mutating the
queue; the executor removes the ones a plan admits.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Iterator

from simulator.model.scheduling.plan import Seq


class FifoQueue:
    """First come, first served by the time a request reached the replica."""

    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: deque[Seq] = deque()

    def push(self, seq: Seq) -> None:
        self._q.append(seq)

    def requeue(self, seq: Seq) -> None:
        """A preempted request goes back to the head (it arrived before anyone waiting)."""
        self._q.appendleft(seq)

    def remove(self, seq: Seq) -> None:
        # Admission nearly always takes the head, so this is O(1) in practice.
        if self._q and self._q[0] is seq:
            self._q.popleft()
        else:
            self._q.remove(seq)

    def __len__(self) -> int:
        return len(self._q)

    def candidates(self, now: float) -> Iterator[Seq]:
        return iter(self._q)


class AgingPriorityQueue:
    """Priority classes with aging: effective key ``priority - floor(wait / aging_s)``.

    Lower key is served first (P0 before P1 before P2); ties go to the earlier
    arrival. The key is recomputed at every decision from ``now``. Within one
    class every request ages at the same rate, so FIFO order inside a class is
    always key order; the best candidate is therefore among the class heads, and
    ordering the whole queue needs only a merge of per-class FIFOs, not a sort.
    """

    __slots__ = ("aging_s", "_classes", "_n")

    def __init__(self, aging_s: float) -> None:
        if not aging_s > 0:
            raise ValueError(f"aging_s must be > 0, got {aging_s}")
        self.aging_s = aging_s
        self._classes: dict[int, deque[Seq]] = {}
        self._n = 0

    def push(self, seq: Seq) -> None:
        q = self._classes.get(seq.priority)
        if q is None:
            q = self._classes[seq.priority] = deque()
        q.append(seq)
        self._n += 1

    def requeue(self, seq: Seq) -> None:
        """A preempted request rejoins its class in arrival order (it keeps ``enqueued``,
        so it also keeps the aging it earned)."""
        q = self._classes.get(seq.priority)
        if q is None:
            q = self._classes[seq.priority] = deque()
        i = 0
        while i < len(q) and q[i].enqueued <= seq.enqueued:
            i += 1
        q.insert(i, seq)
        self._n += 1

    def remove(self, seq: Seq) -> None:
        q = self._classes[seq.priority]
        if q and q[0] is seq:
            q.popleft()
        else:
            q.remove(seq)
        self._n -= 1

    def __len__(self) -> int:
        return self._n

    def key(self, seq: Seq, now: float) -> tuple[float, float]:
        """Effective priority of ``seq`` at ``now`` (lower is served first)."""
        wait = max(0.0, now - seq.enqueued)
        return (seq.priority - math.floor(wait / self.aging_s), seq.enqueued)

    def candidates(self, now: float) -> Iterator[Seq]:
        heads = {p: 0 for p, q in self._classes.items() if q}
        while heads:
            best_p = None
            best_key = None
            for p, i in heads.items():
                k = self.key(self._classes[p][i], now)
                if best_key is None or k < best_key:
                    best_key, best_p = k, p
            q = self._classes[best_p]
            i = heads[best_p]
            yield q[i]
            if i + 1 < len(q):
                heads[best_p] = i + 1
            else:
                del heads[best_p]
