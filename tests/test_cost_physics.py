"""The fitted physics step-cost model: the fit recovers what generated its rows, the
model never charges more work less, its Python and kernel paths agree to the bit, and
it predicts real H200 measurements (the shipped refbench profile, and every step of
the two recorded serving runs in data/h200-refbench/runs)."""
from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest

from conftest import REPO
from simulator.cost import physics as ph
from simulator.cost.fit import base_constants, fit
from simulator.cost.rows import profile_rows
from simulator.cost.fitted import FittedCostModel
from simulator.cost.noise import NoiseModel
from simulator.cost.runs import (measure_bookkeeping, measure_decode_waves, predict_steps,
                                 read_run, real_metrics)
from simulator.kernel import ENABLED as JIT

REFBENCH = REPO / "profiles" / "h200-llama3-8b-refbench.json"
PAGED = REPO / "profiles" / "h200-llama3-8b.json"
RUNS = REPO / "data" / "h200-refbench" / "runs"
# Where decode attention spills into further waves on the reference engine, as
# ``measure_decode_waves`` finds it on both recorded runs (benchmarks/cost_fit.py):
# 4 blocks per SM, so a wave holds 16.5 sequences (the step-time cliffs at batch 17,
# 34 and 50), each further wave paying half the latency bound again.
WAVES = {"decode_blocks_per_sm": 4, "decode_wave_cost": 0.5}


def _load(path):
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def refbench():
    return _load(REFBENCH)


@pytest.fixture(scope="module")
def refbench_waves(refbench):
    p = copy.deepcopy(refbench)
    p["engine"].update(WAVES)
    return p


@pytest.fixture(scope="module")
def refbench_cv(refbench_waves):
    return fit(refbench_waves, cv=True)


@pytest.fixture(scope="module")
def paged():
    return _load(PAGED)


@pytest.fixture(scope="module")
def fits(refbench_waves, paged):
    """One fit of each profile, shared (a fit takes a second or so)."""
    return {"refbench": fit(refbench_waves, cv=False), "paged": fit(paged, cv=False)}


@pytest.fixture(scope="module")
def runs():
    return {name: read_run(RUNS / name) for name in ("load50-fifo", "load90-chunked")}


def _step(c, nd, cmax, csum, chunks):
    n = np.array([x[0] for x in chunks] + [0], np.int64)
    p = np.array([x[1] for x in chunks] + [0], np.int64)
    f = np.array([x[2] for x in chunks] + [False], np.bool_)
    return float(ph.step_ms(c, nd, cmax, csum, n, p, f, len(chunks)))


# -- the fit ---------------------------------------------------------------------------

TRUE = {"h_step_ms": 5.0, "h_decode_ms": 4.0, "h_chunk_ms": 3.0, "h_prefix_ms": 1.5,
        "e_weights": 0.75, "e_gemm": 0.7, "e_flash": 0.45, "e_masked": 0.2,
        "cta_prefix_gbs": 9.0, "e_decode": 0.3, "cta_decode_gbs": 12.0, "dev_per_host": 0.2,
        "p_step": 8.0, "p_attn": 2.0, "p_gemm": 3.0}


def test_fit_recovers_the_coefficients_that_generated_its_rows(refbench):
    prof = copy.deepcopy(refbench)
    prof["engine"]["decode_blocks_per_sm"] = 0
    c = base_constants(prof)
    for k, v in TRUE.items():
        c[ph.INDEX[k]] = v
    c[ph.C_E_DECODE_EAGER] = c[ph.C_E_DECODE]

    def row(nd, ctx, n, p):
        v = float(ph.step_core_ms(c, nd, ctx, nd * ctx, np.array([n]), np.array([p]),
                                  np.array([True]), 1 if n else 0, False))
        return {"ms": v, "p10": v, "p90": v}

    prof["prefill"] = [dict(chunk=r["chunk"], prior=r["prior"], **row(0, 0, r["chunk"], r["prior"]))
                       for r in refbench["prefill"]]
    prof["decode"] = [dict(batch=b, context=x, **row(b, x, 0, 0))
                      for b in (1, 2, 4, 8, 16, 24, 32, 48, 64) for x in (128, 512, 1024, 2048, 4096)]
    prof["mixed"] = [dict(batch=b, context=x, chunk=n, prior=p, **row(b, x, n, p))
                     for b, x, n, p in ((8, 1024, 128, 0), (8, 1024, 512, 0), (32, 1024, 128, 0),
                                        (32, 1024, 512, 0), (16, 2048, 256, 1024),
                                        (48, 512, 512, 3072))]
    r = fit(prof, cv=False)
    assert np.abs(r.residuals).max() < 0.01
    got = r.coefficients()
    for k, v in TRUE.items():
        # Rates and host times are pinned by the rows; the kernel floor and the
        # transition exponents only by a few rows near a transition.
        tol = 0.15 if k in ("dev_per_host", "p_step", "p_attn", "p_gemm") else 0.05
        assert got[k] == pytest.approx(v, rel=tol), k


def test_cross_validated_error_on_the_refbench_profile(refbench_cv):
    """Leave-one-out relative error per row kind on profiles/h200-llama3-8b-refbench.json
    (63 rows measured on an H200; fitted with the wave facts measured on the runs).
    Against each left-out row's median capped by the rows holding more work (timing
    noise only adds time): prefill 2.0%, decode 1.6%, mixed 2.3% at the time of
    writing -- all below 3%. Against the raw medians prefill 2.3%, mixed 2.3%, decode
    4.8%: the profile's decode rows at context 128 and 512 (and batch 1-2 at 4096) sit
    6-27% above rows with more work, which no model that charges more work more can
    follow (13 of the 35 decode rows)."""
    e = refbench_cv.errors
    for kind in ("prefill", "decode", "mixed"):
        assert e[kind]["cv_capped"]["median"] < 0.03, kind
    assert e["prefill"]["cv"]["median"] < 0.03
    assert e["mixed"]["cv"]["median"] < 0.03
    assert e["decode"]["cv"]["median"] < 0.06
    assert np.isfinite(refbench_cv.cv_residuals).all()


def test_cross_validated_error_on_the_real_engine_profile(paged):
    """Leave-one-out error per row kind on profiles/h200-llama3-8b.json (the project's
    own engine on an H200): prefill 1.8%, decode 1.3% at the time of writing, below 3%.
    Its six mixed rows (eager steps) come out 8.9%, under their own repeat noise: the
    median row spreads by 9.9% ((p90 - p10) / 2 over its median; row 32 decodes + 128
    tokens: p10 35.0, median 48.6, p90 51.5 ms), which no prediction can beat; what
    ``latsim fit`` prints next to the error."""
    r = fit(paged, cv=True)
    e = r.errors
    assert e["prefill"]["cv"]["median"] < 0.03
    assert e["decode"]["cv"]["median"] < 0.03
    rows = r.rows
    mixed = rows.kind == "mixed"
    spread = np.median(((rows.p90 - rows.p10) / (2 * rows.ms))[mixed])
    assert spread > 0.05
    assert e["mixed"]["cv"]["median"] < spread


def test_paged_graphed_profile_fits(paged, fits):
    """profiles/h200-llama3-8b.json (paged decode attention, CUDA-graphed decodes):
    prefill and decode rows within 3% median in sample; its six mixed rows (eager
    steps whose repeats spread by up to 30% p10-to-p90) within 6% (measured 5.2%)."""
    r = fits["paged"]
    assert not r.c[ph.C_PADDED] and r.c[ph.C_GRAPHS]
    assert r.errors["prefill"]["fit"]["median"] < 0.03
    assert r.errors["decode"]["fit"]["median"] < 0.03
    assert r.errors["mixed"]["fit"]["median"] < 0.06
    # A mixed step runs eagerly: it costs more than the graphed decode step it holds.
    m = FittedCostModel(paged, fit_result=r)
    assert m.step_time(8, 1024, 8 * 1024, [(128, 0, True)]) > m.step_time(8, 1024, 8 * 1024, [])


def test_too_few_rows_fall_back_with_a_reason_and_no_nan():
    prof = {"format": "latsim-profile/1", "meta": {"hardware": "some GPU"},
            "engine": {"decode_attention": "padded"},
            "prefill": [{"chunk": 128, "prior": 0, "ms": 9.0}, {"chunk": 1024, "prior": 0, "ms": 30.0}],
            "decode": [{"batch": 8, "context": 1024, "ms": 10.0}]}
    r = fit(prof, cv=True)
    for name in ("h_prefix_ms", "e_masked", "cta_prefix_gbs", "cta_decode_gbs", "e_flash",
                 "dev_per_host", "h_graph_ms"):
        assert name in r.fallbacks and r.fallbacks[name], name
    assert "not known" in r.hardware
    assert np.isfinite(r.c).all()
    assert np.isfinite(r.residuals).all() and np.isfinite(r.cv_residuals).all()
    m = FittedCostModel(prof, fit_result=r)
    for args in ((0, 0, 0, [(4096, 3000, True)]), (64, 4096, 64 * 4096, []),
                 (32, 2048, 50000, [(200, 100, False), (12, 0, True)])):
        t = m.step_time(*args)
        assert math.isfinite(t) and t > 0


# -- the model's shape -------------------------------------------------------------------

@pytest.mark.parametrize("which", ["refbench", "paged"])
def test_more_work_never_costs_less(which, fits):
    c = fits[which].c
    rng = np.random.default_rng(0)
    for _ in range(300):
        nd = int(rng.integers(0, 80))
        cmax = int(rng.integers(1, 5000)) if nd else 0
        csum = int(rng.integers(nd, nd * cmax + 1)) if nd else 0
        chunks = [(int(rng.integers(1, 3000)), int(rng.integers(0, 3000)), bool(rng.integers(2)))
                  for _ in range(int(rng.integers(0, 3)))]
        if not nd and not chunks:
            continue
        t = _step(c, nd, cmax, csum, chunks)
        more = []
        if nd:
            more += [(nd + 1, cmax, csum + cmax, chunks), (nd, cmax + 7, csum + 7, chunks)]
        else:
            more.append((1, 100, 100, chunks))
        if chunks:
            n, p, f = chunks[0]
            more += [(nd, cmax, csum, [(n + 5, p, f)] + chunks[1:]),
                     (nd, cmax, csum, [(n, p + 5, f)] + chunks[1:]),
                     (nd, cmax, csum, [(n, p, True)] + chunks[1:])]
        more.append((nd, cmax, csum, chunks + [(16, 0, False)]))
        for m in more:
            assert _step(c, *m) >= t * (1 - 1e-12), (which, (nd, cmax, csum, chunks), m)


def test_decode_waves_make_a_cliff_one_past_a_full_wave(fits):
    c = fits["refbench"].c
    per = [_step(c, b, 2500, b * 2500, []) for b in range(14, 20)]
    steps = np.diff(per)
    # 16.5 sequences per wave: batch 17 starts a second wave.
    assert steps[2] > 3 * max(steps[0], steps[1], steps[3], steps[4])


def test_kernel_is_compiled_and_matches_its_python(fits):
    c = fits["refbench"].c
    args = (12, 2100, 20000, np.array([300, 64]), np.array([0, 900]), np.array([True, False]), 2)
    if JIT:
        assert hasattr(ph.step_ms, "py_func")
        assert ph.step_ms(c, *args) == pytest.approx(ph.step_ms.py_func(c, *args), rel=1e-12)
    assert ph.step_ms(c, *args) > 0


@pytest.mark.parametrize("which,noise", [("refbench", False), ("refbench", True),
                                         ("paged", False), ("paged", True)])
def test_decode_times_equal_step_time_calls_bit_for_bit(which, noise, refbench_waves, paged,
                                                       fits):
    prof = refbench_waves if which == "refbench" else paged
    r = fits[which]
    a = FittedCostModel(prof, fit_result=r, noise=noise, rng=np.random.default_rng(5))
    b = FittedCostModel(prof, fit_result=r, noise=noise, rng=np.random.default_rng(5))
    batch, ctx0, k = 20, 1500, 40
    got = a.decode_times(batch, ctx0, k)
    want = [b.step_time(batch, ctx0 + j, batch * (ctx0 + j), []) for j in range(k)]
    assert got == want
    assert a.lookups == b.lookups == k
    assert a.extrapolations == b.extrapolations


def test_extrapolation_is_counted(refbench_waves, fits):
    m = FittedCostModel(refbench_waves, fit_result=fits["refbench"])
    m.step_time(16, 2048, 16 * 2048, [])
    m.step_time(0, 0, 0, [(1000, 500, True)])
    assert (m.lookups, m.extrapolations) == (2, 0)
    m.step_time(0, 0, 0, [(6000, 0, True)])          # a chunk larger than any row
    m.step_time(128, 1024, 128 * 1024, [])            # a batch larger than any row
    m.step_time(4, 8000, 4 * 8000, [])                # a context longer than any row
    m.decode_times(8, 4090, 10)                       # three of ten past context 4096
    assert m.lookups == 15
    assert m.extrapolations == 3 + 3


def test_min_step_bounds_every_step(refbench_waves, paged, fits):
    for prof, which in ((refbench_waves, "refbench"), (paged, "paged")):
        m = FittedCostModel(prof, fit_result=fits[which])
        lo = m.min_step_s
        assert 0 < lo <= m.step_time(1, 1, 1, []) and lo <= m.step_time(0, 0, 0, [(1, 0, True)])
        assert lo <= min(m.decode_times(3, 10, 5))


# -- against the recorded runs -----------------------------------------------------------

def test_run_replay_matches_the_recorded_steps_and_metrics(runs):
    """Every step's rebuilt prefill chunks reproduce the recorded sequence counts,
    decode contexts and first-token times, and the metrics match the table in
    data/h200-refbench/README.md."""
    for r in runs.values():
        assert r.check["prefill_seq_mismatches"] == 0
        assert r.check["decode_mismatches"] == 0
        assert r.check["first_token_mismatches"] == 0
    table = {"load50-fifo": (23.6, 96.6, 14.6, 20.3), "load90-chunked": (1004, 4997, 36.3, 40.7)}
    for name, (t50, t99, p50, p99) in table.items():
        m = real_metrics(runs[name])
        got = (m["median_ttft_ms"], m["p99_ttft_ms"], m["median_tpot_ms"], m["p99_tpot_ms"])
        assert got == pytest.approx((t50, t99, p50, p99), abs=0.06 if t50 < 100 else 0.6)


def test_per_step_error_on_the_recorded_runs(runs, refbench, fits):
    """Every recorded step of both runs priced by the model fitted to the profile
    alone: median |error| below 3%. At the time of writing, with the measured wave
    facts: 1.6% (fifo) and 1.9% (chunked), median signed error -0.7% and -0.4%;
    profile alone: 3.0% and 2.1%. The bound allows for the profile's own 1.7% row
    repeatability and ~1% per-step jitter in serving; the old table model's signed
    bias was +2.2% (fifo) and -1.6% (chunked)."""
    c = fits["refbench"].c
    c_plain = fit(refbench, cv=False).c
    for r in runs.values():
        d = r.dur_s * 1e3
        e = predict_steps(c, r) / d - 1
        assert np.median(np.abs(e)) < 0.03, r.name
        assert abs(np.median(e)) < 0.015, r.name
        e0 = predict_steps(c_plain, r) / d - 1
        assert np.median(np.abs(e0)) < 0.04, r.name


def test_wave_cliff_is_measured_on_the_runs(runs, refbench):
    w = measure_decode_waves(list(runs.values()), refbench, blocks=(2, 4, 8), costs=(0.5,))
    assert w["decode_blocks_per_sm"] == 4
    assert w["scores"]["4x0.5"] < 0.8 * w["scores"]["0x1.0"]


def test_bookkeeping_is_measured_on_the_runs(runs):
    b = measure_bookkeeping(list(runs.values()))
    # 0.02-0.1 ms between steps (data/h200-refbench/README.md), growing with the batch.
    assert 0.0 <= b["bookkeeping_ms"] < 0.05
    assert 0.0 < b["bookkeeping_seq_ms"] < 0.005


# -- noise -------------------------------------------------------------------------------

def test_noise_is_seeded_and_only_slows_on_average(refbench):
    nm = NoiseModel.from_profile(refbench)
    assert 0 < nm.sigma < 0.05
    x = [NoiseModel.from_profile(refbench).run(np.random.default_rng(s), np.full(5000, 20.0))
         for s in (1, 1, 2)]
    assert np.array_equal(x[0], x[1]) and not np.array_equal(x[0], x[2])
    assert 1.0 < x[0].mean() / 20.0 < 1.05
    assert np.median(x[0]) == pytest.approx(20.0, rel=0.01)


def test_noise_measurement_recovers_its_own_parameters():
    true = NoiseModel(sigma=0.01, rho=0.3, p_episode=0.0, p_stall=0.03, p_stall_final=0.2,
                      stall_median_ms=3.0, stall_s=0.4)
    rng = np.random.default_rng(3)
    n = 20000
    pred = np.full(n, 15.0)
    fin = rng.random(n) < 0.2
    meas = np.array([true.next(rng, 15.0, f) for f in fin])
    got = NoiseModel.from_run(meas, pred, fin, np.zeros(n, int))
    assert got.sigma == pytest.approx(0.01, rel=0.25)
    assert got.p_stall == pytest.approx(0.03, rel=0.3)
    assert got.p_stall_final == pytest.approx(0.2, rel=0.2)
    assert got.stall_median_ms == pytest.approx(3.0, rel=0.15)


def test_noise_measurement_recovers_slow_episodes():
    """Slow episodes (enter 0.2% of steps, stay with probability 0.95: ~20 steps long,
    14% slower at the median, the defaults measured on the reference runs) in 120k
    generated steps: ``from_run`` measures the stay probability within 0.03, the median
    slowdown within 15%, the entry rate within a factor of two (short episodes hide in
    the jitter: measured 0.0012-0.0014 over three seeds)."""
    true = NoiseModel(sigma=0.01, rho=0.3, p_episode=0.002, p_episode_stay=0.95,
                      episode_median=0.144, episode_s=0.53, p_stall=0.02, p_stall_final=0.1,
                      stall_median_ms=2.0, stall_s=0.5)
    rng = np.random.default_rng(5)
    n = 120000
    fin = rng.random(n) < 0.1
    meas = np.array([true.next(rng, 15.0, f) for f in fin])
    got = NoiseModel.from_run(meas, np.full(n, 15.0), fin, np.zeros(n, int))
    assert got.p_episode_stay == pytest.approx(0.95, abs=0.03)
    assert got.episode_median == pytest.approx(0.144, rel=0.15)
    assert 0.001 <= got.p_episode <= 0.004


def test_fitted_model_runs_in_the_simulator(refbench_waves, fits):
    from simulator.config.scenario import validate_scenario
    from simulator.loops.simulate import simulate

    sc = validate_scenario({
        "name": "fitted-smoke", "seed": 1,
        "workload": {"kind": "trace", "path": str(RUNS / "load90-chunked" / "trace.csv"),
                     "format": "csv", "limit": 40},
        "network": {"distance_km": 0, "base_rtt_ms": 0, "tls": "none", "gateway_ms": 0,
                    "request_overhead_bytes": 0, "bytes_per_prompt_token": 0},
        "stream": {"frame_overhead_bytes": 0, "bytes_per_token": 0},
        "engine": {"policy": "chunked", "max_num_batched_tokens": 512, "chunk_size": 512,
                   "max_num_seqs": 64,
                   "kv": {"num_blocks": 16384, "allocation": "contiguous", "max_model_len": 4096}},
        "model": {"cost": {"kind": "profile", "path": str(REFBENCH)}}})
    m = FittedCostModel(refbench_waves, fit_result=fits["refbench"])
    res = simulate(sc, cost_model=m, loop="simpy")
    assert np.isfinite(res.rec.last_token).all()
    assert res.cost_lookups > 0 and res.cost_info["kind"] == "fitted"


def test_profile_rows_cover_every_section(paged):
    rows = profile_rows(paged)
    assert set(rows.kind) == {"prefill", "decode", "mixed"}
    assert len(rows) == len(paged["prefill"]) + len(paged["decode"]) + len(paged["mixed"])


@pytest.mark.parametrize("shape", [
    (1, 200, 200, []), (16, 3000, 20000, []), (24, 900, 9000, []),
    (8, 1024, 8000, [(512, 0, True)]), (30, 2048, 40000, [(200, 1500, True), (312, 0, False)]),
    (0, 0, 0, [(4096, 0, True)]), (0, 0, 0, [(16, 3072, True)])])
def test_a_steps_breakdown_adds_up_to_its_time(fits, shape):
    """``step_breakdown`` names each term of a step on its own (it re-derives the
    packed tokens and a graph's padding to show them): on both shipped H200 profiles
    (padded eager, paged with CUDA graphs) the device terms add up to its device time,
    and host and device combine as ``step_ms`` does, to the step's own time."""
    nd, cmax, csum, chunks = shape
    for name in ("refbench", "paged"):
        c = fits[name].c
        b = ph.step_breakdown(c, nd, cmax, csum, chunks)
        parts = (b["linear"] + b["elementwise"] + b["prefill_attention"]
                 + b["decode_attention"] + b["allreduce"] + b["pipeline_send"] + b["floor"])
        assert b["device"] == pytest.approx(parts, rel=1e-9), (name, b)
        core = ph.pnorm(b["host"], b["device"], c[ph.C_P_STEP])
        assert b["ms"] == pytest.approx((core + b["bookkeeping"]) * c[ph.C_SCALE],
                                        rel=1e-9), (name, b)


def test_allreduce_regime_switch_closed_form():
    """``comm_times``: a message up to ``ca_max_bytes`` costs ``ca_lat_us + 2 (tp-1)/tp x
    bytes / ca_gbs`` per all-reduce, a larger one ``ar_lat_us + ... / ar_gbs``; with
    ``ca_max_bytes`` 0 (a fitted profile, an engine without the kernel) every one is
    NCCL's, even an empty step's (which once divided by the unset ``ca_gbs``)."""
    c = ph.new_constants()
    c[ph.C_LAYERS], c[ph.C_DMODEL], c[ph.C_DTYPE_BYTES], c[ph.C_TP] = 10, 1000, 2.0, 4.0
    c[ph.C_AR_LAT_US], c[ph.C_AR_GBS] = 20.0, 300.0
    assert ph.comm_times(c, 0.0)[0] == pytest.approx(2 * 10 * 20e-3)
    assert ph.comm_times(c, 100.0)[0] == pytest.approx(2 * 10 * (20e-3 + 1.5 * 2e5 / 300 * 1e-6))
    c[ph.C_CA_LAT_US], c[ph.C_CA_GBS], c[ph.C_CA_MAX_BYTES] = 5.0, 100.0, 2e5
    small = 2 * 10 * (5e-3 + 1.5 * 2e5 / 100 * 1e-6)         # 100 tokens x 1000 x 2 B = 2e5 B
    assert ph.comm_times(c, 100.0)[0] == pytest.approx(small)
    assert ph.comm_times(c, 101.0)[0] == pytest.approx(2 * 10 * (20e-3 + 1.5 * 2.02e5 / 300 * 1e-6))
    assert ph.comm_times(c, 0.0)[0] == pytest.approx(2 * 10 * 5e-3)
