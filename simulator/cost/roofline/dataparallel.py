"""Data-parallel attention on the roofline (``model.cost.dp``): vLLM's
``--data-parallel-size DP`` with ``--enable-expert-parallel`` on a mixture of experts.

A replica is ``dp`` ranks of ``tp`` GPUs. Each rank runs attention, any dense MLP, the
embedding and the LM head tensor-parallel over its own ``tp`` GPUs, on its own requests,
caching their KV (``catalog.plan_memory``: the replica's KV capacity is ``dp`` times one
rank's); the MoE layers' experts are spread whole over all ``EP = tp x dp`` GPUs and
every MoE layer moves the ranks' tokens to their experts and back by all-to-all
(``expert.ep_terms``).

The ranks are modelled as **balanced**: latsim schedules the replica's batch with one
scheduler (its ``max_num_seqs`` and ``max_num_batched_tokens`` are the replica's, the
sum of vLLM's per-rank flags), and each step is split evenly over the ranks. The
slowest rank runs ``ceil(decodes / dp)`` decodes (their contexts the batch's mean, the
sum rounded up) and ``ceil(n / dp)`` tokens of every prefill chunk of ``n``
(``rank_share``); a step costs that rank's time (``rank_constants``' physics). vLLM pads
every rank to the same token count for the MoE layers (its DP padding, so the ranks'
collectives match), so the EP group runs ``dp x`` the slowest rank's tokens: their
expert FLOPs per GPU are the rank's tokens' at ``1 / tp`` (what the physics prices),
the experts they read are those ``dp x T_r`` tokens are routed to, ``1 / dp`` of them
on each GPU (``rank_constants``), and the all-to-all carries them all. Two terms join
the step: ``dp_attention_share``, a chunk's attention as ``1 / dp`` of the whole
chunk's (the rank's ``ceil(n / dp)`` tokens alone would price ``1 / dp^2`` of the
causal pairs), and ``dp_sync``, the ranks agreeing on their token counts before each
forward (vLLM v1's ``get_batch_metadata_across_dp``, ``vllm/v1/worker/gpu/dp_utils.py``:
an all-reduce of every rank's token count and CUDA-graph size over the DP group's CPU
group, each step; every rank then runs the largest graph, as the slowest rank's
``ceil(decodes / dp)`` here does). latsim has no measurement of that host collective and
prices it as one collective's latency (the family's ``ar_lat_us``).

Stated approximations: a request lives on one rank in vLLM, its prefill chunk whole;
balancing splits the work of each step evenly instead (a real step with one long
prompt is slower: one rank holds it). Each rank pays the host launches of every chunk
in the step. The added terms sit after the host/device soft maximum, as EP's do at DP 1:
in a host-bound mixed step the physics hides the device time more tokens add while the
replaced all-reduce (negative) still falls with them, so such a step can cost a little
less with more chunk tokens (1e-5 of the step on Mixtral TP4 x DP2; decode-only and
prefill-only steps never do, ``tests/test_expert_dp.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from simulator.cost import physics as ph


def rank_constants(c: np.ndarray, dp: int) -> np.ndarray:
    """The physics constants of the slowest rank's step at ``dp`` ranks: ``c`` with the
    experts held ``1 / dp`` of them per GPU (``params_read`` and ``expert_params``; with
    the physics' ``1 / tp`` that is ``experts / (tp x dp)`` whole ones), and the routing
    of the rank's ``T_r`` tokens made that of the EP group's ``dp x T_r``: the distinct
    experts ``E (1 - (1 - k / E)^T)`` chosen by ``dp x T_r`` tokens are those ``T_r``
    tokens choose at ``k' = E (1 - (1 - k / E)^dp)`` each. A copy of ``c`` at DP 1."""
    out = c.copy()
    E = float(c[ph.C_EXPERTS])
    if dp <= 1 or E <= 1.0:
        return out
    k, pe = float(c[ph.C_TOPK]), float(c[ph.C_EXPERT_PARAMS])
    out[ph.C_PARAMS_READ] = c[ph.C_PARAMS_READ] - E * pe * (1.0 - 1.0 / dp)
    out[ph.C_EXPERT_PARAMS] = pe / dp
    out[ph.C_TOPK] = E * (1.0 - (1.0 - k / E) ** dp)
    return out


@dataclass(frozen=True)
class RankShare:
    """The slowest rank's share of a step (``rank_share``): its decodes, their contexts,
    its chunks, its tokens ``T_r`` (every decode's ``q`` queries and its chunk tokens)
    and the step's own tokens (all ranks, before padding)."""

    n_decode: int
    ctx_max: int
    ctx_sum: int
    chunks: Sequence[tuple]
    tokens: int
    total: int

    def padded(self, dp: int) -> int:
        """The EP group's tokens after vLLM's DP padding: ``dp x T_r``."""
        return dp * self.tokens


def rank_count(n: int, dp: int) -> int:
    """The slowest rank's share of ``n`` (decodes, or a chunk's tokens) split evenly over
    ``dp`` ranks: ``ceil(n / dp)`` (``n`` itself at DP 1)."""
    return -(-int(n) // dp) if dp > 1 else int(n)


def rank_share(n_decode: int, ctx_max: int, ctx_sum: int, chunks: Sequence[tuple], dp: int,
               q: int = 1) -> RankShare:
    """The step split evenly over ``dp`` ranks, the slowest rank's share (module doc):
    ``ceil(n_decode / dp)`` decodes at the batch's mean context (the sum rounded up, the
    longest at most that sum), ``ceil(n / dp)`` tokens of every chunk (its prior and
    completion flag kept). At DP 1 the step itself, the same objects."""
    total = n_decode * q + sum(int(ch[0]) for ch in chunks)
    if dp <= 1:
        return RankShare(n_decode, ctx_max, ctx_sum, chunks, total, total)
    nd = rank_count(n_decode, dp)
    cs = -(-ctx_sum * nd // n_decode) if n_decode else 0
    cm = min(ctx_max, cs)
    ch = [(rank_count(c[0], dp),) + tuple(c[1:]) for c in chunks]
    return RankShare(nd, cm, cs, ch, nd * q + sum(c[0] for c in ch), total)


def attention_share_ms(c: np.ndarray, chunks: Sequence[tuple], dp: int) -> float:
    """``dp_attention_share`` (ms): each chunk's attention as ``1 / dp`` of the whole
    chunk's, less what the physics already priced for the rank's ``ceil(n / dp)``
    tokens after the same prior (0 at DP 1)."""
    if dp <= 1:
        return 0.0
    out = 0.0
    for ch in chunks:
        n, prior = int(ch[0]), int(ch[1])
        m = rank_count(n, dp)
        out += (float(ph.chunk_attention_ms(c, n, prior)) / dp
                - float(ph.chunk_attention_ms(c, m, prior)))
    return out


def dp_sync_ms(c: np.ndarray, dp: int) -> float:
    """``dp_sync`` (ms): the ranks' agreement on their token counts before a forward
    (module doc), one collective's latency (the family's ``ar_lat_us``); 0 at DP 1."""
    return float(c[ph.C_AR_LAT_US]) * 1e-3 if dp > 1 else 0.0
