"""Expert parallelism (EP) of a mixture of experts on the roofline: the named terms a
step gains when a MoE layer's experts are spread whole over ``ep`` GPUs instead of
each expert being cut by tensor parallelism.

Convention (vLLM's): ``--enable-expert-parallel`` makes the MoE layers' EP group
``EP = TP x DP`` over the same GPUs; attention stays tensor-parallel within each of the
``dp`` data-parallel ranks (``model.cost.dp``; ``roofline.dataparallel`` prices a step
of ``dp > 1``). ``model.cost.ep`` is 1 (experts TP-sharded, the physics as before) or
``tp x dp``. At DP = 1 the replica takes ``tp x pp`` GPUs, and each GPU holds
``experts / ep`` whole experts per MoE layer -- the same bytes as ``1 / tp`` of every
expert, so the weights per GPU and the KV capacity do not change
(``expert_bytes_per_gpu``); at DP > 1 each GPU holds ``1 / dp`` of that.

The terms, per step of ``T`` packed tokens (at DP > 1: the EP group's, every rank
padded to the slowest one's ``T_r``, ``T = dp x T_r``), added to the physics' step
(``ep_terms``):

- ``ep_dispatch`` / ``ep_combine``: per MoE layer one all-to-all each way. The step
  moves ``T x top_k x hidden x 2`` bytes each way (16-bit activations,
  ``a2a_bytes_per_layer``); tokens start spread evenly over the ``ep`` GPUs and a
  routed copy stays on its GPU with probability ``1 / ep``, so each GPU sends
  ``T / ep x top_k x hidden x 2 x (ep - 1) / ep`` bytes over its link, at the GPU's
  one-way NVLink datasheet rate (``catalog.gpu``'s ``link_gbs_unidir``) times an
  all-to-all efficiency from DeepEP's published intranode numbers
  (``A2A_DISPATCH_EFF``, ``A2A_COMBINE_EFF``), plus one NCCL latency (the family's
  ``ar_lat_us``, fitted to Vidur's NCCL tables) per call;
- ``ep_allreduce_replaced`` (negative): the MoE layers' second TP all-reduce, which
  the combine replaces (``physics.comm_times`` priced one per layer, over the rank's
  ``T_r`` tokens; none at TP 1);
- ``ep_imbalance``: the busiest GPU's expert compute beyond the mean's: ``(f - 1) x``
  the balanced per-GPU expert FLOPs ``2 x T x top_k x expert_params / ep`` at ``peak x
  e_gemm``, with ``f`` the busiest GPU's share of routed tokens over the mean
  (``uniform_imbalance`` for uniform routing, or the configured ``expert_imbalance``).
  Only compute: in a weight-bound step every GPU still reads its routed experts once.

Approximations stated: ``T`` is the step's tokens before CUDA-graph padding; the terms
add to the step after the host/device soft maximum; the imbalance uses the flat GEMM
efficiency, not its small-GEMM curve.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from simulator.cost import physics as ph
from simulator.cost.catalog import GpuSpec, ModelArch, weight_format

# DeepEP V1 normal kernels, intranode EP 8 on H800 (DeepSeek-V3 setting: 4,096 tokens,
# hidden 7,168, top-8): dispatch 153 GB/s and combine 158 GB/s bottleneck NVLink
# bandwidth (github.com/deepseek-ai/DeepEP, docs/legacy.md, "Performance"), of the
# H800's 200 GB/s one-way NVLink (NVIDIA H800 SXM datasheet: 400 GB/s NVLink).
DEEPEP_H800_DISPATCH_GBS = 153.0
DEEPEP_H800_COMBINE_GBS = 158.0
H800_NVLINK_GBS_UNIDIR = 200.0
A2A_DISPATCH_EFF = DEEPEP_H800_DISPATCH_GBS / H800_NVLINK_GBS_UNIDIR
A2A_COMBINE_EFF = DEEPEP_H800_COMBINE_GBS / H800_NVLINK_GBS_UNIDIR


def a2a_bytes_per_layer(tokens: float, top_k: int, hidden: int, dtype_bytes: float = 2.0) -> float:
    """Bytes one all-to-all (dispatch or combine) of one MoE layer moves, all GPUs
    together: every token's ``top_k`` routed copies of its hidden state."""
    return float(tokens) * top_k * hidden * dtype_bytes


def expert_bytes_total(arch: ModelArch, weight_dtype: str = "bf16") -> float:
    """Bytes of every expert's linear weights over all MoE layers."""
    return (arch.moe_layers * arch.experts * arch.expert_linear_weights()
            * weight_format(weight_dtype).bytes_per_weight)


def expert_bytes_per_gpu(arch: ModelArch, ep: int, weight_dtype: str = "bf16") -> float:
    """Expert weight bytes one GPU of the EP group holds: ``experts / ep`` whole experts."""
    return expert_bytes_total(arch, weight_dtype) / ep


@lru_cache(maxsize=64)
def expected_max_std_normal(n: int) -> float:
    """``E[max of n iid standard normals]``: ``∫ x n φ(x) Φ(x)^(n-1) dx`` on a fixed
    grid (±10, 20,001 points: the integrand's tails beyond are below 1e-20)."""
    if n <= 1:
        return 0.0
    x = np.linspace(-10.0, 10.0, 20001)
    phi = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    Phi = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    f = x * n * phi * Phi ** (n - 1)
    return float(np.sum((f[1:] + f[:-1]) * 0.5 * (x[1] - x[0])))


def uniform_imbalance(tokens: float, top_k: int, experts: int, ep: int) -> float:
    """The busiest GPU's routed tokens over the mean, expected, for ``tokens`` tokens
    each routed to ``top_k`` distinct experts drawn uniformly of ``experts``, the
    experts ``experts / ep`` to a GPU. One token's copies on a GPU are hypergeometric
    (mean ``k / ep``, variance ``k p (1 - p) (E - k) / (E - 1)``, ``p = 1 / ep``); over
    the tokens the counts are about normal with a fixed sum, so their maximum is the
    mean plus ``σ sqrt(ep / (ep - 1)) E[max of ep standard normals]``. Counts are
    whole copies: the busiest GPU holds at least ``ceil(mean)`` (the bound that binds
    in small decode steps, where the normal law is loose: one token routed to 2 of 8
    experts on 8 GPUs gives exactly 4)."""
    if ep <= 1 or tokens <= 0:
        return 1.0
    p = 1.0 / ep
    mean = tokens * top_k * p
    var = tokens * top_k * p * (1.0 - p) * (experts - top_k) / (experts - 1.0)
    sd = math.sqrt(var * ep / (ep - 1.0))
    return max(1.0 + sd * expected_max_std_normal(ep) / mean, math.ceil(mean - 1e-9) / mean)


@dataclass(frozen=True)
class ExpertParallel:
    """The EP facts of one roofline model (``ep_terms`` prices a step from them)."""

    ep: int
    experts: int
    top_k: int
    hidden: int
    moe_layers: int
    layers: int
    expert_params: float        # one expert's linear weights, all MoE layers
    link_gbs: float             # one-way GPU-to-GPU datasheet rate
    lat_us: float               # one NCCL call's latency
    gemm_tflops: float          # peak x e_gemm
    imbalance: Optional[float]  # None: uniform routing (``uniform_imbalance``)

    @classmethod
    def of(cls, arch: ModelArch, spec: GpuSpec, c: np.ndarray, ep: int,
           imbalance: Optional[float] = None) -> "ExpertParallel":
        """From the architecture, the GPU and the physics constants it runs with."""
        return cls(ep=int(ep), experts=arch.experts, top_k=arch.experts_per_token,
                   hidden=arch.hidden, moe_layers=arch.moe_layers, layers=arch.layers,
                   expert_params=float(c[ph.C_EXPERT_PARAMS]),
                   link_gbs=float(spec.link_gbs_unidir),
                   lat_us=float(c[ph.C_AR_LAT_US]),
                   gemm_tflops=float(c[ph.C_PEAK_TFLOPS] * c[ph.C_E_GEMM]),
                   imbalance=imbalance)

    def factor(self, tokens: float) -> float:
        """The busiest GPU's routed tokens over the mean."""
        if self.imbalance is not None:
            return float(self.imbalance)
        return uniform_imbalance(tokens, self.top_k, self.experts, self.ep)


def ep_terms(x: ExpertParallel, c: np.ndarray, tokens: float,
             rank_tokens: Optional[float] = None) -> dict:
    """The EP terms (ms) of a step of ``tokens`` packed tokens over the EP group (module
    doc), and ``ep_total``, what they add to the step. ``rank_tokens``: the tokens of one
    data-parallel rank, whose TP all-reduce the combine replaces (default ``tokens``:
    DP = 1)."""
    T = float(tokens)
    T_rank = T if rank_tokens is None else float(rank_tokens)
    ep = x.ep
    per_gpu = a2a_bytes_per_layer(T / ep, x.top_k, x.hidden) * (ep - 1) / ep
    lat = x.lat_us * 1e-3
    dispatch = x.moe_layers * (lat + per_gpu / (x.link_gbs * A2A_DISPATCH_EFF) * 1e-6)
    combine = x.moe_layers * (lat + per_gpu / (x.link_gbs * A2A_COMBINE_EFF) * 1e-6)
    ar, _ = ph.comm_times(c, T_rank)
    # ``comm_times`` is ``ar_per_layer`` all-reduces in each of ``layers``: one per MoE layer.
    replaced = -float(ar) / (c[ph.C_AR_PER_LAYER] * x.layers) * x.moe_layers
    balanced_ms = 2.0 * T * x.top_k * x.expert_params / ep / (x.gemm_tflops * 1e9)
    imb = (x.factor(T) - 1.0) * balanced_ms
    out = {"ep_dispatch": float(dispatch), "ep_combine": float(combine),
           "ep_allreduce_replaced": float(replaced), "ep_imbalance": float(imb)}
    out["ep_total"] = float(dispatch + combine + replaced + imb)
    return out
