"""Data-parallel attention with expert parallelism on the roofline
(``simulator.cost.roofline.dataparallel``, ``model.cost.dp``) against arithmetic: the
weights per GPU (attention per rank, experts over TP x DP), the KV capacity x dp, the
all-to-all bytes of the padded EP group, the routing of the rank's constants, the step
as the slowest rank's physics plus the named terms, DP 1 unchanged to the bit, the
planner's ``dp`` axis and the one-line errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from conftest import REPO
from simulator.config.scenario import validate_scenario
from simulator.cost import catalog
from simulator.cost import physics as ph
from simulator.cost.catalog.memory import GIB, activation_bytes_per_gpu
from simulator.cost.roofline.dataparallel import rank_constants, rank_share
from simulator.cost.roofline.expert import (A2A_DISPATCH_EFF, expert_bytes_total,
                                            uniform_imbalance)
from simulator.cost.roofline.model import RooflineCostModel
from simulator.errors import LatsimError

QWEN = "qwen3-30b-a3b"          # 128 experts, top-8, 4 KV heads, 48 layers, hidden 2048
GPU = "h100-80gb"


def _scenario(tp=2, dp=4, ep=8, model=QWEN, **cost) -> dict:
    d = yaml.safe_load((REPO / "scenarios" / "moe-ep.yaml").read_text())
    d["workload"].update(num_requests=12, arrival={"kind": "poisson", "rate": 2.0},
                         prompt_tokens={"kind": "constant", "value": 200},
                         output_tokens={"kind": "constant", "value": 6})
    d["model"] = {"name": model, "cost": {"kind": "roofline", "gpu": GPU, "tp": tp, "dp": dp,
                                          "ep": ep, **cost}}
    return d


def test_weights_per_gpu_are_attention_per_rank_and_experts_over_tp_x_dp():
    """Bytes per GPU at TP2 x DP4: the TP2 plan less 3/4 of its experts' share (each GPU
    holds 128 / 8 = 16 whole experts instead of half of 128); the replica holds every
    expert once and 4 copies of the rest."""
    arch = catalog.model(QWEN)
    experts = expert_bytes_total(arch)
    w_tp2 = catalog.weight_bytes_per_gpu(arch, 2, 1)
    w_dp = catalog.weight_bytes_per_gpu(arch, 2, 1, dp=4)
    assert w_dp == pytest.approx(w_tp2 - experts / 2 + experts / 8, rel=1e-12)
    rest = w_tp2 - experts / 2                # one GPU's attention, embeddings, head, norms
    assert 8 * w_dp == pytest.approx(4 * 2 * rest + experts, rel=1e-12)
    # The expert weights: 48 layers x 128 experts x 3 x 2048 x 768 x 2 B.
    assert experts == 48 * 128 * 3 * 2048 * 768 * 2


def test_kv_capacity_is_dp_times_one_ranks():
    """Each rank caches its own requests: blocks = dp x floor(free / (B/token x block)),
    the free bytes after the DP weights and a reserve for the rank's share of the batch
    (8,192 / 4 tokens, 512 / 4 sequences). TP2 holds 2 of the 4 KV heads a GPU, TP8 a
    copy of one: DP4 x TP2 has twice the KV bytes of TP8 on the same 8 GPUs' room."""
    arch, spec = catalog.model(QWEN), catalog.gpu(GPU)
    p = catalog.plan_memory(arch, spec, 2, 1, dp=4, max_num_batched_tokens=8192,
                            max_num_seqs=512)
    free = (0.9 * spec.memory_bytes - catalog.weight_bytes_per_gpu(arch, 2, 1, dp=4)
            - activation_bytes_per_gpu(arch, 2, 2048, 128) - 1.0 * GIB)
    per_tok = 48 * 2 * 2 * 128 * 2                   # layers x K,V x heads x head_dim x 2 B
    assert p.kv_bytes_per_token_per_gpu == per_tok
    assert p.kv_blocks == 4 * int(free // (per_tok * 16)) and p.kv_blocks_per_rank * 4 == p.kv_blocks
    assert p.kv_tokens == 16 * p.kv_blocks and p.num_gpus == 8 and p.fits
    tp8 = catalog.plan_memory(arch, spec, 8, 1, max_num_batched_tokens=8192, max_num_seqs=512)
    assert tp8.kv_replication == 2 and tp8.kv_bytes_per_token_per_gpu == per_tok / 2
    # KV bytes a cached token takes over the GPUs holding it (the whole token is
    # 48 x 2 x 4 x 128 x 2 B): TP8 stores it on all 8 GPUs, each KV head twice; a DP
    # rank on its 2 GPUs, once. The replica holds about twice the tokens (the weights
    # per GPU differ a little: 7.2 vs 8.2 GiB).
    whole = 48 * 2 * 4 * 128 * 2
    assert 8 * tp8.kv_bytes_per_token_per_gpu == 2 * whole
    assert 2 * p.kv_bytes_per_token_per_gpu == whole
    assert 1.9 < p.kv_tokens / tp8.kv_tokens < 2.0
    # A request's context must fit one rank's cache.
    small = catalog.plan_memory(arch, spec, 2, 1, dp=4, max_num_batched_tokens=8192,
                                max_num_seqs=512, max_model_len=p.kv_tokens // 4 + 16,
                                require_fit=False)
    assert not small.fits and "per DP rank" in small.reason


def test_scenario_capacity_gpus_and_line_follow_dp():
    s = validate_scenario(_scenario(), base_dir=REPO / "scenarios")
    cost = s.model.cost
    blocks = cost.kv_capacity(s)
    plan = cost.memory_plan(s)
    assert blocks == plan.kv_blocks and plan.dp == 4
    assert s.cluster.gpus_per_replica == 8 == cost.gpus_per_replica()
    line = cost.capacity_line(s, blocks)
    assert "DP4" in line and "each of 8 GPU(s)" in line
    per_gpu = blocks * 16 / 4 * plan.kv_bytes_per_token_per_gpu / 2**30
    assert f"{per_gpu:.1f} GiB" in line


def test_a2a_bytes_of_the_padded_ep_group():
    """Per MoE layer each way: the EP group's dp x T_r tokens x top_k x hidden x 2 B; each
    GPU sends T_r / tp of them, (ep - 1) / ep leaving it. 5 decodes at DP4: the slowest
    rank runs 2, every rank is padded to 2, the group moves 8 tokens' copies."""
    m = RooflineCostModel(QWEN, GPU, tp=2, dp=4, ep=8)
    arch = m.arch
    e = m.step_terms_ms(5, 1, [])
    T_pad, ep = 8, 8
    per_gpu = T_pad / ep * arch.experts_per_token * arch.hidden * 2 * (ep - 1) / ep
    link = catalog.gpu(GPU).link_gbs_unidir
    lat = m.c[ph.C_AR_LAT_US] * 1e-3
    assert e["ep_dispatch"] == pytest.approx(
        arch.moe_layers * (lat + per_gpu / (link * A2A_DISPATCH_EFF) * 1e-6), rel=1e-12)
    # The bytes per token per layer crossing GPUs: hidden x 2 B x top_k x 7/8.
    assert per_gpu * ep / T_pad == 2048 * 2 * 8 * 7 / 8
    # The combine replaces the rank's TP all-reduce over its own 2 tokens.
    ar, _ = ph.comm_times(m.c, 2.0)
    assert e["ep_allreduce_replaced"] == pytest.approx(-ar / 2, rel=1e-12)
    bal = 2.0 * T_pad * 8 * m.expert.expert_params / ep / (m.expert.gemm_tflops * 1e9)
    assert e["ep_imbalance"] == pytest.approx(
        (uniform_imbalance(T_pad, 8, 128, ep) - 1) * bal, rel=1e-12)
    assert e["dp_sync"] == m.c[ph.C_AR_LAT_US] * 1e-3 and e["dp_attention_share"] == 0.0
    b = m.breakdown(5, 300, 1500, [])
    assert b["dp_rank_tokens"] == 2 and b["dp_padded_tokens"] == 3


def test_rank_constants_read_the_ep_groups_routed_experts():
    """The rank's T_r tokens read the experts dp x T_r tokens are routed to, 1 / (tp x dp)
    of them on each GPU: ``linear_times``' bytes against the closed form."""
    full = RooflineCostModel(QWEN, GPU, tp=2).c
    c = rank_constants(full, 4)
    E, k, pe = 128.0, 8.0, full[ph.C_EXPERT_PARAMS]
    non_expert = full[ph.C_PARAMS_READ] - E * pe
    wb = full[ph.C_WEIGHT_BYTES]
    for T in (1, 3, 40):
        routed = E * (1 - (1 - k / E) ** (4 * T))
        read = (non_expert / 2 + routed * pe / 8 + full[ph.C_PARAMS_REPL]) * wb
        t_w, _ = ph.linear_times(c, float(T), 0.0)
        assert t_w == pytest.approx(read / (c[ph.C_HBM_GBS] * c[ph.C_E_WEIGHTS]) * 1e-6,
                                    rel=1e-12)
    assert rank_constants(full, 1).tobytes() == full.tobytes()


def test_a_step_is_the_slowest_ranks_physics_plus_the_terms():
    """Decodes split ceil(n / dp) at the batch's mean context; each chunk ceil(n / dp)
    tokens after its prior, its attention priced as 1 / dp of the whole chunk's."""
    m = RooflineCostModel(QWEN, GPU, tp=2, dp=4, ep=8)
    s = rank_share(10, 700, 5000, [(1000, 0, True), (3, 64, False)], 4)
    assert (s.n_decode, s.ctx_sum, s.ctx_max) == (3, 1500, 700)
    assert list(s.chunks) == [(250, 0, True), (1, 64, False)] and s.tokens == 254
    assert s.total == 1013 and s.padded(4) == 1016
    chunks = [(1000, 0, True), (3, 64, False)]
    e = m.step_terms_ms(10, 1, chunks)
    att = sum(ph.chunk_attention_ms(m.c, n, p) / 4 - ph.chunk_attention_ms(m.c, -(-n // 4), p)
              for n, p, _ in chunks)
    assert e["dp_attention_share"] == pytest.approx(att, rel=1e-12)
    k = m._chunks.pack(s.chunks)
    base = ph.step_ms(m.stepping_constants(), 3, 700, 1500, m._chunks.n, m._chunks.p,
                      m._chunks.f, k) / 1000
    assert m.step_time(10, 700, 5000, chunks) == pytest.approx(base + e["added"] / 1000,
                                                               rel=1e-12)
    # decode_times: the rank's ceil(batch / dp) sequences, step by step.
    k4 = m.decode_times(16, 300.0, 4)
    assert k4 == pytest.approx([m.step_time(16, 300 + j, 16 * (300 + j), []) for j in range(4)],
                               rel=1e-12)
    assert m.compiled_reason() == ("expert parallelism with data-parallel attention "
                                   "(model.cost.ep > 1, dp > 1)")


def test_dp_1_is_bit_for_bit_the_model_before():
    for kw in ({"tp": 4, "ep": 4}, {"tp": 2}):
        a = RooflineCostModel(QWEN, GPU, **kw)
        b = RooflineCostModel(QWEN, GPU, dp=1, **kw)
        assert a.c.tobytes() == b.c.tobytes()
        for st in [(64, 1024, 64 * 1024, []), (0, 0, 0, [(2048, 0, True)]),
                   (8, 500, 4000, [(300, 100, False)])]:
            assert a.step_time(*st) == b.step_time(*st)
        assert a.decode_times(16, 300.0, 3) == b.decode_times(16, 300.0, 3)
        assert a.breakdown(8, 500, 4000, []) == b.breakdown(8, 500, 4000, [])
    p0 = catalog.plan_memory(QWEN, GPU, 4, 1)
    p1 = catalog.plan_memory(QWEN, GPU, 4, 1, dp=1)
    assert p0 == p1 and p1.dp == 1 and p1.num_gpus == 4


@pytest.mark.parametrize("model,tp,dp", [(QWEN, 2, 4), ("mixtral-8x7b", 2, 4), (QWEN, 1, 8)])
def test_dp_steps_never_cost_less_for_more_work(model, tp, dp):
    """The cost-model contract on decode and prefill steps, and ``min_step_s`` bounds them."""
    m = RooflineCostModel(model, GPU, tp=tp, dp=dp, ep=tp * dp)
    dec = [m.step_time(n, 512, n * 512, []) for n in list(range(1, 40)) + list(range(40, 700, 9))]
    pre = [m.step_time(0, 0, 0, [(n, 0, True)]) for n in range(1, 16384, 131)]
    assert all(b >= a for a, b in zip(dec, dec[1:]))
    assert all(b >= a for a, b in zip(pre, pre[1:]))
    assert min(dec + pre) >= m.min_step_s


@pytest.mark.parametrize("cost,field,words", [
    ({"dp": 4, "ep": 1}, "model.cost.ep", "tp x dp"),
    ({"dp": 4, "ep": 4}, "model.cost.ep", "tp x dp"),
    ({"tp": 4, "dp": 4, "ep": 16}, "model.cost.dp", "one server"),
    ({"tp": 1, "dp": 2, "ep": 2, "pp": 2}, "model.cost.dp", "pipeline"),
    ({"dp": 0, "ep": 8}, "model.cost.dp", "greater than or equal to 1"),
])
def test_bad_dp_is_a_one_line_error_naming_the_field(cost, field, words):
    with pytest.raises(LatsimError) as e:
        validate_scenario(_scenario(**{"tp": 2, **cost}), source="s.yaml")
    msg = str(e.value)
    assert "\n" not in msg and f"'{field}'" in msg and words in msg, msg


def test_dense_or_uneven_experts_refused_and_cli_exits_2(tmp_path):
    with pytest.raises(LatsimError) as e:
        validate_scenario(_scenario(tp=1, dp=2, ep=2, model="llama-2-7b"), source="s.yaml")
    assert "'model.cost.dp'" in str(e.value) and "cluster.replicas" in str(e.value)
    with pytest.raises(LatsimError) as e:      # 8 experts over 2 x 3 GPUs
        validate_scenario(_scenario(tp=2, dp=3, ep=6, model="mixtral-8x7b"), source="s.yaml")
    assert "'model.cost.ep'" in str(e.value) and "evenly" in str(e.value)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(_scenario(dp=4, ep=2)))
    from simulator.cli.main import app
    r = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "model.cost.ep" in r.output, r.output
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_planner_searches_dp_and_skips_inconsistent_points(tmp_path):
    """``--search dp=1,4 --search ep=2,8`` at TP 2: (dp 1, ep 2) and (dp 4, ep 8) run,
    the two others are skipped with their reason."""
    p = tmp_path / "moe.yaml"
    p.write_text(yaml.safe_dump(_scenario(dp=1, ep=2)))
    from simulator.cli.main import app
    r = CliRunner().invoke(app, ["plan", str(p), "--slo", "p99_tpot_ms<=1000",
                                 "--search", "dp=1,4", "--search", "ep=2,8",
                                 "--search", "replicas=1:1", "--cost-per-gpu-hour", "3.9",
                                 "--no-headroom", "--workers", "1", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "o" / "plan.json").read_text())
    skipped = sorted((s["config"]["model.cost.dp"], s["config"]["model.cost.ep"])
                     for s in doc["skipped"])
    assert skipped == [(1, 8), (4, 2)]
    import pandas as pd
    ev = pd.read_csv(tmp_path / "o" / "evaluations.csv")
    assert set(zip(ev["model.cost.dp"], ev["model.cost.ep"])) == {(1, 2), (4, 8)}


def test_profile_rows_price_the_slowest_rank():
    """``prefill_ms`` / ``decode_ms`` (what admission, the wait estimate and the KV report
    ask) follow the split too: the step's core without bookkeeping and scale."""
    m = RooflineCostModel(QWEN, GPU, tp=2, dp=4, ep=8, scale=2.0)
    n, p, fl = (np.array([500], np.int64), np.array([0], np.int64), np.ones(1, np.bool_))
    core = ph.step_core_ms(m.c, 0, 0, 0, n, p, fl, 1, False)
    assert m.prefill_ms(2000, 0) == pytest.approx(
        core + m.step_terms_ms(0, 1, [(2000, 0, True)])["added"], rel=1e-12)
    zero, nof = np.zeros(1, np.int64), np.zeros(1, np.bool_)
    core = ph.step_core_ms(m.c, 4, 300, 1200, zero, zero, nof, 0, False)
    assert m.decode_ms(13, 300) == pytest.approx(
        core + m.step_terms_ms(13, 1, [])["added"], rel=1e-12)
    one = RooflineCostModel(QWEN, GPU, tp=2, ep=2)
    base = RooflineCostModel(QWEN, GPU, tp=2)
    assert one.prefill_ms(2000, 0) == base.prefill_ms(2000, 0)      # DP 1: as before
