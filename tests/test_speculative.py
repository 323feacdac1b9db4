"""Speculative decoding what-if (``engine.speculative``, ``model.speculative``).

Acceptance model: Leviathan, Kalman and Matias (2023), "Fast Inference from Transformers
via Speculative Decoding", eq. (1): with i.i.d. acceptance ``a`` and ``k`` drafts a
verify step emits on average ``(1 - a^(k+1)) / (1 - a)`` tokens per sequence.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from conftest import REPO, make_scenario, make_scenario_dict
from simulator.loops.simulate import Unsupported, simulate
from simulator.model.speculative import expected_tokens

FITTED = {"cost": {"kind": "fitted", "path": str(REPO / "profiles" /
                                                 "h200-llama3-8b-refbench.json")}}
DRAFT = {"method": "draft", "k": 4, "acceptance": 0.7, "draft_model": "llama-3.2-1b"}


def _engine(spec=None, **over):
    eng = {"policy": "chunked", "max_num_seqs": 32, "max_num_batched_tokens": 256,
           "kv": {"num_blocks": 4096}, **over}
    if spec is not None:
        eng["speculative"] = spec
    return eng


def _scenario(spec=None, *, n=60, rate=5.0, out=(5, 60), seed=1, engine=None, **over):
    wl = {"kind": "synthetic", "num_requests": n, "arrival": {"kind": "poisson", "rate": rate},
          "prompt_tokens": {"kind": "uniform", "low": 50, "high": 400},
          "output_tokens": {"kind": "uniform", "low": out[0], "high": out[1]}}
    return make_scenario(model=FITTED, engine=engine or _engine(spec), workload=wl, seed=seed,
                         **over)


def _spec(method="ngram", k=4, a=0.7, **kw):
    d = {"method": method, "k": k, "acceptance": a, **kw}
    return d


def _tpot(res) -> float:
    rec, wl = res.rec, res.workload
    n = wl.output_tokens
    m = n > 1
    return float(np.median((rec.last_delivered[m] - rec.first_delivered[m]) / (n[m] - 1)))


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.7, 4) == pytest.approx((1 - 0.7 ** 5) / 0.3)


@pytest.mark.parametrize("a,k", [(0.6, 3), (0.8, 5)])
def test_mean_tokens_per_step_matches_the_iid_formula(a, k):
    res = simulate(_scenario(_spec(k=k, a=a), n=40, out=(900, 1000), rate=2.0))
    sp = res.meta["speculative"]
    want = expected_tokens(a, k)
    # Only a request's last steps are capped (fewer drafts than k): well under 1%.
    se = 1.5 / math.sqrt(sp["sequence_steps"])
    assert abs(sp["mean_tokens_per_step"] - want) < 4 * se + 0.01 * want, (sp, want)
    assert sp["expected_tokens_per_step"] == pytest.approx(want)


def test_acceptance_zero_is_one_token_per_step_at_the_speculative_cost():
    off = simulate(_scenario())
    zero = simulate(_scenario(_spec(method="draft", a=0.0, draft_model="llama-3.2-1b")))
    rec = zero.rec
    assert np.array_equal(rec.spec_tokens, rec.spec_steps)
    assert zero.meta["speculative"]["mean_tokens_per_step"] == 1.0
    assert np.array_equal(rec.generated, zero.workload.output_tokens)
    # Same tokens per step as without, but each step pays the verify and the draft.
    assert _tpot(zero) > 1.5 * _tpot(off)
    assert rec.step_time_total > off.rec.step_time_total


def test_acceptance_one_emits_k_plus_one_per_step():
    k = 3
    res = simulate(_scenario(_spec(k=k, a=1.0)))
    rec, out = res.rec, res.workload.output_tokens
    # The first token comes from the prefill; the rest in full steps of k + 1, the last
    # step capped at what is left.
    assert np.array_equal(rec.spec_tokens, out - 1)
    assert np.array_equal(rec.spec_steps, -(-(out - 1) // (k + 1)))


def test_deterministic_per_seed():
    a = simulate(_scenario(_spec(a=0.5)))
    b = simulate(_scenario(_spec(a=0.5)))
    c = simulate(_scenario(_spec(a=0.5), seed=2))
    for name in ("first_token", "last_delivered", "spec_steps", "spec_tokens"):
        assert np.array_equal(getattr(a.rec, name), getattr(b.rec, name), equal_nan=True)
    assert a.rec.itl.total == b.rec.itl.total
    assert not np.array_equal(a.rec.spec_steps, c.rec.spec_steps)


def test_tpot_falls_with_acceptance_at_low_load():
    tp = [_tpot(simulate(_scenario(_spec(a=a), rate=1.0, n=40))) for a in (0.2, 0.5, 0.8, 0.95)]
    assert all(x > y for x, y in zip(tp, tp[1:])), tp
    off = _tpot(simulate(_scenario(rate=1.0, n=40)))
    assert tp[-1] < off / 2


def test_step_cost_rises_with_k():
    from simulator.cost.fitted import FittedCostConfig, FittedCostModel
    from simulator.cost import load_profile
    from simulator.model.speculative import Speculative, draft_cost_model
    cm = FittedCostModel(load_profile(REPO / "profiles" / "h200-llama3-8b-refbench.json"))
    base = cm.step_time(16, 1024, 16 * 1024, [])
    verify = [cm.verify_time(16, k + 1, 1024, 16 * 1024, []) for k in (1, 2, 4, 8)]
    assert base < verify[0] and all(x < y for x, y in zip(verify, verify[1:]))
    draft = draft_cost_model("llama-3.2-1b", FittedCostConfig(), cm)
    steps = [Speculative("draft", k, 0.7, draft).step_time(cm, 16, 1024, 16 * 1024, [])
             for k in (1, 2, 4, 8)]
    assert all(x < y for x, y in zip(steps, steps[1:]))
    assert steps[0] > verify[0]      # the draft's step adds to the verify


def test_conservation_under_kv_pressure():
    """Every request produces exactly its output tokens and the KV empties, with the
    drafts' slots reserved under pressure (preemptions happen)."""
    sc = _scenario(_spec(k=6, a=0.8), n=80, rate=50.0, out=(100, 300),
                   engine=_engine(_spec(k=6, a=0.8), kv={"num_blocks": 160}))
    res = simulate(sc)
    rec = res.rec
    assert np.array_equal(rec.generated, res.workload.output_tokens)
    assert rec.preemptions.sum() > 0
    ts, wq, run, blk, kv, shared = rec.series[0]
    assert blk[-1] == 0 and kv[-1] == 0 and run[-1] == 0
    assert max(blk) <= res.kv_capacity_blocks


def test_off_is_identical_to_no_key():
    base = make_scenario_dict(model=FITTED)
    with_null = make_scenario_dict(model=FITTED)
    with_null["engine"]["speculative"] = None
    from simulator.config.scenario import validate_scenario
    a = simulate(validate_scenario(base))
    b = simulate(validate_scenario(with_null))
    for name in ("first_token", "last_delivered", "generated"):
        assert np.array_equal(getattr(a.rec, name), getattr(b.rec, name), equal_nan=True)
    assert a.rec.itl.total == b.rec.itl.total and a.rec.steps == b.rec.steps
    assert a.rec.spec_steps is None and "speculative" not in a.meta
    assert "speculative" not in validate_scenario(base).model_dump()["engine"]


def test_loop_choice():
    sc = _scenario(_spec())
    res = simulate(sc)
    assert res.meta["loop"] == "simpy (speculative decoding (engine.speculative))"
    with pytest.raises(Unsupported, match="speculative decoding"):
        simulate(sc, loop="compiled")


def test_policies_entries_compare_off_and_on():
    d = make_scenario_dict(model=FITTED)
    d["policies"] = [{"policy": "chunked", "label": "off"},
                     {"policy": "chunked", "label": "ng", "speculative": _spec()}]
    from simulator.config.scenario import validate_scenario
    runs = dict(validate_scenario(d).policy_runs())
    assert runs["off"].engine.speculative is None
    assert runs["ng"].engine.speculative.k == 4


def _cli(argv, capsys):
    from simulator.cli.main import main
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return e.value.code, out, err


@pytest.mark.parametrize("spec,needle", [
    ({"method": "draft", "k": 4, "acceptance": 0.7}, "draft_model"),
    ({"method": "ngram", "k": 0, "acceptance": 0.7}, "engine.speculative.k"),
    ({"method": "ngram", "k": 2.5, "acceptance": 0.7}, "engine.speculative.k"),
    ({"method": "ngram", "k": 4, "acceptance": 1.5}, "engine.speculative.acceptance"),
    ({"method": "beam", "k": 4, "acceptance": 0.5}, "engine.speculative.method"),
    ({"method": "draft", "k": 4, "acceptance": 0.5, "draft_model": "llama-9b"},
     "engine.speculative.draft_model"),
    ({"method": "ngram", "k": 4, "acceptance": 0.5, "bogus": 1}, "bogus"),
])
def test_bad_config_is_one_line_exit_2(tmp_path, capsys, spec, needle):
    d = make_scenario_dict(model=FITTED)
    d["engine"]["speculative"] = spec
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    code, _, err = _cli(["run", p, "--out", tmp_path / "o"], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("latsim: error:"), err
    assert needle in lines[0], lines[0]


def test_profile_cost_kind_is_refused(tmp_path, capsys):
    d = make_scenario_dict()          # kind: profile
    d["engine"]["speculative"] = _spec()
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    code, _, err = _cli(["run", p, "--out", tmp_path / "o"], capsys)
    assert code == 2 and "physics cost model" in err and len(err.strip().splitlines()) == 1


def test_latsim_cost_spec(capsys):
    import json
    code, out, _ = _cli(["cost", "--model", "llama-3-70b", "--gpu", "h100-80gb", "--tp", "4",
                         "--decode", "8@1024", "--spec", "k=4,acceptance=0.8,draft=llama-3.2-1b",
                         "--json"], capsys)
    assert code in (0, None)
    s = json.loads(out)["speculative"]
    assert s["tokens_per_step"] == pytest.approx(expected_tokens(0.8, 4))
    assert s["step_ms"] == pytest.approx(s["verify_ms"] + s["draft_ms"])
    assert s["ms_per_token"] == pytest.approx(s["step_ms"] / s["tokens_per_step"])
    assert s["verify_ms"] > s["baseline_step_ms"] and s["draft_ms"] > 0
    assert s["speedup"] > 1.5       # a 70B target: the 1B draft pays off
    code, _, err = _cli(["cost", "--model", "llama-3-8b", "--gpu", "h200", "--decode", "8@1024",
                         "--spec", "k=4"], capsys)
    assert code == 2 and "--spec" in err


def test_a_verify_step_is_a_q_token_decode_at_contexts_q_minus_1_longer():
    """Eight sequences at context 800 verifying 3 drafts (q = 4): each one's last query
    sees 803 keys, so the step costs a 4-query decode of eight sequences at 803 each
    (their contexts' sum 6,424, not 6,403), under paged and padded attention alike."""
    import json

    from simulator.cost import physics as ph
    from simulator.cost.fitted import fitted_constants
    c = fitted_constants(json.loads((REPO / "profiles" / "h200-llama3-8b.json").read_text())).c
    z, f = np.zeros(1, np.int64), np.zeros(1, np.bool_)
    for padded in (0.0, 1.0):
        c[ph.C_PADDED] = padded
        got = ph.verify_ms(c, 8, 4, 800, 8 * 800, z, z, f, 0)
        assert got == ph.step_q_ms(c, 8, 4, 803, 8 * 803, z, z, f, 0)
        assert ph.verify_ms(c, 1, 1, 800, 800, z, z, f, 0) == ph.step_q_ms(c, 1, 1, 800, 800, z, z, f, 0)
    c[ph.C_PADDED] = 0.0
    assert ph.verify_ms(c, 8, 4, 800, 6400, z, z, f, 0) > ph.step_q_ms(c, 8, 4, 803, 6403, z, z, f, 0)
