"""Decoder-only transformer architectures and the work one token costs on them.

A :class:`ModelArch` holds the shape numbers of a Hugging Face ``config.json``; the
parameter count is computed from that shape (and checked against each model's
published count in the tests). The helpers give a step-cost model its work terms:

* :meth:`ModelArch.linear_params_per_token`: weights of the transformer-block linear
  layers one token multiplies through (MoE: only the experts it is routed to), so a
  token costs ``2 x`` that many FLOPs in GEMMs; the LM head is separate because only
  sampled positions pay for it (:meth:`ModelArch.lm_head_flops_per_token`).
* :meth:`ModelArch.attn_flops_per_pair`: FLOPs of ``QK^T`` and ``PV`` for one
  (query token, key) pair summed over layers and heads.
* :meth:`ModelArch.kv_bytes_per_token`: bytes of K and V one token leaves in the cache.
* :meth:`ModelArch.weight_bytes`: bytes of all weights for a storage format.

Weight formats (:data:`WEIGHT_FORMATS`): quantization applies to the linear layers
of the transformer blocks (attention projections and MLP/experts). Embeddings, the
LM head, norms, biases and the MoE router stay 16-bit, as vLLM/TensorRT-LLM keep them
for GPTQ/AWQ/FP8 checkpoints. ``int4`` is GPTQ/AWQ-style: 4-bit weights in groups of
128 input channels, each group carrying one fp16 scale and one packed 4-bit zero point
(2.5 bytes per 128 weights, 4.16 bits a weight). ``int8`` and ``fp8`` carry
per-channel or per-tensor scales, under 0.1% of the weights, not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

from simulator.model.kv.blocks import kv_bytes_per_token as kv_bytes

# Bytes per element for activation / KV-cache dtypes.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "float32": 4.0,
    "bf16": 2.0, "bfloat16": 2.0, "fp16": 2.0, "float16": 2.0, "auto": 2.0,
    "fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "int8": 1.0,
    "int4": 0.5,
}


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of an activation or KV dtype name ('bf16', 'fp8', ...)."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class WeightFormat:
    """How a linear layer's weights are stored: bits a weight plus per-group metadata."""

    name: str
    bits: float
    group_size: int | None = None       # weights sharing one scale (None: per tensor/channel)
    group_overhead_bytes: float = 0.0   # scale + zero point bytes per group
    note: str = ""

    @property
    def bytes_per_weight(self) -> float:
        """Storage per weight including the group metadata, in bytes."""
        extra = self.group_overhead_bytes / self.group_size if self.group_size else 0.0
        return self.bits / 8.0 + extra


WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("bf16", 16),
    WeightFormat("fp16", 16),
    WeightFormat("fp8", 8, note="per-tensor/per-channel scales not counted"),
    WeightFormat("int8", 8, note="per-channel scales not counted (W8A8 / weight-only int8)"),
    WeightFormat("int4", 4, group_size=128, group_overhead_bytes=2.5,
                 note="GPTQ/AWQ: fp16 scale + packed 4-bit zero point per 128 weights"),
)}


def weight_format(name: str | WeightFormat) -> WeightFormat:
    """The :class:`WeightFormat` for a name ('bf16', 'fp8', 'int8', 'int4')."""
    if isinstance(name, WeightFormat):
        return name
    key = name.lower()
    key = {"bfloat16": "bf16", "float16": "fp16", "w4a16": "int4", "awq": "int4",
           "gptq": "int4", "w8a8": "int8"}.get(key, key)
    try:
        return WEIGHT_FORMATS[key]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r}; known: {sorted(WEIGHT_FORMATS)}") from None


@dataclass(frozen=True)
class ModelArch:
    """The shape of a decoder-only transformer, as in its Hugging Face config.json."""

    name: str
    hf_id: str
    family: str                   # llama, mistral, mixtral, qwen2, opt, bloom, falcon, ...
    layers: int
    hidden: int                   # d_model
    heads: int                    # query heads
    kv_heads: int                 # key/value heads (GQA/MQA: fewer than heads)
    head_dim: int
    ffn: int                      # MLP intermediate size (per expert for MoE)
    vocab: int
    tied_embeddings: bool         # LM head shares the input embedding matrix
    gated_mlp: bool               # SwiGLU-style: 3 matrices (gate, up, down); else 2
    activation: str
    max_context: int | None
    experts: int = 1              # MoE: experts per layer (1 = dense)
    experts_per_token: int = 1    # MoE: experts each token is routed to
    dense_layers: int = 0         # MoE: layers whose MLP is a dense one (Qwen3-MoE mlp_only_layers)
    dense_ffn: int = 0            # ... and that MLP's intermediate size
    qk_norm: bool = False         # RMSNorm (weight of head_dim) on each head's q and k (Qwen3)
    qkv_bias: bool = False        # biases on q/k/v projections only (Qwen2)
    linear_bias: bool = False     # biases on every linear layer (OPT, BLOOM)
    norm: str = "rmsnorm"         # rmsnorm (weight) or layernorm (weight + bias)
    norms_per_layer: int = 2
    final_norm: bool = True
    embedding_norm: bool = False  # BLOOM's word_embeddings_layernorm
    learned_positions: int = 0    # rows of a learned position table (OPT: 2048 + 2)
    sliding_window: int | None = None
    # Multi-head latent attention (DeepSeek-V2/V3 MLA; ``kv_lora_rank > 0`` marks it):
    # keys and values are up-projected per head from one cached latent of
    # ``kv_lora_rank`` elements plus a rotary key of ``qk_rope_dim`` shared by every head
    # (``kv_heads`` is 1: the cache holds that one latent, whole on every TP rank);
    # ``head_dim`` is a query/key head's width (no-rope part + rope part), ``v_head_dim``
    # a value head's; queries go through a ``q_lora_rank`` bottleneck when it is > 0.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    shared_ffn: int = 0           # MoE: width of the always-active shared expert(s), summed
    source: str = ""              # where the shape numbers come from
    published_params: float | None = None         # total, as published
    published_active_params: float | None = None  # MoE: per token, as published
    published_source: str = ""

    # -- shapes -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        """Width of the query projection (heads x head_dim)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (or value) projection (kv_heads x head_dim)."""
        return self.kv_heads * self.head_dim

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention (module fields)."""
        return self.kv_lora_rank > 0

    @property
    def v_dim(self) -> int:
        """Width of the attention output before ``o_proj`` (heads x value head width)."""
        return self.heads * (self.v_head_dim if self.is_mla else self.head_dim)

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts MLP."""
        return self.experts > 1

    def norm_params(self) -> int:
        """Elements of one norm: weight (RMSNorm) or weight and bias (LayerNorm)."""
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    # -- parameter counts (elements) ----------------------------------------------
    def attn_linear_weights(self) -> int:
        """Weights of q, k, v and o projections in one layer (no biases). MLA: the
        query's down and up projections (or one projection without ``q_lora_rank``), the
        joint KV down-projection to the latent and the shared rotary key, the latent's
        up-projection to every head's no-rope key and value, and ``o_proj``."""
        if not self.is_mla:
            return self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        h, n = self.hidden, self.heads
        q = (h * self.q_lora_rank + self.q_lora_rank * self.q_dim if self.q_lora_rank
             else h * self.q_dim)
        kv_a = h * (self.kv_lora_rank + self.qk_rope_dim)
        kv_b = self.kv_lora_rank * n * (self.head_dim - self.qk_rope_dim + self.v_head_dim)
        return q + kv_a + kv_b + self.v_dim * h

    def attn_replicated_weights(self) -> int:
        """Attention weights of one layer that every GPU of a TP group holds whole: MLA's
        down-projections (vLLM runs them as replicated linears), 0 otherwise (the
        replication of KV heads past ``kv_heads`` GPUs is the memory plan's)."""
        if not self.is_mla:
            return 0
        return self.hidden * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_dim)

    def attn_norm_params(self) -> int:
        """Norm weights inside one layer's attention: Qwen3's per-head q/k norms, MLA's
        norms on the query and KV latents."""
        if self.is_mla:
            return self.q_lora_rank + self.kv_lora_rank
        return 2 * self.head_dim if self.qk_norm else 0

    def attn_biases(self) -> int:
        """Bias elements of one layer's attention projections."""
        if self.linear_bias:
            return self.q_dim + 2 * self.kv_dim + self.hidden
        if self.qkv_bias:
            return self.q_dim + 2 * self.kv_dim
        return 0

    def expert_linear_weights(self) -> int:
        """Weights of one MLP (one expert): 3 matrices if gated, else 2."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.ffn

    def expert_biases(self) -> int:
        """Bias elements of one MLP (one expert); 0 without linear biases."""
        if not self.linear_bias:
            return 0
        return (2 if self.gated_mlp else 1) * self.ffn + self.hidden

    def shared_expert_weights(self) -> int:
        """Weights of one MoE layer's always-active shared expert(s) (0 without)."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.shared_ffn

    def router_weights(self) -> int:
        """The MoE gate: hidden x experts per layer (0 for dense models)."""
        return self.hidden * self.experts if self.is_moe else 0

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is the mixture (all of them for a dense model's one 'expert')."""
        return self.layers - self.dense_layers

    def dense_mlp_weights(self) -> int:
        """Weights of the dense MLP of one of a mixture's ``dense_layers``."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.dense_ffn

    def mlp_linear_weights(self, active: bool = False) -> int:
        """MLP (expert) linear weights of all layers; ``active``: the routed experts only
        (those one token multiplies through), else every expert (those stored)."""
        n_exp = self.experts_per_token if active else self.experts
        return (self.moe_layers * (n_exp * self.expert_linear_weights()
                                   + self.shared_expert_weights())
                + self.dense_layers * self.dense_mlp_weights())

    def layer_params(self, active: bool = False) -> int:
        """Parameters of one transformer block whose MLP is the mixture (or the dense
        model's MLP); ``active``: only routed experts."""
        n_exp = self.experts_per_token if active else self.experts
        return (self.attn_linear_weights() + self.attn_biases()
                + n_exp * (self.expert_linear_weights() + self.expert_biases())
                + self.shared_expert_weights()
                + self.router_weights() + self.norms_per_layer * self.norm_params()
                + self.attn_norm_params())

    def blocks_params(self, active: bool = False) -> int:
        """Parameters of all transformer blocks: a mixture's ``dense_layers`` hold a dense
        MLP in place of the experts and the router."""
        n_exp = self.experts_per_token if active else self.experts
        mixture = (n_exp * (self.expert_linear_weights() + self.expert_biases())
                   + self.shared_expert_weights() + self.router_weights())
        return (self.layers * self.layer_params(active)
                + self.dense_layers * (self.dense_mlp_weights() - mixture))

    def embedding_params(self) -> int:
        """Token embedding, learned positions and any embedding norm."""
        return ((self.vocab + self.learned_positions) * self.hidden
                + (self.norm_params() if self.embedding_norm else 0))

    def lm_head_params(self) -> int:
        """Separate LM head weights (0 when tied to the embedding)."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def final_norm_params(self) -> int:
        """Elements of the norm before the LM head (0 if the model has none)."""
        return self.norm_params() if self.final_norm else 0

    def param_count(self) -> int:
        """Total parameters, computed from the shape."""
        return (self.blocks_params() + self.embedding_params()
                + self.lm_head_params() + self.final_norm_params())

    def active_param_count(self) -> int:
        """Parameters one token touches (MoE: routed experts only; dense: all)."""
        return (self.blocks_params(active=True) + self.embedding_params()
                + self.lm_head_params() + self.final_norm_params())

    # -- work per token -----------------------------------------------------------
    def linear_params_per_token(self) -> int:
        """Transformer-block linear weights one token multiplies through (active, all layers).

        Excludes the embedding lookup (no FLOPs) and the LM head (only sampled
        positions pay it). GEMM FLOPs per token = 2 x this.
        """
        return (self.layers * self.attn_linear_weights() + self.mlp_linear_weights(active=True)
                + self.moe_layers * self.router_weights())

    def linear_flops_per_token(self) -> float:
        """Multiply-add FLOPs of the block linears for one token (2 per weight)."""
        return 2.0 * self.linear_params_per_token()

    def lm_head_flops_per_token(self) -> float:
        """FLOPs of the LM head for one sampled position (2 x hidden x vocab)."""
        return 2.0 * self.hidden * self.vocab

    def attn_flops_per_pair(self) -> float:
        """FLOPs of QK^T plus PV for one (query, key) pair of a prefill, over all heads
        and layers: 2 FLOPs per element of ``attn_pair_dims`` (2 x head_dim for the dot
        product and 2 x head_dim for the weighted sum, per query head, in multi-head
        attention). A causal prefill of n tokens has n(n+1)/2 pairs; a decode with
        context c has c pairs.
        """
        return 2.0 * self.heads * self.layers * self.attn_pair_dims()

    def attn_pair_dims(self, decode: bool = False) -> float:
        """Per query head, the widths one (query, key) pair is multiplied through: the
        q.k dot product's plus the weighted value sum's (2 x head_dim for multi-head
        attention). MLA computes its prefill on up-projected keys and values (``head_dim
        + v_head_dim``) and its decode on the latent with the up-projections absorbed
        into the query and output (``kv_lora_rank + qk_rope_dim`` for q.k,
        ``kv_lora_rank`` for the sum), as vLLM's MLA backends do."""
        if not self.is_mla:
            return 2.0 * self.head_dim
        if decode:
            return 2.0 * self.kv_lora_rank + self.qk_rope_dim
        return float(self.head_dim + self.v_head_dim)

    def kv_elems_per_layer(self) -> int:
        """Elements one token caches per layer, all KV heads (MLA: the latent and the
        shared rotary key, one copy)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_dim
        return 2 * self.kv_heads * self.head_dim

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> float:
        """K and V bytes one token stores in the cache, all layers (no TP split)."""
        if self.is_mla:
            return float(self.layers * self.kv_elems_per_layer() * dtype_bytes(kv_dtype))
        return float(kv_bytes(self.layers, self.kv_heads, self.head_dim, dtype_bytes(kv_dtype)))

    def weight_bytes(self, fmt: str | WeightFormat = "bf16") -> float:
        """Bytes of all weights: block linears in ``fmt``, everything else 16-bit."""
        wf = weight_format(fmt)
        linear = self.layers * self.attn_linear_weights() + self.mlp_linear_weights()
        return linear * wf.bytes_per_weight + 2.0 * (self.param_count() - linear)
