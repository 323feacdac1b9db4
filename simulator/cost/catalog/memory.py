"""Memory arithmetic of a serving configuration: weights, reserve and KV cache per GPU.

A replica runs one model on ``tp x pp`` GPUs. What each GPU holds:

* **Weights.** Layers are split evenly over the ``pp`` pipeline stages. Inside a stage,
  tensor parallelism splits the attention projections by heads and every MLP (each
  expert of an MoE) by its intermediate dimension (Megatron column/row parallel, as
  vLLM does; no expert parallelism). The token embedding sits on the first stage and
  the LM head plus final norm on the last, both split over TP by vocabulary rows.
  With tied embeddings and ``pp > 1`` the last stage keeps its own copy of the
  embedding matrix for the LM head. Norms, the MoE router, learned positions and
  row-parallel biases are replicated on every GPU. The most loaded stage decides.
* **KV heads.** Each GPU holds ``kv_heads / tp`` KV heads. When ``tp`` exceeds the
  KV heads (e.g. TP8 on a 4-KV-head model) every GPU still needs the KV head its
  query heads read, so each KV head (its projection weights and its cache) is
  **replicated** ``tp / kv_heads`` times.
* **Reserve** (assumption, after vLLM's start-up profiling): the activation peak of a
  forward pass over ``max_num_batched_tokens`` tokens plus a fixed per-GPU overhead.
  The activation term counts, per token, the residual stream, normed input, attention
  input and output (4 x hidden), the QKV projection output and the MLP intermediates
  (gate+up output and activation output) of this GPU's shard, in the activation dtype;
  plus fp32 logits over the full vocabulary for ``max_num_seqs`` sampled sequences.
  For Llama-3-8B on one H100 with 8,192 batched tokens this gives 1.12 GiB where
  vLLM's own profiling log reports a 1.26 GiB activation peak. The fixed overhead
  (``overhead_gib``, default 1.0 GiB) stands for non-PyTorch allocations (CUDA
  context, cuBLAS/NCCL workspaces); vLLM logs report 0.2-1.8 GiB at TP1 and more at
  TP2 (NCCL buffers). CUDA-graph memory is outside the budget, as in vLLM, which is
  why ``gpu_memory_utilization`` stays below 1.
* **KV cache.** Whatever is left of ``gpu_memory_utilization x device memory``,
  divided by the bytes one token's K and V take on this GPU (its stage's layers, its
  KV heads, ``kv_dtype``), rounded down to whole blocks. Every GPU of the replica holds
  a slice of every cached token, so that token count is the replica's KV capacity.
* **Data-parallel attention** (``dp`` ranks, vLLM's ``--data-parallel-size`` with
  expert parallelism over ``tp x dp`` GPUs): the replica is ``dp`` TP groups. Each
  holds attention, any dense MLP, the embedding and the LM head as above (replicated
  across the ranks) and ``experts / (tp x dp)`` whole experts per GPU, reserves for its
  own share of the batch (``max_num_batched_tokens / dp`` and ``max_num_seqs / dp``,
  rounded up: latsim's engine limits are the replica's, one scheduler's) and caches the
  KV of its own requests only, so the replica's KV capacity is ``dp`` times one rank's
  (a request's whole context, ``max_model_len``, must fit in one rank's).
"""
from __future__ import annotations

from dataclasses import dataclass

from simulator.errors import LatsimError
from simulator.model.kv.blocks import kv_bytes_per_token as kv_bytes
from simulator.cost.catalog.gpus import GpuSpec
from simulator.cost.catalog.models import ModelArch, WeightFormat, dtype_bytes, weight_format

GIB = float(2**30)


# GPUs one server joins by its GPU-to-GPU link (NVLink / Infinity Fabric on every HGX,
# DGX and OAM board catalogued; PCIe servers hold up to 8 too).
GPUS_PER_SERVER = 8


def check_parallelism(arch: ModelArch, tp: int, pp: int = 1, *, priced: bool = True) -> None:
    """Refuse a TP/PP split the model cannot be cut into (one-line LatsimError); with
    ``priced`` (a step will be timed) also a TP group wider than one server: its
    all-reduces would cross the network between servers, which the cost model does not
    price (it would price them at the GPU-to-GPU link's speed); pipeline stages span
    servers instead."""
    for field, v in (("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise LatsimError("must be a positive integer", field=field, value=v, has_value=True)
    if arch.heads % tp:
        raise LatsimError(f"{arch.name}: tensor parallel size must divide the {arch.heads} "
                          f"attention heads", field="tp", value=tp, has_value=True)
    if arch.kv_heads % tp and tp % arch.kv_heads:
        raise LatsimError(f"{arch.name}: tensor parallel size must divide the {arch.kv_heads} "
                          f"KV heads or be a multiple of them", field="tp", value=tp, has_value=True)
    if arch.layers % pp:
        raise LatsimError(f"{arch.name}: pipeline parallel size must divide the {arch.layers} "
                          f"layers", field="pp", value=pp, has_value=True)
    if priced and tp > GPUS_PER_SERVER:
        raise LatsimError(f"a tensor-parallel group spans at most one server's "
                          f"{GPUS_PER_SERVER} GPUs here (beyond, its all-reduces cross the "
                          "network, which latsim does not price); span servers with pp",
                          field="tp", value=tp, has_value=True)


def check_context(arch: ModelArch, tokens: int, what: str, **where) -> None:
    """Refuse ``tokens`` of context beyond the model's longest one
    (``max_position_embeddings``; no bound when unknown): no server runs them (vLLM
    refuses to start so unless told its positions are scaled), and the model was never
    trained past it. ``what`` names the quantity, ``where`` the ``LatsimError``'s
    ``source`` / ``field``."""
    mc = arch.max_context
    if mc and tokens > mc:
        raise LatsimError(f"{what} {tokens:,} tokens exceeds {arch.name}'s longest context, "
                          f"{mc:,} tokens (max_position_embeddings)", value=tokens,
                          has_value=True, **where)


def kv_heads_per_gpu(arch: ModelArch, tp: int) -> int:
    """KV heads each GPU of a TP group stores (at least 1: replicated past kv_heads)."""
    return max(1, arch.kv_heads // tp)


def kv_replication(arch: ModelArch, tp: int) -> int:
    """How many GPUs of the TP group hold a copy of each KV head (1 = no replication)."""
    return max(1, tp // arch.kv_heads)


def _layer_bytes_per_gpu(arch: ModelArch, tp: int, wf: WeightFormat, dp: int = 1) -> float:
    """One transformer block's weights on one GPU of a TP group, in bytes; with ``dp``
    data-parallel attention ranks a mixture's experts are spread whole over the ``tp x
    dp`` GPUs of its EP group (``experts / (tp x dp)`` of them, biases and all) while
    attention and any dense MLP stay one TP group's share."""
    kvh = kv_heads_per_gpu(arch, tp)
    hd, h = arch.head_dim, arch.hidden
    # A mixture's dense layers (if any) hold a dense MLP in place of the experts: the
    # average block, times the stage's layers.
    mlp = arch.mlp_linear_weights()
    if dp > 1:
        experts = arch.moe_layers * arch.experts * arch.expert_linear_weights()
        mlp = mlp - experts + experts / dp
    attn = h * arch.q_dim / tp + 2 * h * kvh * hd + arch.q_dim / tp * h
    if arch.is_mla:
        # MLA: the up-projections and o_proj split by heads, the down-projections whole.
        repl = arch.attn_replicated_weights()
        attn = (arch.attn_linear_weights() - repl) / tp + repl
    linear = attn + mlp / arch.layers / tp
    small = (arch.router_weights() * arch.moe_layers / arch.layers
             + arch.norms_per_layer * arch.norm_params() + arch.attn_norm_params())
    if arch.linear_bias:
        small += arch.q_dim / tp + 2 * kvh * hd + h          # qkv split, o bias replicated
        if dp > 1:
            small += arch.experts / (tp * dp) * arch.expert_biases()
        else:
            small += arch.experts * ((2 if arch.gated_mlp else 1) * arch.ffn / tp + h)
    elif arch.qkv_bias:
        small += arch.q_dim / tp + 2 * kvh * hd
    return linear * wf.bytes_per_weight + 2.0 * small


def weight_bytes_per_stage(arch: ModelArch, tp: int = 1, pp: int = 1,
                           fmt: str | WeightFormat = "bf16", dp: int = 1) -> list[float]:
    """Weight bytes on one GPU of each pipeline stage (first stage first); ``dp``: data-
    parallel attention ranks, the experts spread over ``tp x dp`` GPUs (``_layer_bytes_per_gpu``)."""
    check_parallelism(arch, tp, pp, priced=False)
    wf = weight_format(fmt)
    per_stage = arch.layers // pp * _layer_bytes_per_gpu(arch, tp, wf, dp)
    embed = 2.0 * (arch.vocab * arch.hidden / tp + arch.learned_positions * arch.hidden
                   + (arch.norm_params() if arch.embedding_norm else 0))
    head_rows = arch.vocab * arch.hidden / tp
    if arch.tied_embeddings and pp == 1:
        head_rows = 0.0      # the LM head is the embedding matrix itself
    head = 2.0 * (head_rows + arch.final_norm_params())
    stages = [per_stage] * pp
    stages[0] += embed
    stages[-1] += head
    return stages


def weight_bytes_per_gpu(arch: ModelArch, tp: int = 1, pp: int = 1,
                         fmt: str | WeightFormat = "bf16", dp: int = 1) -> float:
    """Weight bytes on the most loaded GPU of the replica."""
    return max(weight_bytes_per_stage(arch, tp, pp, fmt, dp))


def kv_bytes_per_token_per_gpu(arch: ModelArch, tp: int = 1, pp: int = 1,
                               kv_dtype: str = "bf16") -> float:
    """K and V bytes one cached token takes on one GPU (its stage's layers, its KV heads)."""
    check_parallelism(arch, tp, pp, priced=False)
    if arch.is_mla:   # one latent a token and layer, whole on every GPU
        return float(arch.layers // pp * arch.kv_elems_per_layer() * dtype_bytes(kv_dtype))
    return float(kv_bytes(arch.layers // pp, kv_heads_per_gpu(arch, tp), arch.head_dim,
                          dtype_bytes(kv_dtype)))


def activation_bytes_per_gpu(arch: ModelArch, tp: int = 1, max_num_batched_tokens: int = 8192,
                             max_num_seqs: int = 256, act_dtype: str = "bf16") -> float:
    """Peak activation bytes of one forward over ``max_num_batched_tokens`` (see module doc)."""
    kvh = kv_heads_per_gpu(arch, tp)
    mlp_live = (3 if arch.gated_mlp else 2) * arch.ffn / tp * arch.experts_per_token
    per_token = 4 * arch.hidden + (arch.heads / tp + 2 * kvh) * arch.head_dim + mlp_live
    logits = min(max_num_batched_tokens, max_num_seqs) * arch.vocab * 4.0
    return max_num_batched_tokens * dtype_bytes(act_dtype) * per_token + logits


@dataclass(frozen=True)
class MemoryPlan:
    """Where one GPU's memory goes in a TP x PP replica, and the KV capacity left (bytes)."""

    model: str
    gpu: str
    tp: int
    pp: int
    weight_format: str
    kv_dtype: str
    gpu_memory_utilization: float
    block_size: int
    gpu_bytes: int                      # device memory (driver-reported total)
    budget_bytes: float                 # gpu_memory_utilization x gpu_bytes
    weight_bytes_per_stage: tuple[float, ...]
    weight_bytes_per_gpu: float         # the most loaded stage
    activation_bytes: float
    overhead_bytes: float
    kv_heads_per_gpu: int
    kv_replication: int
    layers_per_stage: int
    kv_bytes_per_token_per_gpu: float
    kv_bytes_per_gpu: float             # budget left for KV on the most loaded GPU (< 0: none)
    kv_blocks: int                      # whole blocks of block_size tokens
    kv_tokens: int                      # kv_blocks x block_size: the replica's KV capacity
    max_model_len: int | None
    fits: bool
    reason: str                         # '' when it fits
    dp: int = 1                         # data-parallel attention ranks (kv_blocks: all of them)

    @property
    def num_gpus(self) -> int:
        """GPUs of the replica (tp x pp x dp)."""
        return self.tp * self.pp * self.dp

    @property
    def kv_blocks_per_rank(self) -> int:
        """Blocks one data-parallel rank holds (all of them at ``dp = 1``)."""
        return self.kv_blocks // self.dp

    @property
    def reserve_bytes(self) -> float:
        """Activation peak plus fixed overhead, per GPU."""
        return self.activation_bytes + self.overhead_bytes

    def describe(self) -> str:
        """A few lines with the arithmetic, in GiB."""
        g = GIB
        lines = [
            f"{self.model} on {self.num_gpus} x {self.gpu} (TP{self.tp} PP{self.pp}"
            f"{f' DP{self.dp}' if self.dp > 1 else ''}), "
            f"{self.weight_format} weights, {self.kv_dtype} KV",
            f"  budget   {self.gpu_memory_utilization:.2f} x {self.gpu_bytes / g:.2f} GiB = "
            f"{self.budget_bytes / g:.2f} GiB per GPU",
            f"  weights  {self.weight_bytes_per_gpu / g:.2f} GiB per GPU (most loaded stage)",
            f"  reserve  {self.activation_bytes / g:.2f} GiB activations + "
            f"{self.overhead_bytes / g:.2f} GiB overhead",
            f"  KV       {self.kv_bytes_per_gpu / g:.2f} GiB / {self.kv_bytes_per_token_per_gpu:.0f} B "
            f"per token = {self.kv_tokens} tokens ({self.kv_blocks} blocks of {self.block_size}"
            f"{f', {self.dp} DP ranks' if self.dp > 1 else ''})",
        ]
        if not self.fits:
            lines.append(f"  {self.reason}")
        return "\n".join(lines)


def _resolve(model, gpu) -> tuple[ModelArch, GpuSpec]:
    from simulator.cost.catalog import lookup

    arch = model if isinstance(model, ModelArch) else lookup.model(model)
    spec = gpu if isinstance(gpu, GpuSpec) else lookup.gpu(gpu)
    return arch, spec


def plan_memory(model: str | ModelArch, gpu: str | GpuSpec, tp: int = 1, pp: int = 1, *,
                weight_dtype: str | WeightFormat = "bf16", kv_dtype: str = "bf16",
                gpu_memory_utilization: float = 0.9, block_size: int = 16,
                max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                act_dtype: str = "bf16", overhead_gib: float = 1.0,
                reserve_gib: float | None = None, max_model_len: int | None = None,
                require_fit: bool = True, dp: int = 1) -> MemoryPlan:
    """The per-GPU memory plan of ``model`` on ``tp x pp`` GPUs of type ``gpu``.

    ``reserve_gib`` replaces the whole activation + overhead estimate by a fixed
    figure. A plan fits when the weights and reserve leave room for at least one KV
    block, and for ``max_model_len`` tokens when that is given. With ``require_fit``
    a plan that does not fit raises a one-line LatsimError carrying the numbers;
    otherwise it is returned with ``fits=False`` and the reason. ``dp``: data-parallel
    attention ranks (module doc; 1 is the plan of one TP x PP group, to the bit).
    """
    arch, spec = _resolve(model, gpu)
    check_parallelism(arch, tp, pp, priced=False)
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise LatsimError("must be in (0, 1]", field="gpu_memory_utilization",
                          value=gpu_memory_utilization, has_value=True)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise LatsimError("must be a positive integer", field="block_size", value=block_size,
                          has_value=True)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise LatsimError("must be a positive integer", field="dp", value=dp, has_value=True)
    wf = weight_format(weight_dtype)
    stages = weight_bytes_per_stage(arch, tp, pp, wf, dp)
    if dp > 1:
        # Each rank reserves for its own share of the replica's batch.
        max_num_batched_tokens = -(-max_num_batched_tokens // dp)
        max_num_seqs = -(-max_num_seqs // dp)
    w_max = max(stages)
    if reserve_gib is not None:
        act, over = 0.0, reserve_gib * GIB
    else:
        act = activation_bytes_per_gpu(arch, tp, max_num_batched_tokens, max_num_seqs, act_dtype)
        over = overhead_gib * GIB
    budget = gpu_memory_utilization * spec.memory_bytes
    kv_free = budget - w_max - act - over
    per_tok = kv_bytes_per_token_per_gpu(arch, tp, pp, kv_dtype)
    blocks = int(kv_free // (per_tok * block_size)) if kv_free > 0 else 0
    tokens = blocks * block_size        # one rank's (a request lives on one)

    reason = ""
    head = (f"{arch.name} on {tp * pp * dp} x {spec.name} (TP{tp} PP{pp}"
            f"{f' DP{dp}' if dp > 1 else ''}, {wf.name} weights)")
    if blocks < 1:
        reason = (f"{head} does not fit: weights {w_max / GIB:.1f} GiB + reserve "
                  f"{(act + over) / GIB:.1f} GiB per GPU exceed the budget "
                  f"{gpu_memory_utilization:.2f} x {spec.memory_bytes / GIB:.1f} GiB = "
                  f"{budget / GIB:.1f} GiB")
    elif max_model_len is not None and tokens < max_model_len:
        reason = (f"{head} does not fit: the KV cache holds {tokens} tokens "
                  f"{'per DP rank ' if dp > 1 else ''}"
                  f"({kv_free / GIB:.2f} GiB after {w_max / GIB:.1f} GiB weights), fewer than "
                  f"max_model_len {max_model_len}")
    if reason and require_fit:
        raise LatsimError(reason)
    return MemoryPlan(
        model=arch.name, gpu=spec.name, tp=tp, pp=pp, weight_format=wf.name, kv_dtype=kv_dtype,
        gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
        gpu_bytes=spec.memory_bytes, budget_bytes=budget,
        weight_bytes_per_stage=tuple(stages), weight_bytes_per_gpu=w_max,
        activation_bytes=act, overhead_bytes=over,
        kv_heads_per_gpu=kv_heads_per_gpu(arch, tp), kv_replication=kv_replication(arch, tp),
        layers_per_stage=arch.layers // pp, kv_bytes_per_token_per_gpu=per_tok,
        kv_bytes_per_gpu=kv_free, kv_blocks=blocks * dp, kv_tokens=tokens * dp,
        max_model_len=max_model_len, fits=not reason, reason=reason, dp=dp)
