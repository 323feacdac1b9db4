"""Hardware/model catalogues, config.json parsing, serving memory arithmetic, Vidur reader.

Parameter counts are checked against each model's published count (sources in
data/catalog-sources.md); the memory plans against arithmetic written out here by hand.
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from simulator.cost import catalog
from simulator.cost.catalog import vidur
from simulator.cost.catalog.memory import GIB
from simulator.errors import LatsimError

REPO = Path(__file__).resolve().parents[1]
HF = Path(__file__).resolve().parent / "data" / "hf"


# -- GPU catalogue ----------------------------------------------------------------------
def test_required_gpus_are_catalogued_with_sources():
    for name in ("a10g", "l4", "l40s", "a100-40gb", "a100-80gb", "h100-80gb", "h100-pcie",
                 "h200", "b200", "mi300x"):
        g = catalog.gpu(name)
        assert g.source and g.bf16_tflops > 0 and g.memory_bw_gbs > 0 and g.sm_count > 0
        assert g.price_per_gpu_hour is None
        assert g.link_gbs_bidir == 2 * g.link_gbs_unidir
        # The allocatable memory is within 7% below the datasheet GB read as GiB.
        assert 0.93 * g.memory_gb * 2**30 <= g.memory_bytes <= 1.001 * g.memory_gb * 2**30


def test_gpu_rates_are_dense_not_sparse():
    h100 = catalog.gpu("h100-sxm")
    assert h100.name == "h100-80gb"
    assert h100.bf16_tflops == pytest.approx(989.4)          # 1,979 in the datasheet is sparse
    assert h100.fp8_tflops == pytest.approx(2 * h100.bf16_tflops, rel=1e-3)
    assert catalog.gpu("a100-80gb").fp8_tflops is None        # Ampere has no FP8
    assert catalog.gpu("a100").name == "a100-80gb"
    assert catalog.gpu("H200_SXM").memory_bytes == 143771 * 2**20
    assert catalog.gpu("mi300x").bf16_tflops == pytest.approx(1307.4)
    assert catalog.gpu("h100-80gb").link_gbs_unidir == 450    # NVLink 4: 900 GB/s both ways


# -- parameter counts vs published ------------------------------------------------------
# (model, published total, relative tolerance). Published counts are rounded to the
# digits given; OPT and Falcon are nominal sizes.
PUBLISHED = [
    ("llama-2-7b", 6.74e9, 0.001), ("llama-2-13b", 13.0e9, 0.005), ("llama-2-70b", 69.0e9, 0.002),
    ("llama-3-8b", 8.03e9, 0.001), ("llama-3-70b", 70.6e9, 0.001), ("llama-3.1-8b", 8.03e9, 0.001),
    ("llama-3.1-70b", 70.6e9, 0.001), ("mistral-7b", 7.24e9, 0.001), ("mixtral-8x7b", 46.7e9, 0.001),
    ("qwen2.5-7b", 7.61e9, 0.001), ("qwen2.5-72b", 72.7e9, 0.001), ("yi-34b", 34.4e9, 0.001),
    ("opt-13b", 13e9, 0.015), ("opt-66b", 66e9, 0.01), ("bloom-176b", 176_247_271_424, 0.0),
    ("falcon-180b", 180e9, 0.01),
]
# Models added for the vLLM runs (issue 30): (model, published total, digits after the
# point of the published figure in billions). The tolerance is what prints as the
# published figure (half a unit of its last digit, or truncated to it): anything that
# prints as it is right (a config shape off by one matrix misses it: Qwen3-14B
# without its LM head is 14.0B, Llama-3.1-405B with 16 KV heads 410.1B).
# Sources: the Qwen3 model cards ("Number of Parameters"), the codellama/CodeLlama-34b-hf
# and meta-llama/Llama-3.1-405B / Llama-3.3-70B-Instruct model pages (safetensors
# counts), Mistral AI's Mixtral 8x22B announcement (141B total, 39B active).
PUBLISHED_ROUNDED = [
    ("qwen3-0.6b", 0.6e9, 1), ("qwen3-1.7b", 1.7e9, 1), ("qwen3-4b", 4.0e9, 1),
    ("qwen3-8b", 8.2e9, 1), ("qwen3-14b", 14.8e9, 1), ("qwen3-32b", 32.8e9, 1),
    ("qwen3-30b-a3b", 30.5e9, 1), ("qwen3-235b-a22b", 235e9, 0),
    ("codellama-34b", 33.7e9, 1), ("mixtral-8x22b", 141e9, 0), ("llama-3.1-405b", 406e9, 0),
    ("llama-3.3-70b", 70.6e9, 1),
]
# Non-embedding counts the Qwen3 cards print beside the totals, and the MoE models'
# active (per-token) counts: (model, non-embedding, active, digits).
QWEN3_NON_EMBEDDING = [
    ("qwen3-0.6b", 0.44e9, 2), ("qwen3-1.7b", 1.4e9, 1), ("qwen3-4b", 3.6e9, 1),
    ("qwen3-8b", 6.95e9, 2), ("qwen3-14b", 13.2e9, 1), ("qwen3-32b", 31.2e9, 1),
    ("qwen3-30b-a3b", 29.9e9, 1), ("qwen3-235b-a22b", 234e9, 0),
]
MOE_ACTIVE = [("qwen3-30b-a3b", 3.3e9, 1), ("qwen3-235b-a22b", 22e9, 0), ("mixtral-8x22b", 39e9, 0)]


def _rounds_to(count: float, published: float, digits: int) -> bool:
    """Whether ``count`` prints as ``published`` (billions, ``digits`` after the point),
    rounded or truncated: Qwen3-30B-A3B's card prints 3.3B activated for 3.353B."""
    x, p, unit = count / 1e9, published / 1e9, 10.0 ** -digits
    return abs(x - p) <= 0.5 * unit + 1e-12 or p <= x < p + unit


@pytest.mark.parametrize("name,published,digits", PUBLISHED_ROUNDED)
def test_new_models_param_counts_round_to_the_published_figure(name, published, digits):
    arch = catalog.model(name)
    assert arch.published_params == pytest.approx(published)
    assert arch.source.startswith("https://huggingface.co/") and arch.published_source
    assert _rounds_to(arch.param_count(), published, digits), arch.param_count()


@pytest.mark.parametrize("name,non_embedding,digits", QWEN3_NON_EMBEDDING)
def test_qwen3_non_embedding_counts(name, non_embedding, digits):
    a = catalog.model(name)
    assert _rounds_to(a.param_count() - a.embedding_params() - a.lm_head_params(),
                      non_embedding, digits)


@pytest.mark.parametrize("name,active,digits", MOE_ACTIVE)
def test_moe_active_counts(name, active, digits):
    a = catalog.model(name)
    assert a.published_active_params == pytest.approx(active)
    assert _rounds_to(a.active_param_count(), active, digits), a.active_param_count()


def test_instruction_tuned_ids_name_their_base_shape():
    """An instruction-tuned sibling has its base model's shape (fine-tuning changes no
    shape number): the ids vLLM is launched with resolve to the base entry."""
    for hf_id, name in (("codellama/CodeLlama-34b-Instruct-hf", "codellama-34b"),
                        ("meta-llama/Llama-2-70b-chat-hf", "llama-2-70b"),
                        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
                        ("Llama-3.1-405B-Instruct", "llama-3.1-405b"),
                        ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.3-70b")):
        assert catalog.model(hf_id).name == name


def test_qwen3_shape_by_hand():
    """Qwen3-14B: head_dim 128 x 40 heads (= hidden 5120 here, but q/k norms of 128
    each per layer), untied; Qwen3-0.6B: q is 16 x 128 = 2048 wide on a 1024 model, tied."""
    q14 = catalog.model("Qwen/Qwen3-14B")
    d, f, L, V = 5120, 17408, 40, 151936
    per_layer = (d * 5120 + 2 * d * 1024 + 5120 * d) + 3 * d * f + 2 * d + 2 * 128
    assert q14.param_count() == L * per_layer + 2 * V * d + d == 14_768_307_200
    q06 = catalog.model("qwen3-0.6b")
    assert q06.q_dim == 2048 and q06.tied_embeddings and q06.lm_head_params() == 0
    per_layer = (1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024) + 3 * 1024 * 3072 + 2 * 1024 + 256
    assert q06.param_count() == 28 * per_layer + 151936 * 1024 + 1024
    # KV cache: 8 KV heads x 128 x K and V x 2 bytes x 40 layers per token.
    assert q14.kv_bytes_per_token() == 2 * 40 * 8 * 128 * 2


@pytest.mark.parametrize("name,published,tol", PUBLISHED)
def test_param_count_matches_published(name, published, tol):
    arch = catalog.model(name)
    assert arch.published_params == pytest.approx(published)
    if tol == 0.0:
        assert arch.param_count() == published
    else:
        assert arch.param_count() == pytest.approx(published, rel=tol)


def test_exact_counts_and_moe_active_parameters():
    assert catalog.model("llama-2-7b").param_count() == 6_738_415_616
    assert catalog.model("llama-3-8b").param_count() == 8_030_261_248
    mix = catalog.model("mixtral-8x7b")
    assert mix.param_count() == 46_702_792_704
    # Mistral AI: "46.7B total parameters but only uses 12.9B parameters per token".
    assert mix.active_param_count() == pytest.approx(12.9e9, rel=0.002)
    # Qwen2.5 model cards also give the non-embedding count.
    q7 = catalog.model("qwen2.5-7b")
    assert q7.param_count() - q7.embedding_params() - q7.lm_head_params() == pytest.approx(6.53e9, rel=0.001)


def test_every_required_model_is_catalogued_with_a_source():
    required = ["llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b",
                "llama-3.1-8b", "llama-3.1-70b", "mistral-7b", "mixtral-8x7b", "qwen2.5-7b",
                "qwen2.5-72b", "yi-34b", "opt-13b", "opt-66b", "bloom-176b"]
    for name in required:
        m = catalog.model(name)
        assert m.source.startswith("https://huggingface.co/") and m.published_source
    assert set(required) <= set(catalog.model_names())


# -- per-token work ---------------------------------------------------------------------
def test_per_token_work_terms_by_hand():
    l7 = catalog.model("llama-2-7b")
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008
    assert l7.linear_params_per_token() == 32 * per_layer
    assert l7.linear_flops_per_token() == 2 * 32 * per_layer
    assert l7.lm_head_flops_per_token() == 2 * 4096 * 32000
    assert l7.attn_flops_per_pair() == 4 * 32 * 128 * 32
    assert l7.kv_bytes_per_token("bf16") == 2 * 32 * 4096 * 2 == 512 * 1024
    assert catalog.model("llama-3-8b").kv_bytes_per_token("fp8") == 2 * 32 * 8 * 128 * 1
    # MoE: a token goes through 2 of the 8 experts plus the router.
    mix = catalog.model("mixtral-8x7b")
    attn = 4096 * (4096 + 2 * 1024) + 4096 * 4096
    assert mix.linear_params_per_token() == 32 * (attn + 2 * 3 * 4096 * 14336 + 4096 * 8)
    # GELU MLPs have two matrices.
    opt = catalog.model("opt-13b")
    assert opt.expert_linear_weights() == 2 * 5120 * 20480


def test_weight_bytes_per_format():
    l7 = catalog.model("llama-2-7b")
    linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    rest = l7.param_count() - linear                       # embeddings, head, norms: 16-bit
    assert l7.weight_bytes("bf16") == 2 * l7.param_count()
    assert l7.weight_bytes("fp8") == linear * 1 + 2 * rest
    assert l7.weight_bytes("int8") == linear * 1 + 2 * rest
    # int4: 0.5 B a weight + (fp16 scale + 4-bit zero) = 2.5 B per group of 128.
    assert l7.weight_bytes("int4") == pytest.approx(linear * (0.5 + 2.5 / 128) + 2 * rest)
    assert catalog.weight_format("awq").name == "int4"
    # On one GPU the per-GPU split adds up to the whole model, for every model and format.
    for m in catalog.MODELS.values():
        for fmt in ("bf16", "fp8", "int4"):
            assert catalog.weight_bytes_per_gpu(m, 1, 1, fmt) == pytest.approx(m.weight_bytes(fmt))


# -- memory arithmetic ------------------------------------------------------------------
H100_BYTES = 81559 * 2**20


@pytest.mark.parametrize("tp,expected_tokens", [(2, 33920), (4, 493648), (8, 1413120)])
def test_llama2_70b_memory_plan_matches_hand_arithmetic(tp, expected_tokens):
    plan = catalog.plan_memory("llama-2-70b", "h100-80gb", tp)
    h, layers = 8192, 80
    # Weights per GPU: attention q/o by heads, k/v by KV heads (8 divides every tp here),
    # MLP by intermediate, embedding and LM head by vocabulary rows; norms replicated.
    per_layer = (2 * h * h / tp + 2 * h * (8 // tp) * 128 + 3 * h * 28672 / tp + 2 * h)
    weights = 2 * (layers * per_layer + 2 * 32000 * h / tp + h)
    assert plan.weight_bytes_per_gpu == pytest.approx(weights)
    # Reserve: 8192 tokens x 2 B x (4h + QKV shard + gate/up and act shard) + fp32 logits.
    act = 8192 * 2 * (4 * h + (64 / tp + 2 * 8 / tp) * 128 + 3 * 28672 / tp) + 256 * 32000 * 4
    assert plan.activation_bytes == pytest.approx(act)
    assert plan.overhead_bytes == GIB
    kv_per_token = 2 * layers * (8 // tp) * 128 * 2               # bf16 K and V, own KV heads
    assert plan.kv_bytes_per_token_per_gpu == kv_per_token
    free = 0.9 * H100_BYTES - weights - act - GIB
    assert plan.kv_bytes_per_gpu == pytest.approx(free)
    assert plan.kv_blocks == math.floor(free / (kv_per_token * 16))
    assert plan.kv_tokens == plan.kv_blocks * 16 == expected_tokens
    assert plan.fits and plan.reason == ""
    assert "GiB" in plan.describe()


def test_plan_that_does_not_fit_is_refused_with_the_numbers():
    with pytest.raises(LatsimError) as e:
        catalog.plan_memory("llama-2-70b", "h100-80gb", tp=1)
    msg = str(e.value)
    assert "\n" not in msg and "does not fit" in msg
    assert "128.5 GiB" in msg and "71.7 GiB" in msg          # weights vs 0.9 x 79.6 GiB
    plan = catalog.plan_memory("llama-2-70b", "a100-40gb", tp=2, require_fit=False)
    assert not plan.fits and plan.kv_tokens == 0 and "64.2 GiB" in plan.reason
    # Fits the weights but not a full context of max_model_len tokens.
    with pytest.raises(LatsimError, match="fewer than max_model_len 131072"):
        catalog.plan_memory("llama-3.1-8b", "l4", max_model_len=131072)


def test_kv_heads_replicate_when_tp_exceeds_them_and_pp_splits_layers():
    p16 = catalog.plan_memory("llama-2-70b", "h100-80gb", tp=16)
    assert (p16.kv_heads_per_gpu, p16.kv_replication) == (1, 2)
    assert p16.kv_bytes_per_token_per_gpu == 2 * 80 * 1 * 128 * 2    # same as TP8
    pp = catalog.plan_memory("llama-2-70b", "h100-80gb", tp=4, pp=2)
    assert pp.layers_per_stage == 40
    assert pp.kv_bytes_per_token_per_gpu == 2 * 40 * 2 * 128 * 2
    first, last = pp.weight_bytes_per_stage
    assert last - first == pytest.approx(2 * 8192)                  # the final norm
    # Tied embeddings under PP: the last stage keeps its own copy for the LM head.
    opt = catalog.model("opt-13b")
    s1 = catalog.weight_bytes_per_stage(opt, tp=1, pp=1)
    s2 = catalog.weight_bytes_per_stage(opt, tp=1, pp=2)
    assert sum(s2) - s1[0] == pytest.approx(2 * 50272 * 5120)
    # KV dtype is independent of the weight format.
    fp8kv = catalog.plan_memory("llama-2-70b", "h100-80gb", tp=4, kv_dtype="fp8")
    assert fp8kv.kv_bytes_per_token_per_gpu == 2 * 80 * 2 * 128 * 1
    int4 = catalog.plan_memory("llama-2-70b", "h100-80gb", tp=1, weight_dtype="int4")
    assert int4.fits and int4.weight_bytes_per_gpu < 40 * GIB


def test_llama3_8b_plan_agrees_with_vllms_profiling_log():
    """vLLM on one H100 reports weights 14.96 GiB, activation peak 1.26 GiB, non-torch
    1.79 GiB and 53.29 GiB of KV cache at gpu_memory_utilization 0.9."""
    plan = catalog.plan_memory("llama-3-8b", "h100-80gb", overhead_gib=1.79)
    assert plan.weight_bytes_per_gpu / GIB == pytest.approx(14.96, abs=0.01)
    assert plan.activation_bytes / GIB == pytest.approx(1.26, rel=0.15)
    assert plan.kv_bytes_per_gpu / GIB == pytest.approx(53.29, rel=0.03)


def test_parallelism_checks_are_one_line_errors():
    with pytest.raises(LatsimError, match="must divide the 64 attention heads") as e:
        catalog.plan_memory("llama-2-70b", "h100-80gb", tp=3)
    assert "\n" not in str(e.value) and "got 3" in str(e.value)
    with pytest.raises(LatsimError, match="KV heads or be a multiple"):
        catalog.check_parallelism(catalog.model("qwen2.5-7b"), tp=14)
    with pytest.raises(LatsimError, match="must divide the 80 layers"):
        catalog.plan_memory("llama-2-70b", "h100-80gb", tp=8, pp=3)
    with pytest.raises(LatsimError, match="gpu_memory_utilization"):
        catalog.plan_memory("llama-2-7b", "h100", gpu_memory_utilization=1.5)


# -- lookup errors ----------------------------------------------------------------------
def test_unknown_names_suggest_the_nearest():
    with pytest.raises(LatsimError) as e:
        catalog.gpu("h100-sx")
    assert "h100-80gb" in str(e.value) and "got 'h100-sx'" in str(e.value)
    with pytest.raises(LatsimError, match="llama-2-70b"):
        catalog.model("lama-2-70b")
    assert catalog.model("meta-llama/Llama-2-70b-hf").name == "llama-2-70b"
    assert catalog.model("Mixtral-8x7B-v0.1").name == "mixtral-8x7b"


# -- Hugging Face config.json -----------------------------------------------------------
@pytest.mark.parametrize("fixture,name", [
    ("llama-2-7b.json", "llama-2-7b"), ("mixtral-8x7b.json", "mixtral-8x7b"),
    ("qwen2.5-7b.json", "qwen2.5-7b"), ("yi-34b.json", "yi-34b"), ("opt-13b.json", "opt-13b"),
    ("bloom-176b.json", "bloom-176b"), ("bloom-176b-old-keys.json", "bloom-176b"),
    ("falcon-180b.json", "falcon-180b"), ("qwen3-8b.json", "qwen3-8b"),
    ("qwen3-14b.json", "qwen3-14b"), ("qwen3-30b-a3b.json", "qwen3-30b-a3b"),
    ("mixtral-8x22b.json", "mixtral-8x22b"), ("codellama-34b.json", "codellama-34b"),
    ("llama-3.1-405b.json", "llama-3.1-405b"),
])
def test_real_configs_parse_to_the_catalogue_shapes(fixture, name):
    arch = catalog.model(HF / fixture)
    ref = catalog.model(name)
    for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab",
              "tied_embeddings", "gated_mlp", "experts", "experts_per_token", "qkv_bias",
              "linear_bias", "norm", "norms_per_layer", "embedding_norm", "learned_positions",
              "qk_norm", "dense_layers", "dense_ffn"):
        assert getattr(arch, f) == getattr(ref, f), f
    assert arch.param_count() == ref.param_count()


def test_model_folder_with_config_json(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text((HF / "llama-2-7b.json").read_text())
    arch = catalog.model(d)
    assert arch.name == "my-model" and arch.hf_id == "meta-llama/Llama-2-7b-hf"


def _write(tmp_path, cfg, name="config.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(cfg) if not isinstance(cfg, str) else cfg)
    return p


@pytest.mark.parametrize("change,field,snippet", [
    ({"hidden_size": None}, "hidden_size", "missing"),
    ({"num_attention_heads": "32"}, "num_attention_heads", "positive integer"),
    ({"num_key_value_heads": 5}, "num_key_value_heads", "must divide"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings", "true or false"),
    ({"num_local_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok", "exceeds"),
    ({"vocab_size": -1}, "vocab_size", "positive integer"),
])
def test_bad_configs_fail_in_one_line_naming_file_and_field(tmp_path, change, field, snippet):
    cfg = json.loads((HF / "llama-2-7b.json").read_text())
    for k, v in change.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    p = _write(tmp_path, cfg)
    with pytest.raises(LatsimError) as e:
        catalog.load_config(p)
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg and f"field '{field}'" in msg and snippet in msg


def _small_qwen3_moe(**change) -> dict:
    cfg = {"model_type": "qwen3_moe", "num_hidden_layers": 6, "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "intermediate_size": 96, "moe_intermediate_size": 16, "num_experts": 8,
           "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "vocab_size": 100, "tie_word_embeddings": False, "max_position_embeddings": 512}
    cfg.update(change)
    return cfg


@pytest.mark.parametrize("change,dense", [
    ({}, 0),
    ({"mlp_only_layers": [0, 5]}, 2),
    ({"decoder_sparse_step": 2}, 3),                          # layers 1, 3, 5 sparse
    ({"decoder_sparse_step": 3, "mlp_only_layers": [2]}, 5),  # layer 5 sparse only
])
def test_qwen3_moe_config_dense_and_sparse_layers_by_hand(tmp_path, change, dense):
    """transformers' Qwen3-MoE: layer i is sparse unless it is in mlp_only_layers or
    (i + 1) % decoder_sparse_step != 0; dense layers get an intermediate_size MLP."""
    a = catalog.model(_write(tmp_path, _small_qwen3_moe(**change)))
    assert a.family == "qwen3_moe" and a.qk_norm and a.head_dim == 32 and a.q_dim == 128
    assert (a.dense_layers, a.ffn, a.experts, a.experts_per_token) == (dense, 16, 8, 2)
    assert a.dense_ffn == (96 if dense else 0)
    d, sparse = 64, 6 - dense
    attn = d * 128 + 2 * d * 64 + 128 * d
    norms = 2 * d + 2 * 32
    expert, router, dense_mlp = 3 * d * 16, d * 8, 3 * d * 96
    total = 6 * (attn + norms) + sparse * (8 * expert + router) + dense * dense_mlp
    assert a.param_count() == total + 2 * 100 * d + d
    active = 6 * (attn + norms) + sparse * (2 * expert + router) + dense * dense_mlp
    assert a.active_param_count() == active + 2 * 100 * d + d
    assert a.linear_params_per_token() == 6 * attn + sparse * (2 * expert + router) + dense * dense_mlp
    # The roofline reads every stored expert at most, and routes only the sparse layers'.
    from simulator.cost import physics as ph
    from simulator.cost.roofline.constants import build_constants
    c = build_constants(a, catalog.gpu("h100"))
    assert c[ph.C_PARAMS_READ] == 6 * attn + sparse * (8 * expert + router) + dense * dense_mlp
    assert c[ph.C_EXPERT_PARAMS] == sparse * expert
    assert c[ph.C_FFN] == pytest.approx((sparse * 2 * 16 + dense * 96) / 6)
    # Weight memory on one GPU: the same stored linears in bf16, plus embeddings and norms.
    assert catalog.weight_bytes_per_gpu(a) == pytest.approx(2.0 * a.param_count())


def test_qwen3_config_defaults_and_refusals(tmp_path):
    # transformers' Qwen3Config defaults head_dim to 128 (not hidden / heads = 16 here).
    cfg = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
           "vocab_size": 100}
    a = catalog.model(_write(tmp_path, cfg))
    assert a.head_dim == 128 and a.qk_norm and not a.tied_embeddings and not a.qkv_bias
    assert catalog.model(_write(tmp_path, {**cfg, "tie_word_embeddings": True})).lm_head_params() == 0
    # A qwen3_moe config without moe_intermediate_size, an MLA config without its rotary
    # width: one line each (MLA is read for DeepSeek: tests/test_catalog_mla.py).
    for bad, field in ((_small_qwen3_moe(moe_intermediate_size=None), "moe_intermediate_size"),
                       (_small_qwen3_moe(mlp_only_layers=[6]), "mlp_only_layers"),
                       (_small_qwen3_moe(mlp_only_layers="0"), "mlp_only_layers"),
                       (_small_qwen3_moe(decoder_sparse_step=0), "decoder_sparse_step"),
                       ({**cfg, "model_type": "deepseek_v3", "kv_lora_rank": 512,
                         "n_routed_experts": 256}, "qk_rope_head_dim"),
                       ({**cfg, "model_type": "llama", "n_shared_experts": 2},
                        "n_shared_experts")):
        with pytest.raises(LatsimError) as e:
            catalog.model(_write(tmp_path, bad))
        msg = str(e.value)
        assert field in msg and "config.json" in msg and "\n" not in msg, msg


def test_unreadable_configs(tmp_path):
    with pytest.raises(LatsimError, match="not valid JSON"):
        catalog.load_config(_write(tmp_path, "{ not json"))
    with pytest.raises(LatsimError, match="no such config.json"):
        catalog.model(tmp_path / "missing.json")
    with pytest.raises(LatsimError, match="word_embed_proj_dim"):
        cfg = json.loads((HF / "opt-13b.json").read_text())
        cfg["word_embed_proj_dim"] = 512
        catalog.load_config(_write(tmp_path, cfg, "opt.json"))


# -- Vidur profiles ---------------------------------------------------------------------
def _git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_vidur_copies_are_byte_identical_to_the_source_blobs():
    blobs = {
        "compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv": "479ed2f6ed22049ac444bca9fa44578532cbf28a",
        "compute/a100/meta-llama/Llama-2-70b-hf/mlp.csv": "6f53232adc5acdae0e06226720bcc948a466f954",
        "compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv": "36db734a6943305b540bec7544002b12cc74639b",
        "compute/a100/meta-llama/Meta-Llama-3-70B/mlp.csv": "6ddf5612f1704219b0bf3d41a15c2cf5ca3e8f1d",
        "compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv": "661ea954e9508d67f37d3b24f0e07eb96f83ca46",
        "compute/h100/meta-llama/Llama-2-70b-hf/mlp.csv": "7f469cdea36cca4e571f50854a4e9b61654b91e0",
        "network/a100_dgx/all_reduce.csv": "730776436cbd9e3e40aae50768e2b64921dd0379",
        "network/h100_dgx/all_reduce.csv": "a7a2470393d9ad8786e2423f081d01f8997b4bdb",
    }
    base = vidur.DEFAULT_ROOT / "profiling"
    for rel, blob in blobs.items():
        assert _git_blob_id(base / rel) == blob, rel
    assert (vidur.DEFAULT_ROOT / "LICENSE").read_text().count("MIT License") == 1


def test_vidur_mlp_tables_as_arrays_match_the_catalogue_shapes():
    tables = vidur.read_mlp("a100-80gb", "llama-2-70b")
    assert sorted(tables) == [1, 2, 4, 8]
    t1, t8 = tables[1], tables[8]
    assert t1.tokens[0] == 1 and t1.tokens[-1] == 4096 and np.all(np.diff(t1.tokens) > 0)
    assert all(len(v) == len(t1.tokens) for v in t1.ops.values())
    arch = catalog.model("llama-2-70b")
    assert (t1.shape["n_embd"], t1.shape["n_head"], t1.shape["n_kv_head"],
            t1.shape["n_expanded_embd"]) == (arch.hidden, arch.heads, arch.kv_heads, arch.ffn)
    # Large GEMMs scale with tokens and shrink with TP (each row is one GPU's shard).
    big = t1.tokens == 4096
    assert t1.gemm_ms()[big][0] > 10 * t1.gemm_ms()[t1.tokens == 128][0]
    assert t8.gemm_ms()[big][0] < t1.gemm_ms()[big][0] / 4
    assert t1.layer_ms()[big][0] > t1.gemm_ms()[big][0]
    # H100 beats A100 on the same shapes.
    h = vidur.read_mlp("h100", "meta-llama/Llama-2-70b-hf")[1]
    assert h.gemm_ms()[h.tokens == 4096][0] < t1.gemm_ms()[big][0]
    l3 = vidur.read_mlp("a100", "llama-3-8b", stat="mean")[2]
    assert l3.tokens[-1] == 32768 and l3.shape["vocab_size"] == 128256


def test_vidur_all_reduce_tables():
    ar = vidur.read_collective("h100_dgx")
    assert sorted(ar) == [(2, 2), (4, 4), (8, 8)]
    t = ar[(8, 8)]
    assert t.size_bytes[0] == 2048 and t.size_bytes[-1] == 64 * 2**20
    assert t.ms[-1] > 5 * t.ms[0]
    assert (16, 8) in vidur.read_collective("a100_dgx")        # two nodes
    with pytest.raises(LatsimError, match="no such Vidur profile file"):
        vidur.read_mlp("h100", "llama-3-70b")
    with pytest.raises(LatsimError, match="no Vidur profile device"):
        vidur.read_mlp("b200", "llama-2-7b")


# -- published step times ---------------------------------------------------------------
def test_published_step_times_table_is_well_formed():
    with open(REPO / "data" / "published-step-times.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == ["source", "model", "gpu", "tp", "pp", "kind", "batch",
                                      "prompt_or_context", "ms", "notes"]
    for r in rows:
        assert r["source"] and r["notes"]
        assert r["kind"] in ("prefill", "decode")
        catalog.model(r["model"])
        catalog.gpu(r["gpu"])
        assert int(r["tp"]) >= 1 and int(r["pp"]) >= 1 and int(r["batch"]) >= 1
        assert float(r["ms"]) > 0
    assert not any("splitwise" in r["source"].lower() for r in rows)
