"""DeepSeek-V2/V3 in the catalogue and the config reader: multi-head latent attention
(MLA) and shared experts, checked against the published parameter counts and by hand
arithmetic from the models' config.json."""
from __future__ import annotations

import json

import pytest

from simulator.cost import catalog
from simulator.errors import LatsimError

# deepseek-ai/DeepSeek-V3 config.json (huggingface.co/deepseek-ai/DeepSeek-V3), the keys
# the shape reads; "num_key_value_heads" is 128 there (transformers' MLA ignores it for
# the cache: one latent per token).
V3_CONFIG = {
    "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
    "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "max_position_embeddings": 163840, "tie_word_embeddings": False, "hidden_act": "silu",
    "attention_bias": False,
}
SHAPE = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "experts",
         "experts_per_token", "dense_layers", "dense_ffn", "shared_ffn", "kv_lora_rank",
         "q_lora_rank", "qk_rope_dim", "v_head_dim", "tied_embeddings", "gated_mlp")


def test_deepseek_v3_counts_by_hand():
    """Per layer (config.json): q_a 7168x1536, q_b 1536x128x192, kv_a 7168x(512+64),
    kv_b 512x128x(128+128), o 128x128x7168, norms of 1536 and 512 in the attention
    and two of 7168; 3 dense MLPs of 18432, 58 MoE layers of 256 routed experts of
    2048, one shared of 2048 and a 7168x256 router; embedding and head 129280x7168.
    Total 671.03B against the report's 671B; 37.6B touched per token."""
    a = catalog.model("deepseek-v3")
    attn = (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256
            + 128 * 128 * 7168)
    assert a.attn_linear_weights() == attn == 187_105_280
    expert = 3 * 7168 * 2048
    norms = 1536 + 512 + 2 * 7168
    blocks = (61 * (attn + norms) + 3 * 3 * 7168 * 18432
              + 58 * (256 * expert + expert + 7168 * 256))
    assert a.blocks_params() == blocks
    assert a.param_count() == blocks + 2 * 129280 * 7168 + 7168 == 671_026_404_352
    active = (61 * (attn + norms) + 3 * 3 * 7168 * 18432 + 58 * (9 * expert + 7168 * 256)
              + 2 * 129280 * 7168 + 7168)
    assert a.active_param_count() == active
    # The KV cache: the 512-wide latent and the 64-wide rotary key, one copy a layer.
    assert a.kv_bytes_per_token("bf16") == 61 * 576 * 2 == 70_272
    assert a.kv_bytes_per_token("fp8") == 61 * 576
    # MLA's down-projections are held whole by every GPU of a TP group.
    assert a.attn_replicated_weights() == 7168 * (1536 + 512 + 64)
    # Attention work per (query, key) pair and head: prefill on up-projected 192-wide
    # keys and 128-wide values; decode on the 576-wide latent (q.k) and 512 (sum).
    assert a.attn_pair_dims() == 192 + 128
    assert a.attn_pair_dims(decode=True) == 576 + 512
    assert a.attn_flops_per_pair() == 2 * 128 * 61 * 320


@pytest.mark.parametrize("name,total,total_digits,active,active_digits", [
    # DeepSeek-V3 Technical Report (arXiv 2412.19437): 671B total, 37B activated;
    # deepseek-ai/DeepSeek-V2-Lite model card: 15.7B total, 2.4B activated.
    ("deepseek-v3", 671e9, 0, 37e9, 0), ("deepseek-v2-lite", 15.7e9, 1, 2.4e9, 1)])
def test_deepseek_counts_print_as_published(name, total, total_digits, active, active_digits):
    """The totals print as published; so do the activated counts without the input
    embedding (a lookup, no weight multiplied through: DeepSeek's figures leave it out:
    V2-Lite's 2.66B with it is 2.45B without, V3's 37.55B is 36.63B)."""
    from test_catalog import _rounds_to
    a = catalog.model(name)
    assert a.published_params == pytest.approx(total)
    assert a.published_active_params == pytest.approx(active)
    assert _rounds_to(a.param_count(), total, total_digits), a.param_count()
    assert _rounds_to(a.active_param_count() - a.embedding_params(), active,
                      active_digits), a.active_param_count()


def test_config_reader_gives_the_catalogue_shape(tmp_path):
    """DeepSeek-V3's config.json reads into the catalogue's shape, field by field."""
    p = tmp_path / "DeepSeek-V3" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(V3_CONFIG))
    got, want = catalog.model(str(p)), catalog.model("deepseek-v3")
    for f in SHAPE:
        assert getattr(got, f) == getattr(want, f), f
    assert got.is_mla and got.family == "deepseek_v3"
    assert got.param_count() == want.param_count()
    # V2-Lite: no query bottleneck (q_lora_rank null), two shared experts, 1 dense layer.
    lite = dict(V3_CONFIG, model_type="deepseek_v2", num_hidden_layers=27, hidden_size=2048,
                num_attention_heads=16, num_key_value_heads=16, intermediate_size=10944,
                moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2,
                num_experts_per_tok=6, first_k_dense_replace=1, q_lora_rank=None,
                vocab_size=102400)
    p2 = tmp_path / "lite.json"
    p2.write_text(json.dumps(lite))
    got2, want2 = catalog.model(str(p2)), catalog.model("deepseek-v2-lite")
    for f in SHAPE:
        assert getattr(got2, f) == getattr(want2, f), f


def test_latent_attention_elsewhere_and_bad_values_are_one_line_errors(tmp_path):
    """MLA keys in another family stay refused (not misread); a bad DeepSeek value names
    the file and the field."""
    p = tmp_path / "config.json"
    p.write_text(json.dumps(dict(V3_CONFIG, model_type="llama")))
    with pytest.raises(LatsimError) as e:
        catalog.model(str(p))
    assert "kv_lora_rank" in str(e.value) and "\n" not in str(e.value)
    p.write_text(json.dumps(dict(V3_CONFIG, first_k_dense_replace=99)))
    with pytest.raises(LatsimError) as e:
        catalog.model(str(p))
    assert "first_k_dense_replace" in str(e.value) and str(p) in str(e.value)
    p.write_text(json.dumps(dict(V3_CONFIG, kv_lora_rank=0)))
    with pytest.raises(LatsimError) as e:
        catalog.model(str(p))
    assert "kv_lora_rank" in str(e.value)


def test_qwen2_moe_shared_expert_counts_as_published(tmp_path):
    """Qwen1.5-MoE-A2.7B's config.json (huggingface.co/Qwen/Qwen1.5-MoE-A2.7B): 60
    experts of 1408, top 4, a shared expert of 5632, q/k/v biases; its model card gives
    14.3B parameters, 2.7B activated."""
    from test_catalog import _rounds_to
    cfg = {"model_type": "qwen2_moe", "num_hidden_layers": 24, "hidden_size": 2048,
           "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 5632,
           "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
           "num_experts": 60, "num_experts_per_tok": 4, "vocab_size": 151936,
           "tie_word_embeddings": False}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    a = catalog.model(str(p))
    assert a.shared_ffn == 5632 and a.qkv_bias and a.dense_layers == 0
    assert _rounds_to(a.param_count(), 14.3e9, 1), a.param_count()
    assert _rounds_to(a.active_param_count(), 2.7e9, 1), a.active_param_count()


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_mla_physics_terms_by_hand(tp):
    """The roofline prices DeepSeek-V3's attention as MLA: every GPU caches and reads
    the whole 576-element latent (70,272 B a token in bf16, whatever tp), prefill
    attention multiplies 2 x (192 + 128) FLOPs per pair and head, decode attention is
    the larger of its latent bytes and 2 x 1088 FLOPs per key and head, and the
    down-projections (7168 x 2112 a layer) are whole on every GPU."""
    from simulator.cost import physics as ph
    from simulator.cost.roofline.model import RooflineCostModel
    m = RooflineCostModel("deepseek-v3", "h200", tp, weight_dtype="fp8")
    c = m.c
    L, hq = 61, 128 / tp
    assert c[ph.C_KV_LATENT] == 576 and c[ph.C_ATTN_PAIR] == 320 and c[ph.C_DEC_PAIR] == 1088
    assert c[ph.C_PARAMS_REPL] == pytest.approx(L * 7168 * 2112 * (1 - 1 / tp))
    plan = m.memory_plan()
    assert plan.kv_bytes_per_token_per_gpu == 61 * 576 * 2
    # Prefill of 1,000 tokens, no prefix: causal pairs at flash attention's rate.
    pairs = 1000 * 1001 / 2
    want = 2 * L * hq * 320 * pairs / (c[ph.C_ATTN_TFLOPS] * c[ph.C_E_FLASH]) * 1e-9
    assert ph.chunk_attention_ms(c, 1000, 0) == pytest.approx(want, rel=1e-12)
    # Decode throughput bound per key: bytes at HBM x e_decode vs FLOPs at flash's rate.
    t_b = L * 576 * 2 / (c[ph.C_HBM_GBS] * c[ph.C_E_DECODE]) * 1e-6
    t_c = 2 * L * hq * 1088 / (c[ph.C_ATTN_TFLOPS] * c[ph.C_E_FLASH]) * 1e-9
    unit = ph.decode_attention_unit(c, 64, False)
    lat = L * 576 * 2 / c[ph.C_CTA_DECODE] * 1e-6 / 64
    assert unit == pytest.approx(ph.pnorm(lat, max(t_b, t_c), c[ph.C_P_ATTN]), rel=1e-12)


def test_deepseek_v3_runs_on_eight_h200(tmp_path):
    """A short run of DeepSeek-V3 (fp8) on one 8 x H200 replica from datasheets: its
    weights (85.1 GB a GPU, 671B / 8 in fp8 plus 16-bit embeddings and norms) fit, and
    requests complete with positive TTFT and TPOT."""
    from conftest import make_scenario, make_workload
    from simulator.loops.simulate import simulate
    from simulator.report.metrics import requests_table
    sc = make_scenario(model={"name": "deepseek-v3",
                              "cost": {"kind": "roofline", "gpu": "h200", "tp": 8,
                                       "weight_dtype": "fp8"}})
    df = requests_table(simulate(sc, 0, workload=make_workload(20, rate=2.0, prompt=500,
                                                              output=50)))
    assert (df["outcome"] == "completed").all() and len(df) == 20
    assert (df["ttft"] > 0).all() and (df["tpot"] > 0).all()
    plan = catalog.plan_memory("deepseek-v3", "h200", 8, weight_dtype="fp8")
    assert plan.fits and 84e9 < plan.weight_bytes_per_gpu < 86e9


def test_moe_and_mla_layers_add_their_kernels_floors():
    """A layer's kernel floor counts the kernels vLLM launches for it, each at the floor
    of one of Vidur's GEMMs (gemm_floor_us / 4) or elementwise ops (elem_floor_us / 5):
    a dense multi-head model keeps Vidur's floor exactly; Mixtral adds the router GEMM
    and three small kernels in each of its 32 mixture layers; DeepSeek-V3 adds, in 58
    of 61 layers, those and its shared expert's 2 GEMMs and 2 small kernels, and in
    every layer MLA's 4 GEMMs and 2 norms."""
    from simulator.cost import physics as ph
    from simulator.cost.roofline.constants import build_constants
    from simulator.cost.roofline.defaults import DEFAULTS
    g, e = DEFAULTS["gemm_floor_us"] / 4, DEFAULTS["elem_floor_us"] / 5
    base = DEFAULTS["gemm_floor_us"] + DEFAULTS["elem_floor_us"] + 2 * e
    spec = catalog.gpu("h100-sxm")

    def floor(name, tp=1):
        return build_constants(catalog.model(name), spec, tp)[ph.C_DEV_LAYER_US]
    assert floor("llama-2-7b") == base and floor("llama-3-70b", 4) == base
    assert floor("mixtral-8x7b", 2) == pytest.approx(base + g + 3 * e, rel=1e-12)
    want = base + 58 / 61 * ((g + 3 * e) + (2 * g + 2 * e)) + (4 * g + 2 * e)
    assert floor("deepseek-v3", 8) == pytest.approx(want, rel=1e-12)
