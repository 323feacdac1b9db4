"""The roofline's physics constants vector: a model on ``tp x pp`` GPUs of one type, served
by an engine, with given efficiencies (``build_constants``).

The model's shape comes from ``catalog.model``, the GPU's datasheet peaks from
``catalog.gpu`` (the peak the linear layers run at depends on the weight format:
``compute_peak``), the engine's facts from ``Engine`` (default: vLLM-like), and the
efficiencies and overheads from ``defaults.DEFAULTS`` unless given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from simulator.cost import catalog
from simulator.cost import physics as ph
from simulator.cost.catalog import GpuSpec, ModelArch
from simulator.cost.fit import NO_BOUND_GBS
from simulator.cost.roofline.defaults import (DEFAULTS, custom_allreduce_terms,
                                              flash_efficiency, link_terms,
                                              weight_read_efficiency)

# vLLM's default CUDA-graph capture sizes (batch 1, 2, 4, then every 8 up to 256).
VLLM_GRAPH_BUCKETS = (1, 2, 4) + tuple(range(8, 257, 8))
NO_RANGE = 1e18         # a roofline has no measured range: nothing counts as extrapolated
# Kernels of one layer outside the GEMMs and the elementwise passes whose minimum
# duration the floor counts: the attention kernel and the K/V cache write.
ATTN_KERNELS = 2
ELEM_KERNELS = 5        # two norms, rotary, SiLU-and-mul, residual add (Vidur's ops)
GEMM_KERNELS = 4        # QKV, O, gate-up, down: the GEMMs ``gemm_floor_us`` is the floor of
# Kernels a layer launches beyond a dense multi-head layer's (``extra_floor_us``), from
# vLLM's model code: a mixture's layer (``fused_moe``) adds the router GEMM and three
# small kernels (top-k softmax, ``moe_align_block_size``, ``moe_sum``); shared experts
# their own gate-up and down GEMMs, SiLU-and-mul and the add; MLA (DeepSeek) replaces
# the QKV GEMM by the q down/up and KV down projections and adds the two absorbed
# up-projection batched GEMMs of decode, and the q and KV latent norms.
MOE_EXTRA = (1, 3)      # (GEMMs, small kernels) per mixture layer
SHARED_EXTRA = (2, 2)   # ... per shared-expert block
MLA_EXTRA = (4, 2)      # ... per latent-attention layer
WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "int8", "int4")
KV_DTYPES = ("bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Engine:
    """Engine facts the physics needs beyond the hardware and the model (module doc)."""

    decode_attention: str = "paged"           # paged: cost follows the sum of the contexts
    cuda_graphs: bool = True                  # pure-decode steps replay CUDA graphs
    graph_buckets: tuple = VLLM_GRAPH_BUCKETS  # the batch sizes graphs were captured at
    bookkeeping_ms: float = 0.0               # host time between steps (not in profile rows)
    bookkeeping_seq_ms: float = 0.0
    custom_allreduce: bool = True             # small all-reduces run vLLM's own kernel
    # vLLM v1's FULL_AND_PIECEWISE: a step that is not a pure decode replays piecewise
    # graphs (``piecewise_host_ms``); False: such a step is launched eagerly.
    piecewise_graphs: bool = False


def compute_peak(spec: GpuSpec, weight_dtype: str) -> tuple[float, str]:
    """The dense peak (TFLOP/s) the linear layers run at for a weight format, and why:
    fp8 and int8 weights multiply on fp8/int8 tensor cores where the GPU has them
    (W8A8, as vLLM runs fp8 checkpoints); int4, and fp8 on a GPU without fp8, are
    weight-only: the GEMMs run in 16 bits on dequantised weights."""
    wf = catalog.weight_format(weight_dtype).name
    if wf == "fp8" and spec.fp8_tflops:
        return spec.fp8_tflops, "fp8 tensor cores (W8A8)"
    if wf == "int8" and spec.int8_tops:
        return spec.int8_tops, "int8 tensor cores (W8A8)"
    if wf in ("fp8", "int8", "int4"):
        return spec.bf16_tflops, f"16-bit tensor cores on dequantised {wf} weights (weight-only)"
    return spec.bf16_tflops, "16-bit tensor cores"


def token_ffn(arch: ModelArch) -> float:
    """The MLP width one token's activations pass through, per layer on average: the
    routed experts' (``experts_per_token x ffn``) in a mixture's sparse layers, the dense
    MLP's in its dense ones (what the elementwise SwiGLU passes scale with)."""
    if not arch.is_moe:
        return float(arch.ffn)
    return (arch.moe_layers * arch.experts_per_token * arch.ffn
            + arch.dense_layers * arch.dense_ffn) / arch.layers


def has_rotary(arch: ModelArch) -> bool:
    """Whether the model applies rotary embeddings to q and k (OPT and BLOOM do not)."""
    return arch.family not in ("opt", "bloom")


def extra_floor_us(arch: ModelArch, eff: dict) -> float:
    """The minimum device time (µs) an average layer of ``arch`` adds to a dense
    multi-head layer's kernel floor: each further kernel it launches (``MOE_EXTRA``,
    ``SHARED_EXTRA``, ``MLA_EXTRA``) at the floor of one of Vidur's GEMMs
    (``gemm_floor_us / GEMM_KERNELS``) or elementwise ops (``elem_floor_us /
    ELEM_KERNELS``), mixture terms over the mixture's layers only. 0 for a dense
    multi-head model (its floor is the one Vidur's tables give)."""
    gemm = eff["gemm_floor_us"] / GEMM_KERNELS
    elem = eff["elem_floor_us"] / ELEM_KERNELS
    out = 0.0
    if arch.is_moe:
        share = arch.moe_layers / arch.layers
        out += share * (MOE_EXTRA[0] * gemm + MOE_EXTRA[1] * elem)
        if arch.shared_ffn:
            out += share * (SHARED_EXTRA[0] * gemm + SHARED_EXTRA[1] * elem)
    if arch.is_mla:
        out += MLA_EXTRA[0] * gemm + MLA_EXTRA[1] * elem
    return out


def piecewise_host_ms(eff: dict, stage_layers: float) -> float:
    """Host time (ms) of a step replayed as piecewise CUDA graphs (vLLM v1's default
    ``FULL_AND_PIECEWISE`` for steps that are not a uniform decode batch: prefill and
    mixed steps): the per-step work of a graph replay (``h_graph_ms``) plus one more
    graph piece per layer, the attention call that runs eagerly between two pieces
    (``h_piece_us``, defaults' sources). vLLM captures pieces up to its largest capture
    size; a larger step runs the compiled model without graphs, priced the same here
    (an approximation: such a step's device time, hundreds of tokens through every
    weight, hides its launches either way)."""
    return eff["h_graph_ms"] + eff["h_piece_us"] * 1e-3 * stage_layers


def _model_terms(c: np.ndarray, arch: ModelArch, tp: int, weight_dtype: str,
                 kv_dtype: str, eff: dict) -> None:
    """``build_constants``' model part: the shape, formats, linear weights (a mixture's
    routed reads, what every GPU holds whole), MLA's attention widths and the
    elementwise passes."""
    L, d, hd = arch.layers, arch.hidden, arch.head_dim
    c[ph.C_LAYERS], c[ph.C_DMODEL], c[ph.C_HEADS] = L, d, arch.heads
    c[ph.C_KV_HEADS], c[ph.C_HEAD_DIM], c[ph.C_FFN], c[ph.C_VOCAB] = (
        arch.kv_heads, hd, token_ffn(arch), arch.vocab)
    c[ph.C_DTYPE_BYTES] = 2.0                       # activations in 16 bits
    c[ph.C_WEIGHT_BYTES] = catalog.weight_format(weight_dtype).bytes_per_weight
    c[ph.C_KV_BYTES] = catalog.dtype_bytes(kv_dtype)
    c[ph.C_PARAMS_LINEAR] = arch.linear_params_per_token()
    if arch.is_moe:
        # Every expert may be read; a step reads those its tokens are routed to
        # (``physics.routed_experts``: about top-k at batch 1, nearly all at a few dozen).
        c[ph.C_PARAMS_READ] = (L * arch.attn_linear_weights() + arch.mlp_linear_weights()
                               + arch.moe_layers * arch.router_weights())
        c[ph.C_EXPERTS], c[ph.C_TOPK] = arch.experts, arch.experts_per_token
        c[ph.C_EXPERT_PARAMS] = arch.moe_layers * arch.expert_linear_weights()
    # Past kv_heads GPUs, every GPU holds a whole KV head's projections, not 1/tp.
    kvh = catalog.kv_heads_per_gpu(arch, tp)
    c[ph.C_PARAMS_REPL] = L * 2 * d * hd * (kvh - arch.kv_heads / tp)
    if arch.is_mla:
        # MLA: the down-projections are whole on every GPU; the one cached latent too.
        c[ph.C_PARAMS_REPL] = L * arch.attn_replicated_weights() * (1.0 - 1.0 / tp)
        c[ph.C_KV_LATENT] = arch.kv_elems_per_layer()
        c[ph.C_ATTN_PAIR] = arch.attn_pair_dims()
        c[ph.C_DEC_PAIR] = arch.attn_pair_dims(decode=True)
    rope = eff["act_passes_rope"] * (arch.heads + arch.kv_heads) * hd / d if has_rotary(arch) else 0.0
    ffn_passes = eff["act_passes_ffn"] * (1.0 if arch.gated_mlp else 2.0 / 3.0)
    c[ph.C_ACT_D], c[ph.C_ACT_F], c[ph.C_E_ACT] = rope, ffn_passes, 1.0
    c[ph.C_ACT_D_REPL] = eff["act_passes_repl"]


def build_constants(arch: ModelArch, spec: GpuSpec, tp: int = 1, pp: int = 1,
                    weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                    engine: Optional[Engine] = None, eff: Optional[dict] = None) -> np.ndarray:
    """The physics constants of ``arch`` served on ``tp x pp`` GPUs of type ``spec``
    by ``engine`` (default: vLLM-like), with the efficiencies ``eff`` (default:
    ``DEFAULTS``). Checks that the split is possible (one-line errors)."""
    catalog.check_parallelism(arch, tp, pp)
    eff = DEFAULTS if eff is None else eff
    engine = engine or Engine()
    c = ph.new_constants()
    _model_terms(c, arch, tp, weight_dtype, kv_dtype, eff)
    L = arch.layers
    # -- hardware
    peak, _ = compute_peak(spec, weight_dtype)
    c[ph.C_PEAK_TFLOPS], c[ph.C_ATTN_TFLOPS] = peak, spec.bf16_tflops
    c[ph.C_HBM_GBS], c[ph.C_SMS] = spec.memory_bw_gbs, spec.sm_count
    # -- engine
    c[ph.C_PADDED] = 1.0 if engine.decode_attention == "padded" else 0.0
    c[ph.C_GRAPHS] = 1.0 if engine.cuda_graphs else 0.0
    if engine.cuda_graphs and engine.graph_buckets:
        b = sorted(int(x) for x in engine.graph_buckets)[:ph.MAX_BUCKETS]
        c[ph.C_N_BUCKETS] = len(b)
        c[ph.C_BUCKETS:ph.C_BUCKETS + len(b)] = b
    c[ph.C_BOOK_MS], c[ph.C_BOOK_SEQ_MS] = engine.bookkeeping_ms, engine.bookkeeping_seq_ms
    # -- host: each stage's worker launches its own layers (in parallel with the others)
    stage_layers = L / pp
    c[ph.C_H_STEP] = eff["h_layer_ms"] * stage_layers
    c[ph.C_H_DECODE] = eff["h_decode_layer_ms"] * stage_layers
    if engine.cuda_graphs and engine.piecewise_graphs:
        c[ph.C_H_STEP], c[ph.C_H_DECODE] = piecewise_host_ms(eff, stage_layers), 0.0
    c[ph.C_H_CHUNK] = 0.0      # vLLM packs every prefill chunk into one attention call
    c[ph.C_H_PREFIX] = 0.0
    c[ph.C_H_GRAPH] = eff["h_graph_ms"] if engine.cuda_graphs else 0.0
    c[ph.C_DEV_PER_HOST] = 0.0
    c[ph.C_DEV_LAYER_US] = (eff["gemm_floor_us"] + eff["elem_floor_us"]
                            + ATTN_KERNELS * eff["elem_floor_us"] / ELEM_KERNELS)
    extra = extra_floor_us(arch, eff)
    if extra > 0.0:
        c[ph.C_DEV_LAYER_US] += extra
    c[ph.C_DEV_STEP_MS] = 0.0
    # -- efficiencies
    c[ph.C_E_GEMM], c[ph.C_GEMM_HALF] = eff["e_gemm"], eff.get("gemm_half_gflop", 0.0)
    c[ph.C_E_WEIGHTS], c[ph.C_P_GEMM] = weight_read_efficiency(spec, eff), eff["p_gemm"]
    c[ph.C_GEMM_TILE_SMALL], c[ph.C_GEMM_TILE] = eff["gemm_tile_small"], eff["gemm_tile"]
    c[ph.C_E_FLASH] = c[ph.C_E_MASKED] = flash_efficiency(spec, eff)
    c[ph.C_CTA_PREFIX] = c[ph.C_CTA_DECODE] = NO_BOUND_GBS
    c[ph.C_E_DECODE] = c[ph.C_E_DECODE_EAGER] = eff["e_decode"]
    c[ph.C_P_STEP], c[ph.C_P_ATTN] = eff["p_step"], eff["p_attn"]
    c[ph.C_DEC_BLOCKS_PER_SM], c[ph.C_WAVE_COST] = 0.0, 1.0
    # -- parallelism
    c[ph.C_TP], c[ph.C_PP] = float(tp), float(pp)
    c[ph.C_AR_PER_LAYER] = 2.0
    lat, e_link = link_terms(spec, eff)
    c[ph.C_AR_LAT_US] = c[ph.C_P2P_LAT_US] = lat
    c[ph.C_AR_GBS] = c[ph.C_P2P_GBS] = spec.link_gbs_unidir * e_link
    if engine.custom_allreduce:
        c[ph.C_CA_LAT_US], c[ph.C_CA_GBS], c[ph.C_CA_MAX_BYTES] = custom_allreduce_terms(spec, eff)
    for idx in (ph.C_RANGE_TOKENS, ph.C_RANGE_CHUNK, ph.C_RANGE_CONTEXT, ph.C_RANGE_BATCH,
                ph.C_RANGE_DECODE_CTX):
        c[idx] = NO_RANGE
    return c
