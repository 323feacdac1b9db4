"""Read a Hugging Face ``config.json`` into a :class:`ModelArch`.

Understands the key spellings of the Llama family (Llama, Mistral, Mixtral, Qwen2,
Yi), OPT, BLOOM and Falcon: ``num_hidden_layers``/``n_layer``,
``hidden_size``/``n_embed``/``d_model``, ``num_attention_heads``/``n_head``,
``num_key_value_heads``/``num_kv_heads``/``multi_query``, ``head_dim``,
``intermediate_size``/``ffn_dim``/``n_inner``/``ffn_hidden_size``, ``vocab_size``,
``tie_word_embeddings``, ``num_local_experts``/``num_experts``,
``num_experts_per_tok``, ``max_position_embeddings``/``seq_length``; Qwen3 (``qwen3``:
per-head q/k RMSNorm, an explicit ``head_dim``) and Qwen3-MoE (``qwen3_moe``:
``moe_intermediate_size`` experts, dense layers by ``decoder_sparse_step`` and
``mlp_only_layers``); DeepSeek-V2/V3 (``deepseek_v2``, ``deepseek_v3``: multi-head
latent attention from ``kv_lora_rank``, ``q_lora_rank``, ``qk_nope_head_dim``,
``qk_rope_head_dim``, ``v_head_dim``; ``n_shared_experts`` shared experts of
``moe_intermediate_size``; dense layers by ``first_k_dense_replace`` and
``moe_layer_freq``) and Qwen2-MoE's ``shared_expert_intermediate_size``. Latent
attention in any other family is refused, not misread.

Defaults follow the transformers config classes of each family where a key is
absent: Llama-family configs default to untied embeddings, OPT/BLOOM/Falcon (and any
other ``model_type``, as transformers' base config does) to tied; BLOOM and Falcon
MLPs are 4 x hidden and ungated, Llama-family MLPs gated (SwiGLU). A config without
``model_type`` is read as Llama-family. Anything missing or malformed is one
:class:`~simulator.errors.LatsimError` line naming the file, the field and the value.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from simulator.errors import LatsimError
from simulator.cost.catalog.models import ModelArch

# Families whose MLP is gated (SwiGLU: gate, up, down) and whose configs use the
# Llama spellings; transformers' config classes default them to untied embeddings.
_LLAMA_LIKE = {"llama", "mistral", "mixtral", "qwen2", "yi", "internlm", "internlm2",
               "codellama", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3"}
# DeepSeek-V2/V3: multi-head latent attention and shared experts (``_deepseek``).
_DEEPSEEK = {"deepseek_v2", "deepseek_v3"}
# Qwen3: RMSNorm on each head's q and k; transformers' Qwen3Config defaults head_dim to
# 128 (not hidden / heads), Qwen3MoeConfig falls back to hidden / heads.
_QK_NORM = {"qwen3", "qwen3_moe"}
_HEAD_DIM_DEFAULT = {"qwen3": 128}
# Attention or MoE layouts the shape cannot hold: refused rather than misread.
_UNMODELLED = {
    "kv_lora_rank": "multi-head latent attention is read for DeepSeek-V2/V3 "
                    "(model_type deepseek_v2/deepseek_v3) only",
    "q_lora_rank": "multi-head latent attention is read for DeepSeek-V2/V3 "
                   "(model_type deepseek_v2/deepseek_v3) only",
    "n_shared_experts": "shared experts are read for DeepSeek-V2/V3 and Qwen2-MoE only",
}
_TIED_BY_DEFAULT = {"opt", "bloom", "falcon", "refinedweb", "refinedwebmodel", "gpt2", "gpt_neox"}


class _Reader:
    """Typed access to one config mapping; every error names the file and the field."""

    def __init__(self, cfg: dict, source: str) -> None:
        self.cfg = cfg
        self.source = source

    def fail(self, message: str, field: str, value: Any = None, has_value: bool = True):
        """Raise the one-line error for ``field``."""
        raise LatsimError(message, source=self.source, field=field, value=value, has_value=has_value)

    def first(self, *keys: str) -> tuple[str | None, Any]:
        """The first of ``keys`` present with a non-null value, and that value."""
        for k in keys:
            if k in self.cfg and self.cfg[k] is not None:
                return k, self.cfg[k]
        return None, None

    def int_(self, *keys: str, default: int | None = None, required: bool = True) -> int | None:
        """A positive integer under the first present key (``keys`` are alternative spellings)."""
        key, val = self.first(*keys)
        if key is None:
            if default is not None or not required:
                return default
            self.fail("missing (also looked for " + ", ".join(keys[1:]) + ")" if len(keys) > 1
                      else "missing", keys[0], has_value=False)
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            self.fail("must be a positive integer", key, val)
        return val

    def bool_(self, key: str, default: bool) -> bool:
        """A JSON boolean, or ``default`` when absent or null."""
        if key not in self.cfg or self.cfg[key] is None:
            return default
        val = self.cfg[key]
        if not isinstance(val, bool):
            self.fail("must be true or false", key, val)
        return val


def _family(r: _Reader) -> str:
    mt = r.cfg.get("model_type")
    if mt is None:
        return "llama"   # untagged configs are almost always Llama derivatives
    if not isinstance(mt, str):
        r.fail("must be a string", "model_type", mt)
    return mt.lower()


def arch_from_config(cfg: dict, source: str = "config.json", name: str | None = None) -> ModelArch:
    """A :class:`ModelArch` from an already-parsed config.json mapping."""
    if not isinstance(cfg, dict):
        raise LatsimError("a config.json must hold a JSON object", source=source)
    r = _Reader(cfg, source)
    fam = _family(r)
    falcon = fam in ("falcon", "refinedweb", "refinedwebmodel")
    layers = r.int_("num_hidden_layers", "n_layer", "num_layers")
    hidden = r.int_("hidden_size", "n_embed", "n_embd", "d_model")
    heads = r.int_("num_attention_heads", "n_head", "num_heads")

    if falcon:
        new_arch = r.bool_("new_decoder_architecture", False)
        if new_arch:
            kv_heads = r.int_("num_kv_heads", "n_head_kv", default=heads)
        else:
            kv_heads = 1 if r.bool_("multi_query", True) else heads
    else:
        kv_heads = r.int_("num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads)
    if heads % kv_heads:
        r.fail(f"must divide num_attention_heads ({heads})", "num_key_value_heads", kv_heads)

    mla: dict[str, Any] = {}
    if fam in _DEEPSEEK:
        mla = _deepseek(r)
        kv_heads = 1            # one cached latent, shared by every head (ModelArch)
    else:
        for key, why in _UNMODELLED.items():
            if cfg.get(key):
                r.fail(why, key, cfg[key])
    head_dim = (mla.pop("head_dim", None) or r.int_("head_dim", required=False)
                or _HEAD_DIM_DEFAULT.get(fam))
    if head_dim is None:
        if hidden % heads:
            r.fail(f"is not a multiple of num_attention_heads ({heads}) and no head_dim is given",
                   "hidden_size", hidden)
        head_dim = hidden // heads

    gated = fam in _LLAMA_LIKE or (fam not in _TIED_BY_DEFAULT and "intermediate_size" in cfg)
    if fam in ("bloom",) or falcon:
        ffn = r.int_("ffn_hidden_size", "n_inner", "intermediate_size", default=4 * hidden)
    else:
        ffn = r.int_("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size")
    vocab = r.int_("vocab_size", "padded_vocab_size")

    experts = r.int_("num_local_experts", "num_experts", "n_routed_experts", default=1)
    top_k = r.int_("num_experts_per_tok", "num_experts_per_token", "moe_top_k",
                   default=2 if experts > 1 else 1)
    if top_k > experts:
        r.fail(f"exceeds the number of experts ({experts})", "num_experts_per_tok", top_k)
    dense_layers, dense_ffn, shared_ffn = 0, 0, 0
    if experts > 1 and ("moe_intermediate_size" in cfg or fam == "qwen3_moe"):
        # Qwen3-MoE, DeepSeek: the experts' width is its own key; intermediate_size is
        # the width of the dense MLP of layers that are not sparse.
        dense_layers = (_deepseek_dense_layers(r, layers) if fam in _DEEPSEEK
                        else _dense_layers(r, layers))
        dense_ffn, ffn = ffn, r.int_("moe_intermediate_size")
        if fam in _DEEPSEEK:
            shared_ffn = r.int_("n_shared_experts", default=0, required=False) * ffn
    if experts > 1 and cfg.get("shared_expert_intermediate_size") is not None:
        shared_ffn = r.int_("shared_expert_intermediate_size")   # Qwen2-MoE

    tied = r.bool_("tie_word_embeddings", fam in _TIED_BY_DEFAULT or fam not in _LLAMA_LIKE)
    max_ctx = r.int_("max_position_embeddings", "n_positions", "seq_length",
                     "max_sequence_length", required=False)
    _, act = r.first("hidden_act", "activation_function", "hidden_activation")
    if act is None:
        act = "silu" if gated else ("relu" if fam == "opt" else "gelu")

    kw: dict[str, Any] = {}
    if fam == "opt":
        proj = r.int_("word_embed_proj_dim", default=hidden)
        if proj != hidden:
            r.fail(f"differs from hidden_size ({hidden}); OPT embedding projections are not modelled",
                   "word_embed_proj_dim", proj)
        if max_ctx is None:
            r.fail("missing", "max_position_embeddings", has_value=False)
        kw.update(linear_bias=r.bool_("enable_bias", True), norm="layernorm",
                  learned_positions=max_ctx + 2,   # OPT's position table is offset by 2
                  final_norm=r.bool_("do_layer_norm_before", True)
                  and not r.bool_("_remove_final_layer_norm", False))
    elif fam == "bloom":
        kw.update(linear_bias=True, norm="layernorm", embedding_norm=True)
    elif falcon:
        new_arch = r.bool_("new_decoder_architecture", False)
        parallel = r.bool_("parallel_attn", True)
        kw.update(linear_bias=r.bool_("bias", False), norm="layernorm",
                  norms_per_layer=2 if (new_arch or not parallel) else 1)
    else:
        kw.update(qkv_bias=r.bool_("attention_bias", fam in ("qwen2", "qwen2_moe")))
        sw = cfg.get("sliding_window")
        if isinstance(sw, int) and not isinstance(sw, bool) and sw > 0 and r.bool_("use_sliding_window", True):
            kw["sliding_window"] = sw

    hf_id = cfg.get("_name_or_path") or ""
    return ModelArch(
        name=name or _default_name(source, fam),
        hf_id=str(hf_id), family=fam, layers=layers, hidden=hidden, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, ffn=ffn, vocab=vocab, tied_embeddings=tied,
        gated_mlp=gated, activation=str(act), max_context=max_ctx,
        experts=experts, experts_per_token=top_k if experts > 1 else 1,
        dense_layers=dense_layers, dense_ffn=dense_ffn if dense_layers else 0,
        shared_ffn=shared_ffn, qk_norm=fam in _QK_NORM, source=str(source), **mla, **kw)


def _deepseek(r: _Reader) -> dict[str, Any]:
    """DeepSeek-V2/V3's latent attention: the ModelArch fields (``head_dim`` is a
    query/key head's width, its no-rope part plus its rope part)."""
    kv_lora = r.int_("kv_lora_rank")
    rope = r.int_("qk_rope_head_dim")
    nope = r.int_("qk_nope_head_dim")
    return {"kv_lora_rank": kv_lora, "q_lora_rank": r.int_("q_lora_rank", default=0,
                                                           required=False),
            "qk_rope_dim": rope, "v_head_dim": r.int_("v_head_dim"), "head_dim": nope + rope}


def _deepseek_dense_layers(r: _Reader, layers: int) -> int:
    """How many layers of a DeepSeek config have a dense MLP: transformers' DeepSeek
    models make layer ``i`` sparse when ``i >= first_k_dense_replace`` and ``i %
    moe_layer_freq == 0``."""
    first = r.cfg.get("first_k_dense_replace", 0)
    if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= layers:
        r.fail(f"must be an integer 0..{layers}", "first_k_dense_replace", first)
    freq = r.int_("moe_layer_freq", default=1)
    return sum(1 for i in range(layers) if not (i >= first and i % freq == 0))


def _dense_layers(r: _Reader, layers: int) -> int:
    """How many layers of a Qwen3-MoE-style config have a dense MLP: transformers makes
    layer ``i`` sparse when it is not in ``mlp_only_layers`` and ``(i + 1) %
    decoder_sparse_step == 0``."""
    step = r.int_("decoder_sparse_step", default=1)
    only = r.cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                         or not 0 <= i < layers for i in only):
        r.fail(f"must be a list of layer indices 0..{layers - 1}", "mlp_only_layers", only)
    only = set(only)
    return sum(1 for i in range(layers) if i in only or (i + 1) % step != 0)


def _default_name(source: str, fam: str) -> str:
    """A model folder's name for '<folder>/config.json', else the file's stem."""
    p = Path(source)
    return (p.parent.name if p.stem == "config" else p.stem) or fam


def load_config(path: str | Path, name: str | None = None) -> ModelArch:
    """Read a config.json file (or a model folder holding one) into a :class:`ModelArch`."""
    cfg, source = read_config(path)
    return arch_from_config(cfg, source=source, name=name)


def read_config(path: str | Path) -> tuple[Any, str]:
    """The parsed JSON of a config.json file (or a model folder holding one) and the
    file's path; an unreadable or non-JSON file is one ``LatsimError`` line."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise LatsimError("no such config.json", source=str(p))
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LatsimError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                          source=str(p)) from None
    except RecursionError:   # nested 10^5 deep: name this file, not the scenario
        raise LatsimError("not valid JSON: nested too deeply", source=str(p)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise LatsimError(f"cannot read: {e}", source=str(p)) from None
    return cfg, str(p)
