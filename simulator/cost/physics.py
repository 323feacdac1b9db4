"""A physics-informed step-cost model: what one engine iteration costs, from the step's
shape in physical units (FLOPs, bytes, kernel launches) divided by rates.

A step is issued by the host (kernel launches, step building) while the device runs
the kernels; the host runs ahead and the step ends at the final synchronisation, so a
step costs about the larger of the two. Where they are close, both stall each other a
little: the two are combined with a p-norm, ``(host^p + device^p)^(1/p)``, which is
the larger one when they differ and up to ``2^(1/p)`` times it when they are equal.

Host (ms, fitted): an eager step pays ``h_step``, plus ``h_decode`` when it holds
decodes (the batched decode-attention launches), plus ``h_chunk`` per prefill chunk
(each chunk has its own attention launches) and ``h_prefix`` more per chunk with a
cached prefix (gathering the prefix and building its mask). An engine that replays
CUDA graphs for pure-decode steps pays ``h_graph`` for such a step instead (one
replay; graph steps run at the batch rounded up to a captured bucket).

Device (ms), per step of ``T`` packed tokens and ``S`` sampled rows (one per decode
and per chunk that completes its prompt):

- linear layers: ``2 * P_lin * T + 2 * V * d * S`` FLOPs at ``peak * e_gemm``, or
  the weights read once per step (``P_lin``, plus the LM head when a row samples) at
  ``HBM * e_weights``, whichever binds (p-norm ``p_gemm``); with ``gemm_tile`` set,
  the FLOPs are those of the rows the GEMM kernels compute, the ``T`` tokens (``S``
  rows of the LM head) rounded up to whole output tiles of ``gemm_tile_small`` rows
  up to that many tokens, of ``gemm_tile`` rows beyond (``gemm_rows``: tile
  quantisation, the steps a skinny GEMM's time takes at 64 and 128 tokens);
- elementwise traffic (norms, rotary, residuals, SwiGLU) and K/V writes:
  ``T * L * (a_d * d + a_f * ffn + 2 * Hkv * hd) * bytes`` at ``HBM * e_act`` (a stated
  pass count and efficiency, not fitted: on one GPU it cannot be told apart from the
  GEMMs' per-token time);
- decode attention: the K/V bytes the batch reads, ``keys * L * 2 * Hkv * hd * bytes``
  at ``HBM * e_decode`` (throughput), ``keys = batch * longest context`` for an engine
  that pads decode attention to the longest context, the sum of the contexts for a
  paged one; or one thread block streaming one head's keys of the longest context,
  ``ctx * L * 2 * hd * bytes`` at ``cta_decode`` GB/s (latency) -- p-norm ``p_attn``
  of the two. One block runs per (sequence, query head) and at most ``SMs *
  blocks_per_SM`` at once: a batch past that runs in waves, and every further wave
  pays ``wave_cost`` of the latency bound again (the cliff a batch one past a full
  wave shows); ``blocks_per_SM = 0`` means no wave limit;
- multi-head latent attention (DeepSeek MLA, ``kv_latent > 0``): a token caches one
  latent of ``kv_latent`` elements a layer, whole on every GPU, in place of ``2 * Hkv
  * hd``; prefill attention multiplies each pair through ``attn_pair`` widths per query
  head (up-projected keys and values) in place of ``2 * hd``; decode attention reads
  the latent and multiplies it through ``dec_pair`` widths per query head (the
  up-projections absorbed), so its throughput bound is the larger of the bytes at
  ``HBM * e_decode`` and those FLOPs at flash attention's rate;
- prefill attention, per chunk of ``n`` tokens after ``prior`` cached ones: without a
  prefix, causal flash attention, ``4 * L * Hq * hd * n (n + 1) / 2`` FLOPs at
  ``peak * e_flash``; with one, a masked kernel over the whole ``n x (prior + n)``
  rectangle, ``4 * L * Hq * hd * n * (prior + n)`` FLOPs at ``peak * e_masked``, or one
  block streaming ``prior + n`` keys at ``cta_prefix`` GB/s, p-norm ``p_attn``;
- kernel floors: every launched kernel holds the device for a minimum time too, a
  share ``dev_per_host`` of the host time launching it costs (a graph replay saves
  the host launches, not the kernels' minimum durations).

After the step, the host schedules the next one and applies this one's results:
``bookkeeping_ms + bookkeeping_seq_ms * (decodes + chunks)``, added to every step
(``step_ms``; ``step_core_ms`` is the step alone, as a profile row times it).

Everything is FLOPs, bytes and launches over rates: a datasheet's peak TFLOP/s and
HBM GB/s with efficiencies supply another GPU's coefficients (``simulator.cost.roofline``
builds such a vector from the catalogues). The model dimensions come from the
profile's ``meta.model``.

Terms a fitted profile leaves at their neutral values (so a fitted model is unchanged
by them), used by the roofline model of a replica on ``tp x pp`` GPUs:

- tensor parallelism over ``tp`` GPUs (Megatron style): each GPU multiplies its
  ``1/tp`` share of every linear layer and of the LM head (plus ``params_repl``
  weights it holds whole: KV-head projections replicated when ``tp`` exceeds the KV
  heads), runs ``heads/tp`` query heads and ``max(1, kv_heads/tp)`` KV heads of
  attention, and of the elementwise passes splits those over heads and the FFN width
  but not the ``act_passes_repl`` ones over ``d_model`` (norms, residual adds);
- two all-reduces per layer (``ar_per_layer``) of the step's activations, ``T x d x
  bytes``, each ``ar_lat_us + 2 (tp - 1) / tp x bytes / ar_gbs`` (a ring: every GPU
  sends and receives ``2 (tp - 1) / tp`` of the message), added to the device time; a
  message up to ``ca_max_bytes`` takes the engine's own small-message all-reduce
  instead (vLLM's custom all-reduce), ``ca_lat_us + 2 (tp - 1) / tp x bytes / ca_gbs``;
- pipeline parallelism over ``pp`` stages with **no micro-batching** (vLLM's default
  for one engine: one batch in flight): a step runs the stages one after the other,
  each holding ``layers / pp`` layers, so the device work is the whole model's
  (stage time = that / ``pp``) plus ``pp - 1`` sends of the activations
  (``p2p_lat_us + T x d x bytes / p2p_gbs``) between stages. Each GPU idles
  ``(pp - 1) / pp`` of the step (the bubble): PP adds latency, not throughput, and
  buys memory (weights and KV split over the stages);
- a GEMM efficiency curve: ``e_gemm x W / (W + gemm_half_gflop)`` with ``W`` the
  GFLOP of one layer's linear maps on one GPU (small GEMMs cannot fill the GPU);
  0 keeps ``e_gemm`` flat;
- kernel floors per layer and per step in absolute units (``dev_layer_us`` per
  layer, ``dev_step_ms`` per step: input preparation, sampling, the last sync),
  added to the device side like ``dev_per_host``'s share;
- ``params_read``: the linear weights a step may read when they differ from the ones a
  token multiplies through (a mixture of experts: every expert); of a mixture's
  ``experts`` (``expert_params`` weights each), a step of ``T`` tokens routed to
  ``experts_per_token`` each reads only the experts some token chose: ``E (1 - (1 -
  k/E)^T)`` of them on average (routing spread evenly; ``routed_experts``), about
  ``k`` at batch 1 and nearly all of them at a few dozen tokens;
- separate storage widths for weights (``weight_bytes``: fp8, int8, int4) and the KV
  cache (``kv_bytes``), and a separate peak for attention (``attn_tflops``: fp8
  GEMMs run on fp8 tensor cores, attention in 16 bits); 0 means ``dtype_bytes`` /
  ``peak_tflops``.

Every number lives in one float64 vector ``c`` (indices ``C_*`` below) so the
evaluation is a pure ``@kernel`` the compiled event loop calls as well as Python.
The layout of ``c`` and the kernels that read it stay in this one module (longer than
most): an index defined in one file and read in another is how the two drift apart.
"""
from __future__ import annotations

import numpy as np

from simulator.cost.chunks import ChunkArrays
from simulator.cost.decodectx import decode_context, epoch_context
from simulator.kernel import kernel

# -- model shape ---------------------------------------------------------------------
C_LAYERS = 0
C_DMODEL = 1
C_HEADS = 2
C_KV_HEADS = 3
C_HEAD_DIM = 4
C_FFN = 5
C_VOCAB = 6
C_DTYPE_BYTES = 7
C_PARAMS_LINEAR = 8      # weights of the layers' linear maps (no embedding, no LM head)
C_ACT_D = 9              # elementwise passes per token per layer, in units of d_model
C_ACT_F = 10             # ... in units of the FFN width
# -- engine facts ---------------------------------------------------------------------
C_PADDED = 11            # 1: decode attention padded to the longest context
C_GRAPHS = 12            # 1: pure-decode steps replay CUDA graphs
# -- hardware ---------------------------------------------------------------------------
C_PEAK_TFLOPS = 13       # dense bf16 matmul peak (or measured) TFLOP/s
C_HBM_GBS = 14           # memory bandwidth GB/s
# -- fitted: host (ms) -----------------------------------------------------------------
C_H_STEP = 15
C_H_DECODE = 16
C_H_CHUNK = 17
C_H_PREFIX = 18
C_H_GRAPH = 19
# -- fitted: device efficiencies (fractions of peak) and one-block rates (GB/s) ------
C_E_WEIGHTS = 20
C_E_GEMM = 21
C_E_ACT = 22
C_E_FLASH = 23
C_E_MASKED = 24
C_CTA_PREFIX = 25
C_E_DECODE = 26
C_CTA_DECODE = 27
C_E_DECODE_EAGER = 28    # decode attention inside an eager step of a graphed engine
# -- fitted: transition sharpness -------------------------------------------------------
C_P_STEP = 29
C_P_ATTN = 30
C_P_GEMM = 31
# -- per-step host work outside the timed step, and a what-if scale -------------------
C_BOOK_MS = 32
C_BOOK_SEQ_MS = 33
C_SCALE = 34
# -- the range the fit saw (for counting extrapolations) --------------------------------
C_RANGE_TOKENS = 35
C_RANGE_CHUNK = 36
C_RANGE_CONTEXT = 37     # prior + chunk of a prefill chunk
C_RANGE_BATCH = 38
C_RANGE_DECODE_CTX = 39
# -- waves of decode-attention blocks, kernel floors --------------------------------------
C_SMS = 40               # streaming multiprocessors
C_DEC_BLOCKS_PER_SM = 41  # decode-attention blocks resident per SM (0: no wave limit)
C_WAVE_COST = 42         # share of the latency bound each further wave pays again
C_DEV_PER_HOST = 43      # kernels' minimum device time / the host time launching them
# -- CUDA-graph batch buckets (count, then the sizes) ------------------------------------
C_N_BUCKETS = 44
C_BUCKETS = 45
MAX_BUCKETS = 40
# -- parallelism, curves, floors and storage widths (module doc; neutral: 1 or 0) --------
C_TP = C_BUCKETS + MAX_BUCKETS   # tensor-parallel GPUs
C_PP = C_TP + 1                  # pipeline stages (no micro-batching)
C_AR_LAT_US = C_TP + 2           # one all-reduce's latency, µs
C_AR_GBS = C_TP + 3              # all-reduce bandwidth per GPU and direction, GB/s
C_AR_PER_LAYER = C_TP + 4        # all-reduces per layer (Megatron TP: 2)
C_P2P_LAT_US = C_TP + 5          # one pipeline send's latency, µs
C_P2P_GBS = C_TP + 6             # pipeline send bandwidth, GB/s
C_PARAMS_REPL = C_TP + 7         # linear weights every TP GPU holds whole
C_GEMM_HALF = C_TP + 8           # per-layer GFLOP (one GPU) at half the GEMM efficiency
C_ACT_D_REPL = C_TP + 9          # elementwise passes over d_model that TP does not split
C_DEV_LAYER_US = C_TP + 10       # device floor per layer (kernel latencies), µs
C_DEV_STEP_MS = C_TP + 11        # device floor per step, ms
C_WEIGHT_BYTES = C_TP + 12       # bytes per linear weight (0: dtype_bytes)
C_KV_BYTES = C_TP + 13           # bytes per K or V element (0: dtype_bytes)
C_ATTN_TFLOPS = C_TP + 14        # attention peak TFLOP/s (0: peak_tflops)
C_PARAMS_READ = C_TP + 15        # linear weights a step may read (MoE: every expert; 0: params_linear)
C_EXPERTS = C_TP + 16            # MoE: experts per layer (0 or 1: dense)
C_TOPK = C_TP + 17               # MoE: experts each token is routed to
C_EXPERT_PARAMS = C_TP + 18      # MoE: linear weights of one expert, all layers
C_CA_LAT_US = C_TP + 19          # small-message (custom, in-graph) all-reduce latency, µs
C_CA_GBS = C_TP + 20             # ... its bandwidth per GPU and direction, GB/s
C_CA_MAX_BYTES = C_TP + 21       # ... up to this message size (0: every all-reduce is NCCL's)
C_GEMM_TILE_SMALL = C_TP + 22    # GEMM output-tile rows up to this many tokens (``gemm_rows``)
C_GEMM_TILE = C_TP + 23          # ... beyond them (0: FLOPs of the tokens themselves)
# Multi-head latent attention (DeepSeek MLA; ``catalog.ModelArch``), 0 for multi-head:
C_KV_LATENT = C_TP + 24          # elements a token caches per layer, whole on every GPU
C_ATTN_PAIR = C_TP + 25          # per query head, widths a prefill (query, key) pair multiplies
C_DEC_PAIR = C_TP + 26           # ... a decode pair (the latent, up-projections absorbed)
N_CONST = C_TP + 27
# -- optional, after the constants: a decode table (``with_decode_table``) ---------------
# Row ``nd`` holds ``step_terms`` of a decode-only step of ``nd`` sequences (7 numbers)
# and the decode-attention unit of an eager step of that batch: an event loop's decode
# steps then cost a lookup and one p-norm, with the same bits as computing them.
DT_COLS = 8
DECODE_TABLE_BATCH = 1024        # the largest batch with a row (larger ones are computed)

NAMES = {
    C_LAYERS: "layers", C_DMODEL: "d_model", C_HEADS: "heads", C_KV_HEADS: "kv_heads",
    C_HEAD_DIM: "head_dim", C_FFN: "ffn", C_VOCAB: "vocab", C_DTYPE_BYTES: "dtype_bytes",
    C_PARAMS_LINEAR: "params_linear", C_ACT_D: "act_passes_d", C_ACT_F: "act_passes_ffn",
    C_PADDED: "padded", C_GRAPHS: "cuda_graphs", C_PEAK_TFLOPS: "peak_tflops",
    C_HBM_GBS: "hbm_gbs", C_H_STEP: "h_step_ms", C_H_DECODE: "h_decode_ms",
    C_H_CHUNK: "h_chunk_ms", C_H_PREFIX: "h_prefix_ms", C_H_GRAPH: "h_graph_ms",
    C_E_WEIGHTS: "e_weights", C_E_GEMM: "e_gemm", C_E_ACT: "e_act", C_E_FLASH: "e_flash",
    C_E_MASKED: "e_masked", C_CTA_PREFIX: "cta_prefix_gbs", C_E_DECODE: "e_decode",
    C_CTA_DECODE: "cta_decode_gbs", C_E_DECODE_EAGER: "e_decode_eager",
    C_P_STEP: "p_step", C_P_ATTN: "p_attn", C_P_GEMM: "p_gemm", C_BOOK_MS: "bookkeeping_ms",
    C_BOOK_SEQ_MS: "bookkeeping_seq_ms", C_SCALE: "scale", C_RANGE_TOKENS: "range_tokens",
    C_RANGE_CHUNK: "range_chunk", C_RANGE_CONTEXT: "range_context",
    C_RANGE_BATCH: "range_batch", C_RANGE_DECODE_CTX: "range_decode_ctx",
    C_SMS: "sms", C_DEC_BLOCKS_PER_SM: "decode_blocks_per_sm", C_WAVE_COST: "wave_cost",
    C_DEV_PER_HOST: "dev_per_host", C_TP: "tp", C_PP: "pp", C_AR_LAT_US: "ar_lat_us",
    C_AR_GBS: "ar_gbs", C_AR_PER_LAYER: "ar_per_layer", C_P2P_LAT_US: "p2p_lat_us",
    C_P2P_GBS: "p2p_gbs", C_PARAMS_REPL: "params_repl", C_GEMM_HALF: "gemm_half_gflop",
    C_ACT_D_REPL: "act_passes_repl", C_DEV_LAYER_US: "dev_layer_us",
    C_DEV_STEP_MS: "dev_step_ms", C_WEIGHT_BYTES: "weight_bytes", C_KV_BYTES: "kv_bytes",
    C_ATTN_TFLOPS: "attn_tflops", C_PARAMS_READ: "params_read", C_EXPERTS: "experts",
    C_TOPK: "experts_per_token", C_EXPERT_PARAMS: "expert_params",
    C_CA_LAT_US: "ca_lat_us", C_CA_GBS: "ca_gbs", C_CA_MAX_BYTES: "ca_max_bytes",
    C_GEMM_TILE_SMALL: "gemm_tile_small", C_GEMM_TILE: "gemm_tile",
    C_KV_LATENT: "kv_latent", C_ATTN_PAIR: "attn_pair", C_DEC_PAIR: "dec_pair",
}
INDEX = {v: k for k, v in NAMES.items()}


@kernel
def pnorm(a, b, p):
    """``(a^p + b^p)^(1/p)`` for non-negative ``a``, ``b``: the larger one, softened
    where they are close (at most ``2^(1/p)`` times it)."""
    if a > b:
        m, s = a, b
    else:
        m, s = b, a
    if m <= 0.0:
        return 0.0
    # ``m (1 + r^p)^(1/p)`` with ``r = s / m``: where ``r^p`` is below half an ulp of 1
    # the root is exactly 1, so the smaller term is skipped (most steps: ``p_step`` is
    # large) without changing a bit of the result.
    t = (s / m) ** p
    if t < 1.1e-16:
        return m
    return m * (1.0 + t) ** (1.0 / p)


@kernel
def tp_of(c):
    """Tensor-parallel GPUs of the replica (1 when the vector leaves it unset)."""
    return c[C_TP] if c[C_TP] > 1.0 else 1.0


@kernel
def kv_heads_per_gpu(c):
    """KV heads one GPU holds: ``kv_heads / tp``, at least one (replicated beyond)."""
    k = c[C_KV_HEADS] / tp_of(c)
    return k if k >= 1.0 else 1.0


@kernel(inline=True)
def cached_elems(c):
    """Elements one GPU caches per token and layer: its KV heads' K and V, or MLA's
    latent (``kv_latent``), which every GPU holds whole."""
    if c[C_KV_LATENT] > 0.0:
        return c[C_KV_LATENT]
    return 2.0 * kv_heads_per_gpu(c) * c[C_HEAD_DIM]


@kernel
def kv_elem_bytes(c):
    """Bytes of one cached K or V element (``kv_bytes``, else ``dtype_bytes``)."""
    return c[C_KV_BYTES] if c[C_KV_BYTES] > 0.0 else c[C_DTYPE_BYTES]


@kernel
def attn_peak(c):
    """Peak TFLOP/s attention runs at (``attn_tflops``, else ``peak_tflops``)."""
    return c[C_ATTN_TFLOPS] if c[C_ATTN_TFLOPS] > 0.0 else c[C_PEAK_TFLOPS]


@kernel
def graph_batch(c, nd):
    """The batch a graph-replayed decode step of ``nd`` sequences runs at (the smallest
    bucket holding it), or -1 when it is beyond every bucket (the step runs eagerly).
    Without a bucket list every batch has its own graph."""
    nb = int(c[C_N_BUCKETS])
    if nb <= 0:
        return nd
    for i in range(nb):
        b = int(c[C_BUCKETS + i])
        if b >= nd:
            return b
    return -1


@kernel
def host_ms(c, nd, chp, nch):
    """Host time (ms) of an eager step: per step, per decode batch, per chunk and per
    chunk with a cached prefix."""
    h = c[C_H_STEP]
    if nd > 0:
        h += c[C_H_DECODE]
    for i in range(nch):
        h += c[C_H_CHUNK]
        if chp[i] > 0:
            h += c[C_H_PREFIX]
    return h


@kernel
def chunk_attention_ms(c, n, prior):
    """Device time (ms) of one prefill chunk's attention (module doc)."""
    L = c[C_LAYERS]
    hq = c[C_HEADS] / tp_of(c)
    hd = c[C_HEAD_DIM]
    flops_per_pair = 4.0 * L * hq * hd
    stream = 2.0 * hd          # one head's K and V elements of a key a block streams
    if c[C_KV_LATENT] > 0.0:
        # MLA's prefill runs on up-projected keys and values; a prefix's keys are read
        # as the latent every head shares.
        flops_per_pair = 2.0 * L * hq * c[C_ATTN_PAIR]
        stream = c[C_KV_LATENT]
    nf = float(n)
    # The causal pairs (a query and a key it may see) at flash attention's rate.
    causal = nf * (float(prior) + (nf + 1.0) * 0.5)
    flash = flops_per_pair * causal / (attn_peak(c) * c[C_E_FLASH]) * 1e-9
    if prior <= 0:
        return flash
    keys = float(prior) + nf
    thr = flops_per_pair * nf * keys / (attn_peak(c) * c[C_E_MASKED]) * 1e-9
    lat = keys * L * stream * kv_elem_bytes(c) / c[C_CTA_PREFIX] * 1e-6
    # The masked kernel never beats flash attention on the same pairs: a prefix only
    # ever adds work (and keeps cost monotone in the prefix whatever the fit).
    t = pnorm(lat, thr, c[C_P_ATTN])
    return t if t > flash else flash


@kernel
def decode_attention_unit(c, nd, eager_in_graph_engine):
    """Device time (ms) of the batched decode attention per unit of its context
    measure (``decode_x``): the longest context for an engine that pads decode
    attention, the sum of the contexts for a paged one. Both bounds (module doc) grow
    in proportion to that measure for a given batch, and so does their p-norm: a run of
    decode steps of one batch computes this once (``decode_run_ms``). One block per
    (sequence, query head) streams its keys; at most ``SMs * blocks_per_SM`` blocks run
    at once, so past that the batch runs in waves and each further wave pays
    ``wave_cost`` of the latency bound again (a cliff when a batch spills into one more
    wave)."""
    if nd <= 0:
        return 0.0
    L = c[C_LAYERS]
    e = c[C_E_DECODE_EAGER] if eager_in_graph_engine else c[C_E_DECODE]
    kvb = cached_elems(c) * kv_elem_bytes(c)
    # Throughput: the K/V bytes of every key read, at HBM * e.
    thr = L * kvb / (c[C_HBM_GBS] * e) * 1e-6
    stream = 2.0 * c[C_HEAD_DIM]
    if c[C_KV_LATENT] > 0.0:
        # MLA: every head reads the one latent, and multiplies it through the absorbed
        # up-projections (``dec_pair`` widths a key): the FLOPs can bind as well.
        stream = c[C_KV_LATENT]
        flops = 2.0 * L * c[C_HEADS] / tp_of(c) * c[C_DEC_PAIR]
        t_c = flops / (attn_peak(c) * c[C_E_FLASH]) * 1e-9
        thr = thr if thr > t_c else t_c
    # Latency: one block streams one head's keys of the longest context.
    lat = L * stream * kv_elem_bytes(c) / c[C_CTA_DECODE] * 1e-6
    if c[C_PADDED] > 0.0:
        # keys = batch x longest context: per unit of the longest context.
        thr *= float(nd)
    else:
        # A paged engine reads each sequence's own pages, and splits the work by page:
        # the mean context (sum / batch) stands in for the longest one.
        lat /= float(nd)
    slots = c[C_SMS] * c[C_DEC_BLOCKS_PER_SM]
    if slots > 0.0:
        # Each further wave of blocks streams the longest context again; the part of
        # that latency a wave does not hide behind the previous one is ``wave_cost``.
        waves = np.ceil(float(nd) * c[C_HEADS] / tp_of(c) / slots)
        lat *= 1.0 + c[C_WAVE_COST] * (waves - 1.0)
    return pnorm(lat, thr, c[C_P_ATTN])


@kernel(inline=True)
def decode_x(c, ctx_max, ctx_sum):
    """The context measure decode attention grows with: the longest context (padded)
    or the contexts' sum (paged)."""
    return float(ctx_max) if c[C_PADDED] > 0.0 else float(ctx_sum)


@kernel
def decode_attention_ms(c, nd, ctx_max, ctx_sum, eager_in_graph_engine):
    """Device time (ms) of the batched decode attention of ``nd`` sequences (longest
    context ``ctx_max``, contexts summing to ``ctx_sum``): ``decode_attention_unit``
    times the measure it grows with."""
    if nd <= 0:
        return 0.0
    return decode_x(c, ctx_max, ctx_sum) * decode_attention_unit(c, nd, eager_in_graph_engine)


@kernel(inline=True)
def routed_experts(experts, k, T):
    """Expected number of distinct experts (of ``experts``, a layer's) that ``T``
    tokens routed to ``k`` experts each choose, routing spread evenly: an expert no
    token chose is ``experts x (1 - k / experts)^T`` of them on average."""
    if experts <= 1.0:
        return experts
    return experts * (1.0 - (1.0 - k / experts) ** T)


@kernel
def gemm_rows(c, M):
    """The rows a GEMM kernel computes for ``M`` tokens: ``M`` rounded up to whole
    output tiles, of ``gemm_tile_small`` rows while ``M`` fits in one of them, of
    ``gemm_tile`` rows beyond (a library's tile for skinny GEMMs grows with ``M``);
    ``M`` itself when ``gemm_tile`` is 0. Every tile computes its whole rows: a padded
    row costs the FLOPs of a real one, while the weights are still read once (the
    output tiles along the weights' columns fill the SMs; a partial last wave is
    split over K, so the SM count does not quantise the time: the Vidur tables show
    no such steps, ``roofline.defaults``)."""
    tile = c[C_GEMM_TILE]
    if tile <= 0.0 or M <= 0.0:
        return M
    small = c[C_GEMM_TILE_SMALL]
    if 0.0 < small and M <= small:
        tile = small
    return np.ceil(M / tile) * tile


@kernel
def linear_times(c, T, S):
    """``(weights ms, compute ms)`` of the linear layers and the LM head on one GPU for
    ``T`` packed tokens and ``S`` sampled rows: the weights (its TP share, the LM head
    when a row samples) read once at ``HBM * e_weights``, and the FLOPs at ``peak *
    e_gemm`` (times the GEMM efficiency curve when ``gemm_half_gflop`` is set), of the
    rows the kernels compute (``gemm_rows``)."""
    tp = tp_of(c)
    db = c[C_DTYPE_BYTES]
    wb = c[C_WEIGHT_BYTES] if c[C_WEIGHT_BYTES] > 0.0 else db
    P = c[C_PARAMS_LINEAR] / tp + c[C_PARAMS_REPL]
    read = P
    if c[C_PARAMS_READ] > 0.0:
        every = c[C_PARAMS_READ]
        if c[C_EXPERTS] > 1.0:
            # The experts no token of the step was routed to stay unread.
            every -= (c[C_EXPERTS] - routed_experts(c[C_EXPERTS], c[C_TOPK], T)) \
                * c[C_EXPERT_PARAMS]
        read = every / tp + c[C_PARAMS_REPL]
    lm = c[C_VOCAB] * c[C_DMODEL] / tp
    w_bytes = read * wb
    if S > 0.0:
        w_bytes += lm * db
    flops = 2.0 * P * gemm_rows(c, T) + 2.0 * lm * gemm_rows(c, S)
    e = c[C_E_GEMM]
    if c[C_GEMM_HALF] > 0.0:
        # Small GEMMs leave SMs idle: the efficiency climbs with one layer's work.
        w = 2.0 * P * T / c[C_LAYERS] * 1e-9
        if w > 0.0:
            e = e * w / (w + c[C_GEMM_HALF])
    t_w = w_bytes / (c[C_HBM_GBS] * c[C_E_WEIGHTS]) * 1e-6
    t_f = flops / (c[C_PEAK_TFLOPS] * e) * 1e-9
    return t_w, t_f


@kernel
def act_ms(c, T):
    """Device time (ms) of the elementwise passes and K/V writes of ``T`` tokens on one
    GPU (the TP-split passes and the ones every GPU repeats, module doc)."""
    tp = tp_of(c)
    d = c[C_DMODEL]
    kvr = kv_elem_bytes(c) / c[C_DTYPE_BYTES]
    act_bytes = T * c[C_LAYERS] * c[C_DTYPE_BYTES] * (
        c[C_ACT_D] * d / tp + c[C_ACT_F] * c[C_FFN] / tp
        + cached_elems(c) * kvr + c[C_ACT_D_REPL] * d)
    return act_bytes / (c[C_HBM_GBS] * c[C_E_ACT]) * 1e-6


@kernel
def comm_times(c, T):
    """``(all-reduce ms, pipeline-send ms)`` of a step of ``T`` packed tokens: TP's
    ``ar_per_layer`` ring all-reduces per layer of the ``T x d`` activations, and the
    ``pp - 1`` sends between pipeline stages (module doc). Zero on one GPU."""
    ar = 0.0
    p2p = 0.0
    msg = T * c[C_DMODEL] * c[C_DTYPE_BYTES]
    tp = tp_of(c)
    if tp > 1.0:
        # A ring all-reduce moves 2 (N - 1) / N of the message through every GPU's link.
        ring = 2.0 * (tp - 1.0) / tp
        if c[C_CA_MAX_BYTES] > 0.0 and msg <= c[C_CA_MAX_BYTES]:
            # A message up to the engine's custom all-reduce size: its own kernel (one or
            # two shots over peer memory, replayed in the step's graph), not NCCL's.
            lat, gbs = c[C_CA_LAT_US], c[C_CA_GBS]
        else:
            lat, gbs = c[C_AR_LAT_US], c[C_AR_GBS]
        ar = c[C_AR_PER_LAYER] * c[C_LAYERS] * (lat * 1e-3 + ring * msg / gbs * 1e-6)
    if c[C_PP] > 1.0:
        p2p = (c[C_PP] - 1.0) * (c[C_P2P_LAT_US] * 1e-3 + msg / c[C_P2P_GBS] * 1e-6)
    return ar, p2p


@kernel
def fixed_floor_ms(c):
    """The kernels' minimum device time in absolute units: ``dev_layer_us`` per layer
    (every stage's, run one after the other) plus ``dev_step_ms`` per step."""
    return c[C_DEV_STEP_MS] + c[C_DEV_LAYER_US] * c[C_LAYERS] * 1e-3


@kernel(inline=True)
def table_row(c, nd):
    """Where batch ``nd``'s row of the decode table starts in ``c``, or -1 (no table,
    or a batch beyond it)."""
    n = (c.shape[0] - N_CONST) // DT_COLS
    if nd < 0 or nd >= n:
        return -1
    return N_CONST + DT_COLS * nd


@kernel
def fill_decode_table(c, out):
    """``out[nd]``: ``step_terms`` of a decode-only step of ``nd`` sequences, and the
    decode-attention unit of an eager step of that batch (``c``: constants only)."""
    z = np.zeros(1, dtype=np.int64)
    f = np.zeros(1, dtype=np.bool_)
    graphs = c[C_GRAPHS] > 0.0
    for nd in range(out.shape[0]):
        host, floor, base, ar, p2p, unit, shift = step_terms(c, nd, 1, z, z, f, 0, False)
        out[nd, 0] = host
        out[nd, 1] = floor
        out[nd, 2] = base
        out[nd, 3] = ar
        out[nd, 4] = p2p
        out[nd, 5] = unit
        out[nd, 6] = shift
        out[nd, 7] = decode_attention_unit(c, nd, graphs)


def with_decode_table(c: np.ndarray, max_batch: int = DECODE_TABLE_BATCH) -> np.ndarray:
    """The constants ``c[:N_CONST]`` followed by a decode table for batches up to
    ``max_batch``: every kernel gives the same bits with or without it, faster with it.
    Build it from the final constants (a table does not follow later edits of them)."""
    base = np.ascontiguousarray(c[:N_CONST], dtype=np.float64)
    table = np.zeros((max_batch + 1, DT_COLS))
    fill_decode_table(base, table)
    return np.concatenate([base, table.ravel()])


@kernel
def device_ms(c, nd, ctx_max, ctx_sum, chn, chp, chf, nch, eager_in_graph_engine):
    """Device time (ms) of a step (module doc)."""
    return device_q_ms(c, nd, 1, ctx_max, ctx_sum, chn, chp, chf, nch, eager_in_graph_engine)


@kernel
def device_terms(c, nd, q, chn, chp, chf, nch, eager_in_graph_engine):
    """The device terms of a step whose ``nd`` decoding sequences each run ``q`` query
    tokens (``q = 1``: a decode; ``k + 1``: a speculative verify, every row sampled),
    apart from its decode contexts: ``(base, allreduce, pipeline send, unit)``, where
    ``base`` is the linear layers' soft maximum, the elementwise passes and the prefill
    chunks' attention, and ``unit`` the decode attention per unit of ``decode_x`` (the
    ``q`` queries of a sequence share its keys: they are read once)."""
    T = float(nd * q)
    S = float(nd * q)
    att = 0.0
    for i in range(nch):
        T += float(chn[i])
        if chf[i]:
            S += 1.0
        att += chunk_attention_ms(c, chn[i], chp[i])
    t_w, t_f = linear_times(c, T, S)
    base = pnorm(t_w, t_f, c[C_P_GEMM]) + act_ms(c, T) + att
    ar, p2p = comm_times(c, T)
    unit = 0.0
    if nd > 0:
        i = table_row(c, nd)
        if i >= 0 and eager_in_graph_engine == (c[C_GRAPHS] > 0.0):
            unit = c[i + 7]
        else:
            unit = decode_attention_unit(c, nd, eager_in_graph_engine)
    return base, ar, p2p, unit


@kernel(inline=True)
def device_sum(base, ar, p2p, unit, x):
    """A step's device time from ``device_terms`` and its decode-context measure
    (one order of additions, so a step costs the same bits however it is reached)."""
    return base + x * unit + ar + p2p


@kernel
def device_q_ms(c, nd, q, ctx_max, ctx_sum, chn, chp, chf, nch, eager_in_graph_engine):
    """Device time (ms) of a step of ``nd`` sequences running ``q`` query tokens each
    (``device_terms``; the caller passes the contexts the last query sees)."""
    base, ar, p2p, unit = device_terms(c, nd, q, chn, chp, chf, nch, eager_in_graph_engine)
    return device_sum(base, ar, p2p, unit, decode_x(c, ctx_max, ctx_sum))


@kernel
def step_terms(c, nd, q, chn, chp, chf, nch, force_eager):
    """What a step costs apart from its decode contexts: ``(host, floor, base,
    allreduce, pipeline send, unit, shift)`` -- the host time the device may hide (a
    graph replay's, if one runs the step), the kernels' floor, ``device_terms``, and
    ``shift``, the keys a graph's padded rows add to the contexts' sum. A run of decode
    steps of one batch shares them (``decode_run_ms``); ``terms_core_ms`` finishes a
    step from them."""
    graphs = c[C_GRAPHS] > 0.0
    host = host_ms(c, nd, chp, nch)
    # Every launched kernel holds the device for a minimum time too (launch latency,
    # ramp-up and tail), a fixed share of what launching it costs the host; a graph
    # replay saves the host's launches, not the kernels' minimum durations.
    floor = c[C_DEV_PER_HOST] * host + fixed_floor_ms(c)
    if graphs and nch == 0 and nd > 0 and not force_eager:
        gb = graph_batch(c, nd * q)
        if gb > 0:
            # A graph replays the bucket holding the ``nd * q`` tokens, padded by whole
            # sequences; padded rows attend to one key each: they cost tokens, not context.
            ns = (gb + q - 1) // q
            base, ar, p2p, unit = device_terms(c, ns, q, chn, chp, chf, 0, False)
            return c[C_H_GRAPH], floor, base, ar, p2p, unit, float(ns - nd)
    base, ar, p2p, unit = device_terms(c, nd, q, chn, chp, chf, nch, graphs)
    return host, floor, base, ar, p2p, unit, 0.0


@kernel(inline=True)
def terms_core_ms(c, host, floor, base, ar, p2p, unit, shift, ctx_max, ctx_sum):
    """``step_core_ms`` from ``step_terms`` and the step's decode contexts."""
    dev = device_sum(base, ar, p2p, unit, decode_x(c, ctx_max, ctx_sum + shift))
    return pnorm(host, dev + floor, c[C_P_STEP])


@kernel(inline=True)
def book_ms(per_step, per_seq, n_seqs):
    """The host's bookkeeping between two steps (ms): ``per_step`` plus ``per_seq`` for
    each sequence the step held (its decodes and prefill chunks)."""
    return per_step + per_seq * float(n_seqs)


@kernel(inline=True)
def bookkeeping_ms(c, n_seqs):
    """``book_ms`` with the constants' engine facts (before the what-if scale)."""
    return book_ms(c[C_BOOK_MS], c[C_BOOK_SEQ_MS], n_seqs)


@kernel(inline=True)
def finish_ms(c, core, n_seqs):
    """A step's milliseconds from its core: the per-step host bookkeeping outside the
    forward added, times the what-if scale."""
    return (core + bookkeeping_ms(c, n_seqs)) * c[C_SCALE]


@kernel
def step_core_ms(c, nd, ctx_max, ctx_sum, chn, chp, chf, nch, force_eager):
    """Milliseconds of one step, before bookkeeping and scale; ``force_eager`` times a
    pure-decode step of a graphed engine eagerly (a ``decode_eager`` profile row)."""
    return step_core_q_ms(c, nd, 1, ctx_max, ctx_sum, chn, chp, chf, nch, force_eager)


@kernel
def step_core_q_ms(c, nd, q, ctx_max, ctx_sum, chn, chp, chf, nch, force_eager):
    """``step_core_ms`` with ``q`` query tokens per decoding sequence (``step_terms``)."""
    if nch == 0 and q == 1 and not force_eager:
        i = table_row(c, nd)
        if i >= 0:
            return terms_core_ms(c, c[i], c[i + 1], c[i + 2], c[i + 3], c[i + 4], c[i + 5],
                                 c[i + 6], ctx_max, ctx_sum)
    host, floor, base, ar, p2p, unit, shift = step_terms(c, nd, q, chn, chp, chf, nch,
                                                         force_eager)
    return terms_core_ms(c, host, floor, base, ar, p2p, unit, shift, ctx_max, ctx_sum)


@kernel
def step_ms(c, nd, ctx_max, ctx_sum, chn, chp, chf, nch):
    """Milliseconds of one engine step of ``nd`` decodes (longest context ``ctx_max``,
    contexts summing to ``ctx_sum``) and prefill chunks ``chn[:nch]`` tokens after
    ``chp[:nch]`` cached ones, ``chf[:nch]`` completing their prompts; the per-step
    host bookkeeping outside the forward included, times the what-if scale."""
    return step_q_ms(c, nd, 1, ctx_max, ctx_sum, chn, chp, chf, nch)


@kernel
def step_q_ms(c, nd, q, ctx_max, ctx_sum, chn, chp, chf, nch):
    """``step_ms`` with ``q`` query tokens per decoding sequence (``step_core_q_ms``)."""
    return finish_ms(c, step_core_q_ms(c, nd, q, ctx_max, ctx_sum, chn, chp, chf, nch, False),
                     nd + nch)


@kernel
def verify_ms(c, nd, q, ctx_max, ctx_sum, chn, chp, chf, nch):
    """Milliseconds of a speculative-decoding verify step: ``nd`` sequences (contexts
    ``ctx_max`` / ``ctx_sum`` before the step) each run their last token and ``q - 1``
    draft tokens through the target model, a decode of ``q`` query tokens per sequence
    (``step_q_ms``) whose last query sees ``q - 1`` more keys; prefill chunks may share
    the step."""
    return step_q_ms(c, nd, q, ctx_max + (q - 1), ctx_sum + nd * (q - 1), chn, chp, chf, nch)


@kernel
def outside_range(c, nd, ctx_max, ctx_sum, chn, chp, chf, nch):
    """True when the step is larger than anything the fit saw in one dimension: packed
    tokens, a chunk's size or its prior + size, the decode batch or its context. The
    physics still answers there; the run counts and reports such steps."""
    T = nd
    for i in range(nch):
        T += chn[i]
        if chn[i] > c[C_RANGE_CHUNK] or chp[i] + chn[i] > c[C_RANGE_CONTEXT]:
            return True
    if T > c[C_RANGE_TOKENS] or nd > c[C_RANGE_BATCH]:
        return True
    if nd > 0:
        if decode_context(c[C_PADDED] > 0.0, nd, ctx_max, ctx_sum) > c[C_RANGE_DECODE_CTX]:
            return True
    return False


@kernel
def rows_ms(c, nd, ctx_max, ctx_sum, chn, chp, chf, has_chunk, force_eager, out):
    """``step_core_ms`` of many single-chunk steps (profile rows) into ``out``."""
    a = np.zeros(1, dtype=np.int64)
    b = np.zeros(1, dtype=np.int64)
    f = np.zeros(1, dtype=np.bool_)
    for i in range(nd.shape[0]):
        a[0] = chn[i]
        b[0] = chp[i]
        f[0] = chf[i]
        out[i] = step_core_ms(c, nd[i], ctx_max[i], ctx_sum[i], a, b, f,
                              1 if has_chunk[i] else 0, force_eager[i])


@kernel
def decode_run_ms(c, nd, ctx_max0, ctx_sum0, k, out):
    """``step_ms`` of ``k`` consecutive decode-only steps whose longest context grows
    by one per step and whose contexts' sum grows by ``nd`` (into ``out[:k]``): the
    batch's ``step_terms`` once, then each step's context (the same bits as ``k``
    calls of ``step_ms``)."""
    i = table_row(c, nd)
    if i >= 0:
        host, floor, base, ar, p2p, unit, shift = (c[i], c[i + 1], c[i + 2], c[i + 3],
                                                   c[i + 4], c[i + 5], c[i + 6])
    else:
        z = np.zeros(1, dtype=np.int64)
        f = np.zeros(1, dtype=np.bool_)
        host, floor, base, ar, p2p, unit, shift = step_terms(c, nd, 1, z, z, f, 0, False)
    for j in range(k):
        core = terms_core_ms(c, host, floor, base, ar, p2p, unit, shift, ctx_max0 + j,
                             ctx_sum0 + nd * j)
        out[j] = finish_ms(c, core, nd)


@kernel
def counted_step_ms(c, CL, nd, ctx_max, ctx_sum, chn, chp, chf, nch):
    """``step_ms``, counted into ``CL`` (``cost.counts``: one lookup, and one
    extrapolation if it lies ``outside_range``)."""
    CL[0] += 1
    if outside_range(c, nd, ctx_max, ctx_sum, chn, chp, chf, nch):
        CL[1] += 1
    return step_ms(c, nd, ctx_max, ctx_sum, chn, chp, chf, nch)


@kernel
def counted_decode_run_ms(c, CL, nd, ctx0, k, out):
    """``decode_run_ms`` of ``nd`` decodes whose context (the longest if padded, the
    mean if paged: ``decodectx.epoch_context``) is ``ctx0`` at the first step, counted
    into ``CL`` (``k`` lookups, ``decode_run_outside`` extrapolations)."""
    csum = nd * ctx0
    decode_run_ms(c, nd, ctx0, csum, k, out)
    CL[0] += k
    CL[1] += decode_run_outside(c, nd, ctx0, csum, k)


@kernel
def decode_run_outside(c, nd, ctx_max0, ctx_sum0, k):
    """How many of ``decode_run_ms``'s steps lie outside the fitted range
    (``outside_range`` of each: the batch is the run's, only the context grows)."""
    if nd <= 0 or k <= 0:
        return 0
    if nd > c[C_RANGE_TOKENS] or nd > c[C_RANGE_BATCH]:
        return k
    if c[C_PADDED] > 0.0:
        # The longest context grows by one per step: the steps from the first one past
        # the range on (contexts are whole numbers of tokens).
        first = np.floor(c[C_RANGE_DECODE_CTX] - ctx_max0) + 1.0
        if first < 0.0:
            first = 0.0
        return int(k - first) if first < k else 0
    n = 0
    for j in range(k):
        if epoch_context(False, nd, ctx_max0, ctx_sum0, j) > c[C_RANGE_DECODE_CTX]:
            n += 1
    return n


def new_constants() -> np.ndarray:
    """A zeroed constants vector with the neutral settings (scale 1, p = 4, one GPU)."""
    c = np.zeros(N_CONST)
    c[C_SCALE] = 1.0
    c[C_P_STEP] = c[C_P_ATTN] = c[C_P_GEMM] = 4.0
    c[C_WAVE_COST] = 1.0
    c[C_TP] = c[C_PP] = 1.0
    c[C_AR_PER_LAYER] = 2.0
    return c


def step_breakdown(c: np.ndarray, n_decode: int, ctx_max: int, ctx_sum: int,
                   chunks) -> dict:
    """The terms of one step (ms), each on its own, as ``step_ms`` combines them:
    ``weights`` and ``gemm_compute`` (the linear layers' memory and compute bounds,
    ``linear`` their soft maximum), ``elementwise``, ``prefill_attention``,
    ``decode_attention``, ``allreduce``, ``pipeline_send``, ``floor`` (kernels'
    minimum durations), ``device`` (the device's whole time: the linear layers' soft
    maximum, the other terms and the floor), ``host`` (the launches the device may
    hide), ``bookkeeping`` and ``ms`` (the step, equal to ``step_ms``). ``chunks`` are
    ``(n, prior)`` or ``(n, prior, completes)``; ``graph_replay`` says whether a CUDA
    graph ran the step (``host`` is then the replay's cost)."""
    arrs = ChunkArrays(max(len(chunks), 1))
    k = arrs.pack(chunks)
    chn, chp, chf = arrs.n, arrs.p, arrs.f
    graphs = c[C_GRAPHS] > 0.0
    host = float(host_ms(c, n_decode, chp, k))
    floor = float(c[C_DEV_PER_HOST] * host + fixed_floor_ms(c))
    nd, cmax, csum = n_decode, ctx_max, ctx_sum
    graph = False
    if graphs and k == 0 and n_decode > 0:
        gb = graph_batch(c, n_decode)
        if gb > 0:
            graph = True
            nd, csum = gb, ctx_sum + (gb - n_decode)
    T = float(nd + int(chn[:k].sum()))
    S = float(nd + int(chf[:k].sum()))
    t_w, t_f = linear_times(c, T, S)
    ar, p2p = comm_times(c, T)
    att = float(sum(float(chunk_attention_ms(c, chn[i], chp[i])) for i in range(k)))
    dec = float(decode_attention_ms(c, nd, cmax, csum, graphs and not graph))
    out = {"weights": float(t_w), "gemm_compute": float(t_f),
           "linear": float(pnorm(t_w, t_f, c[C_P_GEMM])), "elementwise": float(act_ms(c, T)),
           "prefill_attention": att, "decode_attention": dec, "allreduce": float(ar),
           "pipeline_send": float(p2p), "floor": floor}
    out["device"] = float(device_ms(c, nd, cmax, csum, chn, chp, chf, k, graphs and not graph)
                          + floor)
    out["host"] = float(c[C_H_GRAPH]) if graph else host
    out["graph_replay"] = graph
    out["bookkeeping"] = float(bookkeeping_ms(c, n_decode + k))
    out["ms"] = float(step_ms(c, n_decode, ctx_max, ctx_sum, chn, chp, chf, k))
    return out
