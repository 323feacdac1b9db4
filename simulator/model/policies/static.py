"""``static``: static batching, the baseline continuous batching replaced.

The engine takes a batch of waiting requests only when it is empty (up to
``batch_size``, whole prompts in one forward while they fit in the KV cache, and in
``max_batch_tokens`` if set),
prefills it, then decodes it until its last request finishes; nobody joins a batch in
flight. A request that finishes early leaves its slot empty until the whole batch is
done, so a long output holds every slot of its batch (one request alone uses 20-30% of a
GPU: ``data/README.md``, *Facts from two design articles*). One simplification, stated:
a finished request no longer costs decode work (a padded static engine would keep
computing its row).
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from simulator.kernel import kernel
from simulator.model.policies.fifo import prefill_whole
from simulator.model.scheduling.policy import REQUEUE_FRONT, Policy, PolicyParams, register_policy


@kernel
def fill_static(budget, chunk, max_seqs, n_running, free, n_dec, pre_rem, n_pre, cand_rem,
                cand_need, n_cand, out_pre, out_cand):
    """The fill rule of ``static`` (protocol in ``scheduling.policy``): a batch in flight
    prefills what is left of it (whole prompts while they fit), else decodes; an empty
    engine admits the next batch. ``max_seqs`` is the batch size; ``chunk`` unused."""
    if n_running > 0:
        npc, used = prefill_whole(budget, pre_rem, n_pre, out_pre)
        if npc:
            return 0, npc, 0, False
        return n_dec, 0, 0, False
    used = 0
    na = 0
    more = True
    for j in range(n_cand):
        n = cand_rem[j]
        if na >= max_seqs or (na and used + n > budget) or cand_need[j] > free:
            more = False
            break
        out_cand[j] = n
        used += n
        free -= cand_need[j]
        na += 1
    return 0, 0, na, more


@register_policy("static")
class StaticPolicy(Policy):
    """Static batching: a batch at a time, nobody joins one in flight (see module doc)."""

    class Params(PolicyParams):
        batch_size: Optional[int] = Field(None, ge=1, description="requests per batch "
                                          "(default: engine.max_num_seqs)")
        max_batch_tokens: Optional[int] = Field(None, ge=1, description="prompt tokens a "
                                                "batch's prefill may take (default: no "
                                                "limit, one forward over the whole batch)")

    fill_kernel = fill_static
    requeue = REQUEUE_FRONT

    def fill_limits(self) -> tuple[int, int, int]:
        b = self.params.batch_size
        seqs = self.limits.max_num_seqs if b is None else min(b, self.limits.max_num_seqs)
        # A static engine prefills its whole batch in one forward: the engine's per-step
        # token budget (a continuous batcher's knob) does not bound it.
        tokens = self.params.max_batch_tokens
        return (2 ** 62 if tokens is None else tokens), self.chunk_size, seqs
