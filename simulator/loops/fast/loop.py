"""The replica model without SimPy: the same model, run by its own event loop.

``simulate`` builds the SimPy model of ``replica`` and ``wire``. Most large runs use
only part of it: the built-in policies (fifo, chunked, priority_aging), no
per-request stream models, frames that always leave faster than a step (the replica's *fast* bookkeeping with decode epochs). For those, this module
replays the *same* model with a plain event loop and the policies' decisions written
inline (``fastreplica``), because a SimPy step (event objects, generator resumption,
a ``SchedulerState`` and a frozen ``StepPlan`` per step) costs as much again as the
work the step itself does: this loop runs the benchmark of ``benchmarks/sim_speed.py``
about twice as fast.

It is not an approximation:

- events are processed in SimPy's order - by time, then priority (an interrupt is
  urgent), then the order they were scheduled in - and they are scheduled at the
  same moments as in the SimPy model, so ties resolve the same way;
- every formula is the replica's (ticks, the finish heap, epochs cut by an
  admissible arrival at the next step boundary, growth caught up after an epoch),
  with the same floating-point operations in the same order; paged growth is counted
  by block-boundary phase instead of a heap of per-request boundaries, which takes
  the same blocks at the same steps;
- the cost model, routers, connection pools, recorder and, for priority_aging, the
  waiting queue are the very objects the SimPy model uses, and so is the block
  manager with prefix caching (``PrefixKV``: which cached blocks a growth evicts
  depends only on how many blocks are taken, so decoders grow in any order).

``tests/test_fastloop.py`` checks that every recorded array, the ITL histogram, the
time series, the step tallies and the end time are identical, bit for bit, on
random configurations. The inline decisions are a second copy of ``FifoPolicy`` /
``ChunkedPolicy`` (``PriorityAgingPolicy`` is ``ChunkedPolicy`` over its own queue):
that test is what keeps them the same. A policy registered by a user runs on SimPy.

Preemption (growth finds too few free blocks) by recompute and by swap is modelled,
with both victim rules. What it does not model is decided before the run
(``unsupported_reason``); an empty plan, which the SimPy model reports as an error,
raises ``Unsupported`` mid-run and ``simulate`` runs the scenario again with SimPy,
which then reports it.
"""
from __future__ import annotations

import heapq
from typing import Optional

import numpy as np

from simulator.loops.fast.replica import (_ARRIVE, _DELIVER, _END, _INTERRUPT, _STOP, _WAKE, NORMAL, URGENT,
                          FastReplica, Unsupported, _Req)
from simulator.model.scheduling.policies import ChunkedPolicy, FifoPolicy, PriorityAgingPolicy

__all__ = ["FastLoop", "Unsupported", "unsupported_reason"]

_WINDOW = 1 << 16                           # workload rows read into lists at a time


def unsupported_reason(policy, rules, rich: bool, mode: str, cost_model,
                       frame_time: float, costs, router: str) -> Optional[str]:
    """Why this loop cannot run the configuration (None if it can)."""
    if mode != "auto":
        return f"bookkeeping mode {mode!r} was asked for"
    if rich:
        return "per-request stream models"
    if cost_model is not None:
        return "a cost model passed in"
    if type(policy) not in (ChunkedPolicy, FifoPolicy, PriorityAgingPolicy):
        return f"policy {policy.name!r}"
    if router not in ("round_robin", "random", "least_outstanding"):
        return f"router {router!r}"
    lim = policy.limits
    if lim.max_num_seqs > lim.max_num_batched_tokens:
        return "max_num_seqs above the token budget"
    if any(frame_time > c.min_step_s for c in costs):
        return "frames slower than the fastest step"
    return None

class FastLoop:
    """The event loop: arrivals, deliveries, and each replica's step ends (see module doc)."""

    def __init__(self, *, rec, n_replicas: int, policy, costs, capacity,
                 rules, swap: tuple, router, pools, net, frame_time: float, one_way: float,
                 series_interval: float, arrival, prompt, output, priority, clients,
                 until: Optional[float], keys_of=None) -> None:
        self.now = 0.0
        self._heap: list = []
        self._eid = 0
        self.rec = rec
        self.router = router
        self.pools = pools
        self.net = net
        self.one_way = one_way
        # The workload's columns, read through windows of Python lists: a list element
        # is cheaper to read than a numpy one, and a million-request run should not
        # hold five million boxed numbers.
        self._cols = (np.asarray(arrival, dtype=np.float64), np.asarray(prompt),
                      np.asarray(output), np.asarray(clients), np.asarray(priority))
        self._n = len(self._cols[0])
        self._lo = 0
        self._win = [[] for _ in self._cols]
        self.until = until
        self.keys_of = keys_of    # rid -> prefix-cache keys of its prompt blocks
        self.replicas = [FastReplica(self, i, policy, costs[i], capacity, rules, swap, rec,
                                     frame_time, one_way, series_interval)
                         for i in range(n_replicas)]
        self._next = 0        # the arrival process: next request, and its clock ``t``
        self._t = 0.0

    def push(self, t: float, prio: int, kind: int, obj=None, ver: int = 0) -> None:
        heapq.heappush(self._heap, (t, prio, self._eid, kind, obj, ver))
        self._eid += 1

    def run(self) -> float:
        """Run to the end (or ``until``); returns the clock at the end, as SimPy's ``now``."""
        # SimPy's start: each replica's process and then the arrival process are
        # initialised (urgent, at 0); ``run(until)`` then schedules its stop (urgent).
        self._eid = len(self.replicas)
        self.push(0.0, URGENT, _ARRIVE)
        if self.until is not None:
            self.push(float(self.until), URGENT, _STOP)
        heap = self._heap
        pop = heapq.heappop
        resumed = False
        while heap:
            t, _, _, kind, obj, ver = pop(heap)
            self.now = t
            if kind == _END:
                if ver == obj.ver:
                    obj.ended(t)
            elif kind == _DELIVER:
                self._deliver(obj, t)
            elif kind == _ARRIVE:
                self._arrivals(t, resumed)
                resumed = True
            elif kind == _WAKE:
                obj.woken(t)
            elif kind == _INTERRUPT:
                obj.interrupted(t)
            else:
                break
        return self.now

    def _arrivals(self, now: float, resumed: bool) -> None:
        """``simulate.arrivals``: send every request whose time has come."""
        pools, net, rec = self.pools, self.net, self.rec
        new_conn = rec.new_connection
        handshake = net.handshake
        rid = self._next
        n = self._n
        lo = self._lo
        arrival, prompt, output, clients, prio = self._win
        while rid < n:
            i = rid - lo
            if i >= len(arrival):
                lo = self._lo = rid
                i = 0
                self._win = [c[rid:rid + _WINDOW].tolist() for c in self._cols]
                arrival, prompt, output, clients, prio = self._win
            a = arrival[i]
            if not resumed and a > self._t:
                self.push(now + (a - self._t), NORMAL, _ARRIVE)
                self._t = a
                self._next = rid
                return
            resumed = False
            c = clients[i]
            is_new, pooled = pools.acquire(c, now)
            new_conn[rid] = is_new
            p = prompt[i]
            s = _Req(rid, p, output[i], c, pooled, prio[i])
            if self.keys_of is not None:
                s.keys = self.keys_of(rid)
            t_net = net.send_time(p) + (handshake if is_new else 0.0)
            self.push(now + t_net, NORMAL, _DELIVER, s)
            rid += 1
        self._next = n

    def _deliver(self, s: _Req, now: float) -> None:
        rec = self.rec
        rid = s.rid
        s.enqueued = now
        rec.enqueued[rid] = now
        replicas = self.replicas
        if replicas[0].rejects(s):
            rec.rejected[rid] = True
            self.pools.release(s.client, now + self.one_way, s.pooled)
            return
        k = self.router.pick(replicas, s)
        rec.replica[rid] = k
        replicas[k].enqueue(s, now)
