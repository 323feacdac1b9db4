"""A Llama-style decoder in plain PyTorch, run token-packed over a paged KV cache.

Architecture (Llama 3): RMSNorm, rotary position embeddings (theta 500000,
optional llama3 frequency scaling), grouped-query attention, SwiGLU feed-forward,
untied LM head. The Q/K/V projections are fused into one matrix and gate/up into
another, so a layer is four GEMMs over all packed tokens.

The forward is *token-packed*: one call runs a flat list of tokens from many
sequences (one per decoding sequence, plus prefill chunks) through the linear
layers together; only attention looks at sequence boundaries, reading each
sequence's KV from the paged cache (``real_engine.kv``). ``decode`` and
``prefill`` are the two attention branches of that single forward.

Weights are random (seeded, created directly on the target device in the target
dtype: an 8B model is never built in fp32 on the host) or loaded from a local
Hugging Face Llama checkpoint (``config.json`` + ``*.safetensors``; the
``safetensors`` package is optional and imported only then). Rotary embeddings
use the HF ``rotate_half`` convention, so such weights load without permutation.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from real_engine.kv import PagedKVCache, StepMeta, decode_attention, prefill_attention, write_kv


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style model."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 8192
    head_dim_override: Optional[int] = None
    rope_scaling: Optional[dict] = field(default=None, compare=False, hash=False)

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.d_model // self.n_heads

    def num_params(self) -> int:
        """Parameter count (embedding and LM head counted separately: untied)."""
        d, D = self.d_model, self.head_dim
        attn = d * (self.n_heads + 2 * self.n_kv_heads) * D + self.n_heads * D * d
        mlp = 3 * d * self.ffn
        return 2 * self.vocab * d + self.n_layers * (attn + mlp + 2 * d) + d

    def shape_dict(self) -> dict:
        """The ``meta.model`` block of a profile."""
        return {"name": self.name, "n_layers": self.n_layers, "d_model": self.d_model,
                "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                "head_dim": self.head_dim, "ffn": self.ffn, "vocab": self.vocab,
                "params": self.num_params()}

    @classmethod
    def from_hf(cls, cfg: dict, name: str, source: str = "config.json") -> "ModelConfig":
        """From a Hugging Face Llama ``config.json`` mapping, read by the catalog's reader
        (``simulator.cost.catalog.hf``: one reader of config.json, every type and range
        checked); a model the engine cannot run, or a bad value, is one ``LatsimError``
        line naming ``source``, the field and the value."""
        from simulator.cost.catalog.hf import _Reader, arch_from_config
        a = arch_from_config(cfg, source=source, name=name)
        r = _Reader(cfg, source)
        if a.experts > 1 or not a.gated_mlp or a.norm != "rmsnorm" or a.linear_bias \
                or a.qkv_bias or a.qk_norm or a.learned_positions or a.sliding_window:
            r.fail("the real engine runs dense Llama-family models only (RMSNorm, SwiGLU, "
                   "rotary positions, no biases)", "model_type", cfg.get("model_type"))

        def positive(key: str, default: float) -> float:
            k, v = r.first(key)
            if k is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not math.isfinite(v) or v <= 0:
                r.fail("must be a positive number", key, v)
            return float(v)
        rs = cfg.get("rope_scaling")
        if rs is not None:
            if not isinstance(rs, dict):
                r.fail("must be an object or null", "rope_scaling", rs)
            for k in ("factor", "low_freq_factor", "high_freq_factor",
                      "original_max_position_embeddings"):
                v = rs.get(k)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                      or not math.isfinite(v) or v <= 0):
                    r.fail("must be a positive number", f"rope_scaling.{k}", v)
            if rs.get("rope_type", rs.get("type")) == "llama3":
                if rs.get("factor") is None:
                    r.fail("missing", "rope_scaling.factor", has_value=False)
                if rs.get("low_freq_factor", 1.0) >= rs.get("high_freq_factor", 4.0):
                    r.fail("must be below high_freq_factor", "rope_scaling.low_freq_factor",
                           rs.get("low_freq_factor", 1.0))
        return cls(name=name, n_layers=a.layers, d_model=a.hidden, n_heads=a.heads,
                   n_kv_heads=a.kv_heads, ffn=a.ffn, vocab=a.vocab,
                   rope_theta=positive("rope_theta", 10000.0),
                   norm_eps=positive("rms_norm_eps", 1e-5),
                   max_seq_len=min(a.max_context or 8192, 131072),
                   head_dim_override=a.head_dim if a.head_dim != a.hidden // a.heads else None,
                   rope_scaling=rs)


PRESETS: dict[str, ModelConfig] = {
    # Fast on a laptop CPU: for tests and end-to-end checks.
    "tiny": ModelConfig("tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn=192,
                        vocab=512, max_seq_len=4096),
    # A CPU model with real-size-ish per-layer shapes, profiled in a couple of minutes.
    "small": ModelConfig("small", n_layers=4, d_model=512, n_heads=8, n_kv_heads=2, ffn=1536,
                         vocab=16384, max_seq_len=8192),
    "llama3-1b": ModelConfig("llama3-1b", n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8,
                             ffn=8192, vocab=128256, max_seq_len=32768),
    "llama3-8b": ModelConfig("llama3-8b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
                             ffn=14336, vocab=128256, max_seq_len=32768),
    "llama3-70b": ModelConfig("llama3-70b", n_layers=80, d_model=8192, n_heads=64,
                              n_kv_heads=8, ffn=28672, vocab=128256, max_seq_len=32768),
}


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama 3.1's long-context scaling if configured.

    llama3 scaling keeps high frequencies (short wavelengths), divides low ones by
    ``factor`` and blends linearly in between.
    """
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) == "llama3":
        factor = rs["factor"]
        lo, hi = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        t = ((old / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)   # 0: low freq, 1: high
        inv = (1 - t) * inv / factor + t * inv
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, H, D]``) by its positions' angles (HF ``rotate_half`` layout).

    ``rotate_half(x) * sin`` equals ``roll(x, D/2) * [-sin, sin]`` (``sin_signed``):
    one roll instead of a negation and a concatenation, three kernels in all.
    """
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin_signed)


def _param(*shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class Block(nn.Module):
    """One decoder layer: attention and SwiGLU MLP, each pre-normed with a residual."""

    def __init__(self, cfg: ModelConfig, device, dtype) -> None:
        super().__init__()
        d, D = cfg.d_model, cfg.head_dim
        self.cfg = cfg
        self.attn_norm = _param(d, device=device, dtype=dtype)
        self.wqkv = _param((cfg.n_heads + 2 * cfg.n_kv_heads) * D, d, device=device, dtype=dtype)
        self.wo = _param(d, cfg.n_heads * D, device=device, dtype=dtype)
        self.ffn_norm = _param(d, device=device, dtype=dtype)
        self.w13 = _param(2 * cfg.ffn, d, device=device, dtype=dtype)   # gate; up
        self.w2 = _param(d, cfg.ffn, device=device, dtype=dtype)
        self.scale = D ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: StepMeta,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        T = x.shape[0]
        Hq, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        h = F.rms_norm(x, (cfg.d_model,), self.attn_norm, cfg.norm_eps)
        qkv = F.linear(h, self.wqkv)
        # Rotate q and k heads in one call: they are adjacent in the fused output.
        qk = apply_rope(qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D), cos, sin)
        q, k = qk[:, :Hq], qk[:, Hq:]
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
        write_kv(k_cache, v_cache, k, v, meta.write_rows)
        parts = []
        B = meta.n_decode
        if B:
            parts.append(decode_attention(q[:B], k_cache, v_cache, meta, self.scale))
        for c in meta.chunks:
            sl = slice(c.start, c.start + c.n)
            parts.append(prefill_attention(q[sl], k[sl], v[sl], k_cache, v_cache, c, self.scale))
        attn = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        # Residual adds folded into the output GEMMs (x + a @ W^T in one kernel).
        x = torch.addmm(x, attn, self.wo.t())
        h = F.rms_norm(x, (cfg.d_model,), self.ffn_norm, cfg.norm_eps)
        gate, up = F.linear(h, self.w13).chunk(2, dim=-1)
        return torch.addmm(x, F.silu(gate) * up, self.w2.t())


class Transformer(nn.Module):
    """The model. ``forward(meta, cache)`` -> last hidden states of every packed token;
    ``logits(hidden, rows)`` applies the final norm and LM head to the sampled rows only."""

    def __init__(self, cfg: ModelConfig, device="cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.embed = _param(cfg.vocab, cfg.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, device, dtype) for _ in range(cfg.n_layers))
        self.norm = _param(cfg.d_model, device=device, dtype=dtype)
        self.head = _param(cfg.vocab, cfg.d_model, device=device, dtype=dtype)
        ang = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), rope_inv_freq(cfg))
        cos = torch.cat((ang.cos(), ang.cos()), dim=-1)
        sin_signed = torch.cat((-ang.sin(), ang.sin()), dim=-1)
        self.register_buffer("rope_cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("rope_sin", sin_signed.to(device=device, dtype=dtype),
                             persistent=False)

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> "Transformer":
        """Seeded random weights: N(0, 1/fan_in) for matrices, N(0, 1) embeddings, unit norms."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm"):
                p.fill_(1.0)
            elif name == "embed":
                p.normal_(0.0, 1.0, generator=g)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
        return self

    def new_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        """A zeroed paged KV cache of ``num_blocks`` blocks shaped for this model."""
        c = self.cfg
        return PagedKVCache(c.n_layers, c.n_kv_heads, c.head_dim, num_blocks,
                            block_size=block_size, device=self.device, dtype=self.dtype)

    def forward(self, meta: StepMeta, cache: PagedKVCache) -> torch.Tensor:
        """Run every packed token of the step through all layers; writes their KV."""
        x = F.embedding(meta.tokens, self.embed)
        # Angles gathered once per step, broadcast over heads: [T, 1, D].
        cos = self.rope_cos.index_select(0, meta.positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, meta.positions).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, meta, cache.k[i], cache.v[i])
        return x

    def logits(self, hidden: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """LM head over ``hidden[rows]`` (all rows if None)."""
        h = hidden if rows is None else hidden.index_select(0, rows)
        return F.linear(F.rms_norm(h, (self.cfg.d_model,), self.norm, self.cfg.norm_eps), self.head)


# -- construction ---------------------------------------------------------------

def default_dtype(device) -> torch.dtype:
    """bf16 on a GPU, fp32 on the CPU (bf16 matmuls are slow and inexact there)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_config(model: str | ModelConfig) -> ModelConfig:
    """A preset name, a ``ModelConfig``, or a directory holding a HF ``config.json``."""
    if isinstance(model, ModelConfig):
        return model
    if model in PRESETS:
        return PRESETS[model]
    p = Path(model)
    if (p / "config.json").exists():
        from simulator.cost.catalog.hf import read_config
        cfg, source = read_config(p)
        return ModelConfig.from_hf(cfg, p.name, source)
    raise ValueError(f"unknown model {model!r}: not a preset ({', '.join(PRESETS)}) "
                     f"nor a directory with config.json")


def build_model(model: str | ModelConfig, device="cpu", dtype: Optional[torch.dtype] = None,
                seed: int = 0, max_seq_len: Optional[int] = None) -> Transformer:
    """A ready model: a preset/config with seeded random weights, or a local checkpoint dir."""
    cfg = resolve_config(model)
    if max_seq_len:
        cfg = replace(cfg, max_seq_len=max_seq_len)
    dtype = dtype or default_dtype(device)
    m = Transformer(cfg, device=device, dtype=dtype)
    if isinstance(model, str) and model not in PRESETS:
        load_safetensors_(m, Path(model))
    else:
        m.init_random_(seed)
    return m.eval()


_HF_MAP = {
    "input_layernorm.weight": ("attn_norm", None),
    "post_attention_layernorm.weight": ("ffn_norm", None),
    "self_attn.q_proj.weight": ("wqkv", 0),
    "self_attn.k_proj.weight": ("wqkv", 1),
    "self_attn.v_proj.weight": ("wqkv", 2),
    "self_attn.o_proj.weight": ("wo", None),
    "mlp.gate_proj.weight": ("w13", 0),
    "mlp.up_proj.weight": ("w13", 1),
    "mlp.down_proj.weight": ("w2", None),
}


@torch.no_grad()
def load_safetensors_(m: Transformer, path: Path) -> None:
    """Copy a HF Llama checkpoint's tensors into ``m``, one tensor at a time.

    Needs the optional ``safetensors`` package. A missing ``lm_head.weight``
    means tied embeddings: the head gets a copy of the embedding.
    """
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("loading weights needs the 'safetensors' package "
                          "(pip install safetensors)") from e
    cfg = m.cfg
    D = cfg.head_dim
    splits = {"wqkv": [cfg.n_heads * D, cfg.n_kv_heads * D, cfg.n_kv_heads * D],
              "w13": [cfg.ffn, cfg.ffn]}
    filled: set[str] = set()
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for key in fh.keys():
                t = fh.get_tensor(key)
                if key == "model.embed_tokens.weight":
                    dst, name = m.embed, "embed"
                elif key == "model.norm.weight":
                    dst, name = m.norm, "norm"
                elif key == "lm_head.weight":
                    dst, name = m.head, "head"
                elif key.startswith("model.layers."):
                    i, rest = key[len("model.layers."):].split(".", 1)
                    if rest not in _HF_MAP:
                        continue   # e.g. rotary_emb.inv_freq in old checkpoints
                    attr, part = _HF_MAP[rest]
                    dst = getattr(m.layers[int(i)], attr)
                    name = f"layers.{i}.{attr}" + ("" if part is None else f".{part}")
                    if part is not None:
                        dst = dst.split(splits[attr], dim=0)[part]
                else:
                    continue
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"{f.name}:{key}: shape {tuple(t.shape)}, model expects "
                                     f"{tuple(dst.shape)}")
                dst.copy_(t.to(dtype=m.dtype))
                filled.add(name)
    if "head" not in filled and "embed" in filled:
        m.head.copy_(m.embed)
        filled.add("head")
    expected = {"embed", "norm", "head"}
    for i in range(cfg.n_layers):
        for attr, part in _HF_MAP.values():
            expected.add(f"layers.{i}.{attr}" + ("" if part is None else f".{part}"))
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def config_dict(cfg: ModelConfig) -> dict:
    """A JSON-able dict of the config (for logs)."""
    d = asdict(cfg)
    d["head_dim"] = cfg.head_dim
    return d
