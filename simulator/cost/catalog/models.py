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
    def is_moe(self) -> bool:
        """True for a mixture-of-experts MLP."""
        return self.experts > 1

    def norm_params(self) -> int:
        """Elements of one norm: weight (RMSNorm) or weight and bias (LayerNorm)."""
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    # -- parameter counts (elements) ----------------------------------------------
    def attn_linear_weights(self) -> int:
        """Weights of q, k, v and o projections in one layer (no biases)."""
        return self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden

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
        return (self.moe_layers * n_exp * self.expert_linear_weights()
                + self.dense_layers * self.dense_mlp_weights())

    def layer_params(self, active: bool = False) -> int:
        """Parameters of one transformer block whose MLP is the mixture (or the dense
        model's MLP); ``active``: only routed experts."""
        n_exp = self.experts_per_token if active else self.experts
        return (self.attn_linear_weights() + self.attn_biases()
                + n_exp * (self.expert_linear_weights() + self.expert_biases())
                + self.router_weights() + self.norms_per_layer * self.norm_params()
                + (2 * self.head_dim if self.qk_norm else 0))

    def blocks_params(self, active: bool = False) -> int:
        """Parameters of all transformer blocks: a mixture's ``dense_layers`` hold a dense
        MLP in place of the experts and the router."""
        n_exp = self.experts_per_token if active else self.experts
        mixture = n_exp * (self.expert_linear_weights() + self.expert_biases()) + self.router_weights()
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
        """FLOPs of QK^T plus PV for one (query, key) pair, over all heads and layers.

        2 x head_dim for the dot product and 2 x head_dim for the weighted sum, per
        query head. A causal prefill of n tokens has n(n+1)/2 pairs; a decode with
        context c has c pairs.
        """
        return 4.0 * self.heads * self.head_dim * self.layers

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> float:
        """K and V bytes one token stores in the cache, all layers (no TP split)."""
        return float(kv_bytes(self.layers, self.kv_heads, self.head_dim, dtype_bytes(kv_dtype)))

    def weight_bytes(self, fmt: str | WeightFormat = "bf16") -> float:
        """Bytes of all weights: block linears in ``fmt``, everything else 16-bit."""
        wf = weight_format(fmt)
        linear = self.layers * self.attn_linear_weights() + self.mlp_linear_weights()
        return linear * wf.bytes_per_weight + 2.0 * (self.param_count() - linear)


_META_L2 = "https://huggingface.co/meta-llama/{}/blob/main/config.json"
_LLAMA = dict(family="llama", gated_mlp=True, activation="silu")
_QWEN3 = dict(family="qwen3", gated_mlp=True, activation="silu", qk_norm=True, vocab=151936,
              max_context=40960)
_QWEN3_SRC = "https://huggingface.co/Qwen/Qwen3-{}/blob/main/config.json"

# Shapes copied from each model's config.json on the Hugging Face Hub (source field).
MODELS: dict[str, ModelArch] = {m.name: m for m in (
    ModelArch(name="llama-2-7b", hf_id="meta-llama/Llama-2-7b-hf", **_LLAMA,
              layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=11008,
              vocab=32000, tied_embeddings=False, max_context=4096,
              source=_META_L2.format("Llama-2-7b-hf"),
              published_params=6.74e9, published_source="Hugging Face model page (safetensors: 6.74B params)"),
    ModelArch(name="llama-2-13b", hf_id="meta-llama/Llama-2-13b-hf", **_LLAMA,
              layers=40, hidden=5120, heads=40, kv_heads=40, head_dim=128, ffn=13824,
              vocab=32000, tied_embeddings=False, max_context=4096,
              source=_META_L2.format("Llama-2-13b-hf"),
              published_params=13.0e9, published_source="Hugging Face model page (safetensors: 13B params)"),
    ModelArch(name="llama-2-70b", hf_id="meta-llama/Llama-2-70b-hf", **_LLAMA,
              layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672,
              vocab=32000, tied_embeddings=False, max_context=4096,
              source=_META_L2.format("Llama-2-70b-hf"),
              published_params=69.0e9, published_source="Hugging Face model page (safetensors: 69B params)"),
    ModelArch(name="llama-3-8b", hf_id="meta-llama/Meta-Llama-3-8B", **_LLAMA,
              layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336,
              vocab=128256, tied_embeddings=False, max_context=8192,
              source=_META_L2.format("Meta-Llama-3-8B"),
              published_params=8.03e9, published_source="Hugging Face model page (safetensors: 8.03B params)"),
    ModelArch(name="llama-3-70b", hf_id="meta-llama/Meta-Llama-3-70B", **_LLAMA,
              layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672,
              vocab=128256, tied_embeddings=False, max_context=8192,
              source=_META_L2.format("Meta-Llama-3-70B"),
              published_params=70.6e9, published_source="Hugging Face model page (safetensors: 70.6B params)"),
    ModelArch(name="llama-3.1-8b", hf_id="meta-llama/Llama-3.1-8B", **_LLAMA,
              layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336,
              vocab=128256, tied_embeddings=False, max_context=131072,
              source=_META_L2.format("Llama-3.1-8B"),
              published_params=8.03e9, published_source="Hugging Face model page (safetensors: 8.03B params)"),
    ModelArch(name="llama-3.1-70b", hf_id="meta-llama/Llama-3.1-70B", **_LLAMA,
              layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672,
              vocab=128256, tied_embeddings=False, max_context=131072,
              source=_META_L2.format("Llama-3.1-70B"),
              published_params=70.6e9, published_source="Hugging Face model page (safetensors: 70.6B params)"),
    # Small Llama-3.2 models: the usual draft models for speculative decoding of the
    # Llama-3 family (same tokenizer and vocabulary).
    ModelArch(name="llama-3.2-1b", hf_id="meta-llama/Llama-3.2-1B", **_LLAMA,
              layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192,
              vocab=128256, tied_embeddings=True, max_context=131072,
              source=_META_L2.format("Llama-3.2-1B"),
              published_params=1.24e9, published_source="Hugging Face model page (safetensors: 1.24B params)"),
    ModelArch(name="llama-3.2-3b", hf_id="meta-llama/Llama-3.2-3B", **_LLAMA,
              layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128, ffn=8192,
              vocab=128256, tied_embeddings=True, max_context=131072,
              source=_META_L2.format("Llama-3.2-3B"),
              published_params=3.21e9, published_source="Hugging Face model page (safetensors: 3.21B params)"),
    ModelArch(name="mistral-7b", hf_id="mistralai/Mistral-7B-v0.1", family="mistral",
              gated_mlp=True, activation="silu",
              layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336,
              vocab=32000, tied_embeddings=False, max_context=32768, sliding_window=4096,
              source="https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json",
              published_params=7.24e9,
              published_source="Hugging Face model page (safetensors: 7.24B params); Mistral AI says 7.3B"),
    ModelArch(name="mixtral-8x7b", hf_id="mistralai/Mixtral-8x7B-v0.1", family="mixtral",
              gated_mlp=True, activation="silu",
              layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336,
              vocab=32000, tied_embeddings=False, max_context=32768,
              experts=8, experts_per_token=2,
              source="https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json",
              published_params=46.7e9, published_active_params=12.9e9,
              published_source="Mistral AI, 'Mixtral of experts' (46.7B total, 12.9B per token)"),
    ModelArch(name="qwen2.5-7b", hf_id="Qwen/Qwen2.5-7B", family="qwen2",
              gated_mlp=True, activation="silu", qkv_bias=True,
              layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, ffn=18944,
              vocab=152064, tied_embeddings=False, max_context=131072,
              source="https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json",
              published_params=7.61e9, published_source="Qwen2.5-7B model card (7.61B; 6.53B non-embedding)"),
    ModelArch(name="qwen2.5-72b", hf_id="Qwen/Qwen2.5-72B", family="qwen2",
              gated_mlp=True, activation="silu", qkv_bias=True,
              layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=29568,
              vocab=152064, tied_embeddings=False, max_context=131072,
              source="https://huggingface.co/Qwen/Qwen2.5-72B/blob/main/config.json",
              published_params=72.7e9, published_source="Qwen2.5-72B model card (72.7B; 70.0B non-embedding)"),
    # Qwen3 (dense and MoE): per-head q/k RMSNorm, head_dim 128 whatever hidden / heads
    # is, the small models tie the LM head to the embedding. Published totals and
    # non-embedding counts are each model card's "Number of Parameters".
    *(ModelArch(name=f"qwen3-{size.lower()}", hf_id=f"Qwen/Qwen3-{size}", **_QWEN3,
                layers=layers, hidden=hidden, heads=heads, kv_heads=8, head_dim=128, ffn=ffn,
                tied_embeddings=tied, source=_QWEN3_SRC.format(size),
                published_params=pub, published_source=f"Qwen/Qwen3-{size} model card ({note})")
      for size, layers, hidden, heads, ffn, tied, pub, note in (
          ("0.6B", 28, 1024, 16, 3072, True, 0.6e9, "0.6B; 0.44B non-embedding"),
          ("1.7B", 28, 2048, 16, 6144, True, 1.7e9, "1.7B; 1.4B non-embedding"),
          ("4B", 36, 2560, 32, 9728, True, 4.0e9, "4.0B; 3.6B non-embedding"),
          ("8B", 36, 4096, 32, 12288, False, 8.2e9, "8.2B; 6.95B non-embedding"),
          ("14B", 40, 5120, 40, 17408, False, 14.8e9, "14.8B; 13.2B non-embedding"),
          ("32B", 64, 5120, 64, 25600, False, 32.8e9, "32.8B; 31.2B non-embedding"))),
    ModelArch(name="qwen3-30b-a3b", hf_id="Qwen/Qwen3-30B-A3B", **{**_QWEN3, "family": "qwen3_moe"},
              layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=768,
              experts=128, experts_per_token=8, tied_embeddings=False,
              source=_QWEN3_SRC.format("30B-A3B"),
              published_params=30.5e9, published_active_params=3.3e9,
              published_source="Qwen/Qwen3-30B-A3B model card (30.5B total, 3.3B activated, 29.9B non-embedding)"),
    ModelArch(name="qwen3-235b-a22b", hf_id="Qwen/Qwen3-235B-A22B", **{**_QWEN3, "family": "qwen3_moe"},
              layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128, ffn=1536,
              experts=128, experts_per_token=8, tied_embeddings=False,
              source=_QWEN3_SRC.format("235B-A22B"),
              published_params=235e9, published_active_params=22e9,
              published_source="Qwen/Qwen3-235B-A22B model card (235B total, 22B activated, 234B non-embedding)"),
    ModelArch(name="codellama-34b", hf_id="codellama/CodeLlama-34b-hf", **_LLAMA,
              layers=48, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=22016,
              vocab=32000, tied_embeddings=False, max_context=16384,
              source="https://huggingface.co/codellama/CodeLlama-34b-hf/blob/main/config.json",
              published_params=33.7e9,
              published_source="Hugging Face model page (safetensors: 33.7B params); Code Llama paper: 34B"),
    ModelArch(name="mixtral-8x22b", hf_id="mistralai/Mixtral-8x22B-v0.1", family="mixtral",
              gated_mlp=True, activation="silu",
              layers=56, hidden=6144, heads=48, kv_heads=8, head_dim=128, ffn=16384,
              vocab=32000, tied_embeddings=False, max_context=65536,
              experts=8, experts_per_token=2,
              source="https://huggingface.co/mistralai/Mixtral-8x22B-v0.1/blob/main/config.json",
              published_params=141e9, published_active_params=39e9,
              published_source="Mistral AI, 'Cheaper, Better, Faster, Stronger' (Mixtral 8x22B: "
                               "39B active parameters out of 141B)"),
    ModelArch(name="llama-3.1-405b", hf_id="meta-llama/Llama-3.1-405B", **_LLAMA,
              layers=126, hidden=16384, heads=128, kv_heads=8, head_dim=128, ffn=53248,
              vocab=128256, tied_embeddings=False, max_context=131072,
              source=_META_L2.format("Llama-3.1-405B"),
              published_params=406e9,
              published_source="Hugging Face model page (safetensors: 406B params); Llama 3 paper "
                               "(Grattafiori et al. 2024) Table 3: 126 layers, 16,384 wide, 8 KV heads"),
    ModelArch(name="llama-3.3-70b", hf_id="meta-llama/Llama-3.3-70B-Instruct", **_LLAMA,
              layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672,
              vocab=128256, tied_embeddings=False, max_context=131072,
              source=_META_L2.format("Llama-3.3-70B-Instruct"),
              published_params=70.6e9, published_source="Hugging Face model page (safetensors: 70.6B params)"),
    ModelArch(name="yi-34b", hf_id="01-ai/Yi-34B", family="llama",
              gated_mlp=True, activation="silu",
              layers=60, hidden=7168, heads=56, kv_heads=8, head_dim=128, ffn=20480,
              vocab=64000, tied_embeddings=False, max_context=4096,
              source="https://huggingface.co/01-ai/Yi-34B/blob/main/config.json",
              published_params=34.4e9, published_source="Hugging Face model page (safetensors: 34.4B params)"),
    ModelArch(name="opt-13b", hf_id="facebook/opt-13b", family="opt",
              gated_mlp=False, activation="relu", linear_bias=True, norm="layernorm",
              layers=40, hidden=5120, heads=40, kv_heads=40, head_dim=128, ffn=20480,
              vocab=50272, tied_embeddings=True, max_context=2048, learned_positions=2050,
              source="https://huggingface.co/facebook/opt-13b/blob/main/config.json",
              published_params=13e9, published_source="Zhang et al., 'OPT' (2022), Table 1: 13B"),
    ModelArch(name="opt-66b", hf_id="facebook/opt-66b", family="opt",
              gated_mlp=False, activation="relu", linear_bias=True, norm="layernorm",
              layers=64, hidden=9216, heads=72, kv_heads=72, head_dim=128, ffn=36864,
              vocab=50272, tied_embeddings=True, max_context=2048, learned_positions=2050,
              source="https://huggingface.co/facebook/opt-66b/blob/main/config.json",
              published_params=66e9, published_source="Zhang et al., 'OPT' (2022), Table 1: 66B"),
    ModelArch(name="bloom-176b", hf_id="bigscience/bloom", family="bloom",
              gated_mlp=False, activation="gelu", linear_bias=True, norm="layernorm",
              embedding_norm=True,
              layers=70, hidden=14336, heads=112, kv_heads=112, head_dim=128, ffn=57344,
              vocab=250880, tied_embeddings=True, max_context=2048,
              source="https://huggingface.co/bigscience/bloom/blob/main/config.json",
              published_params=176_247_271_424,
              published_source="bigscience/bloom model card: 176,247,271,424 parameters"),
    ModelArch(name="falcon-180b", hf_id="tiiuae/falcon-180B", family="falcon",
              gated_mlp=False, activation="gelu", norm="layernorm",
              layers=80, hidden=14848, heads=232, kv_heads=8, head_dim=64, ffn=59392,
              vocab=65024, tied_embeddings=True, max_context=2048,
              source="https://huggingface.co/tiiuae/falcon-180B/blob/main/config.json",
              published_params=180e9, published_source="tiiuae/falcon-180B model card: 180B parameters"),
)}
