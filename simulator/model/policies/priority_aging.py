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
# The shortest aging interval: the compiled key floors wait / aging_s into an int64, and
# a microsecond keeps a wait of 1e11 s (no run spans more) at 1e17 classes, below 2^63
# (at 1e-300 the compiled key saturated at -2^63 for every waiting request while the
# SimPy loop's Python ints did not: the two loops ordered the queue differently).
MIN_AGING_S = 1e-6


class AgingParams(ChunkParams):
    aging_s: Optional[float] = Field(None, ge=MIN_AGING_S, description="seconds of waiting "
                                     "worth one priority class (default: engine.aging_s)")


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
