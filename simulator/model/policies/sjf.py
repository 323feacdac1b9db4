"""``sjf``: shortest job first (non-preemptive), on chunked prefill.

A waiting request's key is its remaining prefill tokens (its prompt, after a preemption
by recompute the prompt plus what it had generated), plus ``output_weight`` times the
output tokens it has still to generate: lower first, ties to the earlier arrival. The
output term reads the workload's own ``output_tokens``, the true length a request will
generate: a perfect length predictor, an upper bound on what a predictor buys (no
workload carries a separate prediction; the real engine sees ``max_tokens`` there).
``output_weight: 0`` (the default) orders by prompt alone, which a server knows.

The key is computed once, when a request joins the queue, and every waiting request
is compared (prompts do not follow arrival order), so the queue is kept sorted by key;
the compiled loop compares only the heads of per-class FIFOs and declines it (``auto``
says so and runs SimPy). A request admitted runs to completion: shorter jobs arriving
later do not preempt it, and a long prompt can wait as long as short ones keep
arriving (SJF's starvation, unbounded under overload).
"""
from __future__ import annotations

from pydantic import Field

from simulator.model.policies.chunked import ChunkParams, fill_chunked
from simulator.model.scheduling.policy import REQUEUE_FRONT, Policy, register_policy


class SjfParams(ChunkParams):
    output_weight: float = Field(0.0, ge=0, le=1e6, description="weight of the output tokens "
                                 "still to generate in the key (the workload's true length: "
                                 "an oracle predictor); 0: prompt tokens alone")


@register_policy("sjf")
class ShortestJobFirst(Policy):
    """Shortest (remaining prefill [+ weighted output]) first over chunked prefill."""

    Params = SjfParams
    fill_kernel = fill_chunked
    requeue = REQUEUE_FRONT

    def order_key(self, req) -> float:
        w = self.params.output_weight
        key = float(req.remaining_prefill)
        if w:
            key += w * (req.output_tokens - req.generated)
        return key
