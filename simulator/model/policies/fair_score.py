"""``fair_score``: a weighted fair scheduler (starvation bonus + VIP + progress), on
chunked prefill.

A waiting request's score is

    min(wait / wait_scale_s, wait_cap) * w_wait      (starvation bonus, 5 s and 3 by default)
  + w_vip * (-priority)                              (VIP boost: P0 above P1 above P2)
  + progress * w_progress                            (generated / output tokens)

(the weights of the article it comes from as defaults: 0.5, 1.0, 0.5;
``data/README.md``, *Facts from two design articles*), and the highest score is admitted
first (ties to the earlier arrival). There the VIP level grows with importance; latsim's
classes count the other way (P0 first), hence ``-priority``: only differences between
scores order requests, so this is that rule up to a constant.

What it bounds: the starvation bonus is capped at ``w_wait * wait_cap`` (1.5), so a
request overtakes fresh requests of a class at most ``1.5 / w_vip`` classes above its
own: a P1 request waits at most until its bonus passes 1 (10 s) behind any amount of
P0 traffic, while a P2 request can starve behind a steady stream of P0 (its best score,
-0.5, never reaches a fresh P0's 0). ``progress`` is non-zero only for a request
preempted by recompute (it generated tokens, then lost its KV): it protects work
already done.

The queue: with no progress, an earlier request of a class has waited longer, so each
class's FIFO is in score order and only the heads are compared; a preempted request
(progress > 0) waits among the "resumed" ones, each compared with the heads at every
decision.
"""
from __future__ import annotations


from pydantic import Field

from simulator.kernel import kernel
from simulator.model.policies.chunked import ChunkParams, fill_chunked
from simulator.model.scheduling.policy import REQUEUE_RESUMED, Policy, register_policy
from simulator.model.scheduling.queues import arrival_ordered

# Indices of the order parameters (``FairScorePolicy.order_params``).
F_SCALE, F_CAP, F_WAIT, F_VIP, F_PROGRESS = range(5)


@arrival_ordered      # within a class the longer wait never has the higher key
@kernel
def fair_key(prio, enq, progress, now, p):
    """The queue order of ``fair_score``: minus the score (lower key first)."""
    wait = now - enq
    if not wait > 0.0:
        wait = 0.0
    bonus = wait / p[F_SCALE]
    if bonus > p[F_CAP]:
        bonus = p[F_CAP]
    return -(bonus * p[F_WAIT] - p[F_VIP] * prio + progress * p[F_PROGRESS])


class FairParams(ChunkParams):
    wait_scale_s: float = Field(5.0, gt=0, description="seconds of waiting per unit of bonus")
    wait_cap: float = Field(3.0, ge=0, description="the starvation bonus's cap (in units)")
    w_wait: float = Field(0.5, ge=0, description="weight of the starvation bonus")
    w_vip: float = Field(1.0, ge=0, description="weight of one priority class")
    w_progress: float = Field(0.5, ge=0, description="weight of generated / output tokens")


@register_policy("fair_score")
class FairScorePolicy(Policy):
    """The weighted fair scheduler over chunked prefill (see module doc)."""

    Params = FairParams
    fill_kernel = fill_chunked
    order_kernel = fair_key
    requeue = REQUEUE_RESUMED
    by_class = True
    time_dependent = True

    def order_params(self) -> list[float]:
        p = self.params
        return [p.wait_scale_s, p.wait_cap, p.w_wait, p.w_vip, p.w_progress]
