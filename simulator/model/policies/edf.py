"""``edf``: earliest TTFT deadline first, on chunked prefill.

A waiting request's deadline is ``enqueued + slo_ttft_s`` of its class (the class's own
TTFT target, else the scenario's ``slo.ttft_ms``; ``no_slo_ttft_s`` for a class with
neither): the earliest deadline is admitted first, ties to the earlier arrival. The
deadline runs from the request's arrival at the replica (what an engine sees; with a
network in front, the client's TTFT also holds the request's trip there, the same for
every request of one client path). Without classes, or with one TTFT target for all,
it is FIFO.

Within a class every request has the same target, so an earlier arrival always has the
earlier deadline: the queue keeps one FIFO per class and compares the heads, as the
built-in aging order does, and the compiled loop runs it with the same kernel
(``edf_key``, over ``order_params``: ``[no_slo_ttft_s, target of priority 0, 1, ...]``).
An arrival of an urgent class can go before a blocked head of another class, so the
order counts as time-dependent (a waiting queue ends a decode epoch at each arrival).

Non-preemptive: EDF meets every deadline a non-preemptive schedule could when all jobs
wait together; with staggered arrivals a long job already admitted can make a short
urgent one miss.
"""
from __future__ import annotations

import numpy as np
from pydantic import Field

from simulator.kernel import kernel
from simulator.model.policies.chunked import ChunkParams, fill_chunked
from simulator.model.scheduling.policy import REQUEUE_ARRIVAL, Policy, register_policy
from simulator.model.scheduling.queues import arrival_ordered

# A class without a TTFT target: its deadline this far after arrival (after any class
# with a target in practice, and FIFO among its own).
DEFAULT_NO_SLO_S = 1e6


@arrival_ordered      # one target per class: an earlier arrival has the earlier deadline
@kernel
def edf_key(prio, enq, progress, now, p):
    """The queue order of ``edf``: ``enq + p[prio + 1]`` (the class's TTFT target), or
    ``enq + p[0]`` for a priority past the table."""
    i = prio + 1
    if i < len(p):
        return enq + p[i]
    return enq + p[0]


class EdfParams(ChunkParams):
    no_slo_ttft_s: float = Field(DEFAULT_NO_SLO_S, gt=0, le=1e9, description="TTFT target "
                                 "(s) of a class without one (default: after every target)")


@register_policy("edf")
class EarliestDeadlineFirst(Policy):
    """Earliest TTFT deadline first over chunked prefill (see module doc)."""

    Params = EdfParams
    fill_kernel = fill_chunked
    order_kernel = edf_key
    requeue = REQUEUE_ARRIVAL
    by_class = True
    time_dependent = True

    def order_params(self) -> list[float]:
        # ``classes`` is set by the run after the policy is built: read at each use.
        classes = getattr(self, "classes", None) or {}
        n = max(classes, default=-1) + 1
        p = [float(self.params.no_slo_ttft_s)] * (n + 1)
        for prio, c in classes.items():
            if c.slo_ttft_s is not None:
                p[int(prio) + 1] = float(c.slo_ttft_s)
        return p

    @property
    def order_array(self) -> np.ndarray:
        return np.asarray(self.order_params(), dtype=np.float64)
