"""``chunked``: Sarathi-style chunked prefill.

Decodes first (one token each), then prefill chunks up to the token budget: the
partially prefilled requests first, then new admissions in queue order. ``chunk_size``
caps one request's chunk in a step, ``max_num_batched_tokens`` the whole step, so a
long prompt is spread over several steps and decodes keep flowing between its chunks.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from simulator.kernel import kernel
from simulator.model.scheduling.policy import REQUEUE_FRONT, Policy, PolicyParams, register_policy


@kernel
def fill_chunked(budget, chunk, max_seqs, n_running, free, n_dec, pre_rem, n_pre,
                 cand_rem, cand_need, n_cand, out_pre, out_cand):
    """The fill rule of ``chunked`` (protocol in ``scheduling.policy``)."""
    if n_dec > budget:
        # More decoders than tokens: the oldest ones decode; the rest wait a step.
        return budget, 0, 0, False
    left = budget - n_dec
    npc = 0
    for i in range(n_pre):
        if left <= 0:
            break
        n = pre_rem[i]
        n = n if n < chunk else chunk
        n = n if n < left else left
        out_pre[i] = n
        left -= n
        npc += 1
    na = 0
    more = False
    if left > 0:
        more = True
        running = n_running
        for j in range(n_cand):
            if left <= 0 or running >= max_seqs or cand_need[j] > free:
                more = False
                break
            n = cand_rem[j]
            n = n if n < chunk else chunk
            n = n if n < left else left
            out_cand[j] = n
            left -= n
            running += 1
            free -= cand_need[j]
            na += 1
    return n_dec, npc, na, more


class ChunkParams(PolicyParams):
    """Parameters of the chunked-prefill policies."""

    chunk_size: Optional[int] = Field(None, ge=1, description="max prefill tokens of one "
                                      "request in a step (default: engine.chunk_size, "
                                      "else the token budget)")


@register_policy("chunked")
class ChunkedPolicy(Policy):
    """Chunked prefill (see module doc), admissions in arrival order."""

    Params = ChunkParams
    fill_kernel = fill_chunked
    requeue = REQUEUE_FRONT
