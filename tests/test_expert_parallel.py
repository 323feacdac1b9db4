"""Expert parallelism on the roofline (``simulator.cost.roofline.expert``) against
arithmetic and closed forms: the all-to-all bytes and its named terms, EP 1 unchanged to
the bit, expert bytes per GPU, the uniform-routing imbalance against a Monte Carlo of
routing, the planner's ``ep`` axis, and the one-line errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from typer import Typer
from typer.testing import CliRunner

from conftest import REPO
from simulator.config.scenario import validate_scenario
from simulator.cost import catalog
from simulator.cost import physics as ph
from simulator.cost.roofline.expert import (A2A_COMBINE_EFF, A2A_DISPATCH_EFF,
                                            a2a_bytes_per_layer, expert_bytes_per_gpu,
                                            expert_bytes_total, uniform_imbalance)
from simulator.cost.roofline.model import RooflineCostModel
from simulator.errors import LatsimError

STEPS = [(64, 1024, 64 * 1024, []), (1, 1, 1, []), (0, 0, 0, [(2048, 0, True)]),
         (8, 500, 4000, [(300, 100, False)])]


def test_a2a_bytes_and_terms_match_the_closed_form():
    """Per MoE layer each way: T x top_k x hidden x 2 bytes; each GPU sends T / ep of the
    tokens' copies, (ep - 1) / ep of them off the GPU, at NVLink x DeepEP's efficiency."""
    arch = catalog.model("mixtral-8x7b")
    assert a2a_bytes_per_layer(64, 2, 4096) == 64 * 2 * 4096 * 2
    m = RooflineCostModel(arch, "h100-80gb", tp=4, ep=4)
    T, ep = 64, 4
    per_gpu = T / ep * arch.experts_per_token * arch.hidden * 2 * (ep - 1) / ep
    lat = m.c[ph.C_AR_LAT_US] * 1e-3
    link = catalog.gpu("h100-80gb").link_gbs_unidir
    e = m.ep_terms(T)
    assert e["ep_dispatch"] == pytest.approx(
        arch.moe_layers * (lat + per_gpu / (link * A2A_DISPATCH_EFF) * 1e-6), rel=1e-12)
    assert e["ep_combine"] == pytest.approx(
        arch.moe_layers * (lat + per_gpu / (link * A2A_COMBINE_EFF) * 1e-6), rel=1e-12)
    # The replaced term is exactly one of physics' two all-reduces per MoE layer.
    ar, _ = ph.comm_times(m.c, float(T))
    assert e["ep_allreduce_replaced"] == pytest.approx(-ar / 2 * arch.moe_layers / arch.layers)
    # The step is the EP-1 physics plus the named terms (same scale 1).
    base = RooflineCostModel(arch, "h100-80gb", tp=4)
    assert m.step_time(T, 1024, T * 1024, []) == pytest.approx(
        base.step_time(T, 1024, T * 1024, []) + e["ep_total"] / 1000, rel=1e-12)
    assert 153 / 200 == A2A_DISPATCH_EFF and 158 / 200 == A2A_COMBINE_EFF


def test_ep_1_is_bit_for_bit_the_model_before():
    a = RooflineCostModel("mixtral-8x7b", "h100-80gb", tp=2)
    b = RooflineCostModel("mixtral-8x7b", "h100-80gb", tp=2, ep=1)
    assert a.c.tobytes() == b.c.tobytes() and b.expert is None
    for s in STEPS:
        assert a.step_time(*s) == b.step_time(*s)
    assert a.decode_times(16, 300.0, 5) == b.decode_times(16, 300.0, 5)
    assert a.compiled_reason() == b.compiled_reason() is None


def test_decode_times_are_step_times_and_min_step_bounds():
    m = RooflineCostModel("qwen3-30b-a3b", "h100-80gb", tp=2, ep=2)
    k = m.decode_times(16, 300.0, 4)
    assert k == pytest.approx([m.step_time(16, 300 + j, 16 * (300 + j), []) for j in range(4)],
                              rel=1e-12)
    assert all(m.step_time(*s) >= m.min_step_s for s in STEPS)
    assert m.compiled_reason() == "expert parallelism (model.cost.ep > 1)"


def test_expert_bytes_per_gpu_are_the_total_over_ep():
    """experts / ep whole experts per GPU: total / ep exactly. At DP = 1 (ep = tp) that is
    the bytes TP's 1/tp cut of every expert held, so the KV capacity is unchanged."""
    arch = catalog.model("mixtral-8x7b")
    total = arch.moe_layers * arch.experts * arch.expert_linear_weights() * 2.0
    assert expert_bytes_total(arch) == total
    for ep in (2, 4, 8):
        assert expert_bytes_per_gpu(arch, ep) == total / ep
        assert expert_bytes_per_gpu(arch, ep) == arch.mlp_linear_weights() * 2.0 / ep
    d = _scenario(ep=4, tp=4)
    d1 = _scenario(ep=1, tp=4)
    s, s1 = validate_scenario(d, base_dir=REPO / "scenarios"), validate_scenario(
        d1, base_dir=REPO / "scenarios")
    assert s.model.cost.kv_capacity(s) == s1.model.cost.kv_capacity(s1)
    assert s.model.cost.gpus_per_replica() == 4


def _mc_imbalance(T, k, E, ep, trials, seed=0):
    """Monte Carlo: each token picks k distinct experts uniformly; E[max GPU count] / mean."""
    rng = np.random.default_rng(seed)
    picks = np.argpartition(rng.random((trials, T, E)), k - 1, axis=2)[:, :, :k]
    gpu = picks // (E // ep)
    counts = np.stack([(gpu == g).sum(axis=(1, 2)) for g in range(ep)], axis=1)
    return counts.max(axis=1).mean() / (T * k / ep)


@pytest.mark.parametrize("T,k,E,ep,tol", [(64, 2, 8, 4, 0.015), (256, 2, 8, 8, 0.01),
                                          (128, 8, 128, 4, 0.01), (1, 2, 8, 8, 1e-12),
                                          (4, 8, 128, 8, 0.05)])
def test_uniform_imbalance_against_monte_carlo(T, k, E, ep, tol):
    """The normal approximation with a fixed sum against 3,000 routed steps. Tolerance:
    the counts are discrete and skewed (the approximation's error shrinks as 1 / sqrt of
    the copies per GPU, ~1% at 32 copies) plus the Monte Carlo's standard error (~0.1%).
    Small steps: one token to 2 of 8 experts on 8 GPUs is exact (the whole-copy bound,
    4); 4 tokens to 8 of 128 on 8 GPUs (4 copies a GPU) within 5% (the normal law is
    loose there: it is 2% low)."""
    mc = _mc_imbalance(T, k, E, ep, 3000)
    assert uniform_imbalance(T, k, E, ep) == pytest.approx(mc, rel=tol)
    assert uniform_imbalance(T, k, E, 1) == 1.0


def test_configured_imbalance_replaces_uniform_routing():
    a = RooflineCostModel("mixtral-8x7b", "h100-80gb", tp=2, ep=2, expert_imbalance=1.5)
    e = a.ep_terms(512)
    bal = 2.0 * 512 * 2 * a.c[ph.C_EXPERT_PARAMS] / 2 / (a.c[ph.C_PEAK_TFLOPS] * a.c[ph.C_E_GEMM] * 1e9)
    assert e["ep_imbalance"] == pytest.approx(0.5 * bal, rel=1e-12)


def _scenario(ep=1, tp=2, model="mixtral-8x7b") -> dict:
    d = yaml.safe_load((REPO / "scenarios" / "quickstart.yaml").read_text())
    d["workload"]["num_requests"] = 16
    d["workload"]["arrival"]["rate"] = 1.0
    d["workload"]["prompt_tokens"] = {"kind": "constant", "value": 256}
    d["workload"]["output_tokens"] = {"kind": "constant", "value": 8}
    d["engine"]["kv"] = {"block_size": 16}
    d["model"] = {"name": model, "cost": {"kind": "roofline", "gpu": "h100-80gb", "tp": tp,
                                          "ep": ep}}
    return d


def test_dense_model_with_ep_is_a_one_line_error_naming_the_field(tmp_path):
    with pytest.raises(LatsimError) as e:
        validate_scenario(_scenario(ep=2, model="llama-2-7b"), source="s.yaml")
    msg = str(e.value)
    assert "\n" not in msg and "'model.cost.ep'" in msg and "dense" in msg
    with pytest.raises(LatsimError) as e:
        validate_scenario(_scenario(ep=4, tp=2), source="s.yaml")
    assert "'model.cost.ep'" in str(e.value) and "\n" not in str(e.value)
    p = tmp_path / "dense.yaml"
    p.write_text(yaml.safe_dump(_scenario(ep=2, model="llama-2-7b")))
    from simulator.cli.main import app
    r = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "model.cost.ep" in r.output, r.output
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_planner_searches_ep_and_reports_it(tmp_path):
    """``--search ep=1,2`` at TP 2: both points run; a point with ep != tp is skipped."""
    p = tmp_path / "moe.yaml"
    p.write_text(yaml.safe_dump(_scenario(ep=1, tp=2)))
    from simulator.cli.plan import plan
    app = Typer()
    app.command("plan")(plan)
    app.command("other")(lambda: None)
    r = CliRunner().invoke(app, ["plan", str(p), "--slo", "p99_tpot_ms<=1000",
                                 "--search", "ep=1,2,4", "--search", "replicas=1:1",
                                 "--cost-per-gpu-hour", "3.9", "--no-headroom", "--workers", "1",
                                 "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert "model.cost.ep" in doc["chosen"]["config"]
    assert [s["config"]["model.cost.ep"] for s in doc["skipped"]] == [4]
    import pandas as pd
    ev = pd.read_csv(tmp_path / "o" / "evaluations.csv")
    assert set(ev["model.cost.ep"]) == {1, 2}


@pytest.mark.parametrize("model,tp", [("mixtral-8x7b", 8), ("qwen3-30b-a3b", 4)])
def test_ep_steps_never_cost_less_for_more_work(model, tp):
    """The cost-model contract (``cost.model``) with EP's terms: the replaced all-reduce
    falls with the tokens, but it is one of the two the physics' step already grows by."""
    m = RooflineCostModel(model, "h100-80gb", tp=tp, ep=tp)
    dec = [m.step_time(n, 512, n * 512, []) for n in list(range(1, 40)) + list(range(40, 600, 7))]
    pre = [m.step_time(0, 0, 0, [(n, 0, True)]) for n in range(1, 16384, 97)]
    assert all(b >= a for a, b in zip(dec, dec[1:]))
    assert all(b >= a for a, b in zip(pre, pre[1:]))
    assert min(dec + pre) >= m.min_step_s
