"""``priority_aging``: chunked prefill whose admissions follow priority classes with aging.

A waiting request's key is ``priority - floor(wait_s / aging_s)``, recomputed at every
decision (lower first, ties to the earlier arrival), so a low-priority request gains
one class per ``aging_s`` seconds of waiting and cannot starve: after ``priority *
aging_s`` it ties with a fresh P0 request and wins on arrival order. Within a class
every request ages at the same rate, so the queue keeps one FIFO per class and only
compares the classes' heads. A request preempted by recompute rejoins its class in
arrival order, keeping the aging it earned.
"""
from __future__ import annotations

import math
from typing import Optional

from pydantic import Field

from simulator.kernel import kernel
from simulator.model.policies.chunked import ChunkParams, fill_chunked
from simulator.model.scheduling.policy import REQUEUE_ARRIVAL, Policy, register_policy
from simulator.model.scheduling.queues import arrival_ordered


@arrival_ordered      # within a class the longer wait never has the higher key
@kernel
def aging_key(prio, enq, progress, now, p):
    """The queue order of ``priority_aging``: ``prio - floor(wait / aging_s)`` with
    ``aging_s = p[0]``."""
    wait = now - enq
    if not wait > 0.0:
        wait = 0.0
    return prio - math.floor(wait / p[0])


# Seconds of waiting worth one priority class when nothing says otherwise.
DEFAULT_AGING_S = 30.0


class AgingParams(ChunkParams):
    aging_s: Optional[float] = Field(None, gt=0, description="seconds of waiting worth one "
                                     "priority class (default: engine.aging_s)")


@register_policy("priority_aging")
class PriorityAgingPolicy(Policy):
    """Chunked prefill over priority classes with aging (see module doc)."""

    Params = AgingParams
    fill_kernel = fill_chunked
    order_kernel = aging_key
    requeue = REQUEUE_ARRIVAL
    by_class = True
    time_dependent = True

    @property
    def aging_s(self) -> float:
        return float(self.params.aging_s if self.params.aging_s is not None
                     else DEFAULT_AGING_S)

    def order_params(self) -> list[float]:
        return [self.aging_s]
