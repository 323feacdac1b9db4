"""``fifo``: vLLM-v0-style continuous batching with whole-prompt prefill steps.

When a waiting request can be admitted, the step is a prefill-only step of whole
prompts: decodes pause, so a long prompt shows up as a long inter-token gap for every
running request; otherwise the step decodes every running request. Requests are
admitted strictly in arrival order while their prompts fit in the token budget (a
single prompt larger than the budget runs alone) and their KV blocks and a sequence
slot are free: if the head cannot be admitted nobody behind it is (head-of-line
blocking).
"""
from __future__ import annotations

from simulator.kernel import kernel
from simulator.model.scheduling.policy import REQUEUE_FRONT, Policy, PolicyParams, register_policy


@kernel
def prefill_whole(budget, pre_rem, n_pre, out_pre):
    """The running prefills, each whole, while they fit in ``budget`` (the first one
    always): ``(prefills taken, tokens used)``."""
    used = 0
    npc = 0
    for i in range(n_pre):
        n = pre_rem[i]
        if npc and used + n > budget:
            break
        out_pre[i] = n
        used += n
        npc += 1
    return npc, used


@kernel
def fill_whole_prompts(budget, chunk, max_seqs, n_running, free, n_dec, pre_rem, n_pre,
                       cand_rem, cand_need, n_cand, out_pre, out_cand):
    """The fill rule of ``fifo`` (protocol in ``scheduling.policy``): whole prompts
    while they fit, else every decode. ``chunk`` is not used."""
    # A request left mid-prefill (only if an executor split it) finishes first.
    npc, used = prefill_whole(budget, pre_rem, n_pre, out_pre)
    na = 0
    running = n_running
    more = True
    for j in range(n_cand):
        if running >= max_seqs:
            more = False
            break
        n = cand_rem[j]
        if ((npc or na) and used + n > budget) or cand_need[j] > free:
            more = False
            break
        out_cand[j] = n
        used += n
        running += 1
        free -= cand_need[j]
        na += 1
    if npc or na:
        return 0, npc, na, more
    return n_dec, 0, 0, more


@register_policy("fifo")
class FifoPolicy(Policy):
    """Whole-prompt prefill steps that pause decodes (see module doc)."""

    class Params(PolicyParams):
        pass

    fill_kernel = fill_whole_prompts
    requeue = REQUEUE_FRONT
