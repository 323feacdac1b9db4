"""Synthetic workloads, KV capacity from the model's shape, and the diagnosis rule."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import REPO as REPO_DIR
from conftest import make_scenario, make_scenario_dict
from simulator.config.scenario import validate_scenario
from simulator.errors import LatsimError
from simulator.report.metrics import diagnose
from simulator.loops.simulate import kv_capacity_blocks
from simulator.workload import build_workload


def _wl(**workload):
    d = make_scenario_dict()
    d["workload"] = {"kind": "synthetic", **workload}
    sc = validate_scenario(d)
    return build_workload(sc.workload, np.random.default_rng(0), REPO_DIR)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_have_the_requested_rate_and_cv(burstiness):
    wl = _wl(num_requests=40_000, arrival={"kind": "gamma", "rate": 10.0, "burstiness": burstiness})
    gaps = np.diff(wl.arrival_s)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_duration_and_constant_rate():
    wl = _wl(duration_s=100.0, arrival={"kind": "constant", "rate": 2.0})
    assert len(wl) == 200 and wl.arrival_s[-1] <= 100.0
    np.testing.assert_allclose(np.diff(wl.arrival_s), 0.5)


def test_priority_shares():
    wl = _wl(num_requests=20_000, classes=[{"name": "P0", "share": 0.2},
                                           {"name": "P1", "share": 0.5},
                                           {"name": "P2", "share": 0.3}])
    shares = np.bincount(wl.priority, minlength=3) / len(wl)
    np.testing.assert_allclose(shares, [0.2, 0.5, 0.3], atol=0.015)
    assert wl.class_names == ("P0", "P1", "P2")


def test_lengths_file_sampled_jointly(tmp_path):
    p = tmp_path / "lens.csv"
    p.write_text("num_prefill_tokens,num_decode_tokens\n100,7\n200,9\n300,11\n")
    wl = _wl(num_requests=500, lengths_file={"path": str(p)})
    pairs = set(zip(wl.prompt_tokens.tolist(), wl.output_tokens.tolist()))
    assert pairs == {(100, 7), (200, 9), (300, 11)}
    p.write_text("prompt,num_decode_tokens\n1,2\n")
    with pytest.raises(LatsimError, match=r"lens.csv: missing column 'num_prefill_tokens'"):
        _wl(num_requests=5, lengths_file={"path": str(p)})


def test_kv_capacity_from_model_shape_and_memory():
    sc = make_scenario(engine={"kv": {"gpu_memory_gb": 80, "gpu_memory_utilization": 0.9}})
    shape = sc.model.shape
    # Llama-3-8B: 2 x 32 layers x 8 kv heads x 128 x 2 bytes = 128 KiB per token.
    assert shape.kv_bytes_per_token == 131072
    expected = int((80e9 * 0.9 - 8.03e9 * 2) // (131072 * 16))
    assert kv_capacity_blocks(sc) == expected
    tiny = make_scenario(engine={"kv": {"gpu_memory_gb": 10}})
    with pytest.raises(LatsimError, match="no memory for the KV cache"):
        kv_capacity_blocks(tiny)


def test_diagnosis_follows_the_seed_rule():
    assert diagnose({"mean_t_queue_ms": 150}) == "queue_saturation"
    assert diagnose({"mean_t_queue_ms": 5, "median_ttft_ms": 800}) == "prefill_bottleneck"
    assert diagnose({"mean_t_queue_ms": 5, "median_ttft_ms": 100, "median_tpot_ms": 10,
                     "p99_tpot_ms": 25}) == "decode_jitter"
    assert diagnose({"mean_t_queue_ms": 5, "median_ttft_ms": 100, "median_tpot_ms": 10,
                     "p99_tpot_ms": 15}) == "healthy"


def test_itl_histogram_quantiles_match_numpy_across_buffer_flushes(monkeypatch):
    """The pooled ITL histogram (buffered, binned in numpy) gives every quantile within
    its 0.05% bin width of the exact one, the exact count and the sum, whether the gaps
    came one by one, weighted, or in runs, and across buffer flushes."""
    from simulator.report.recorder import ItlHistogram
    monkeypatch.setattr(ItlHistogram, "FLUSH", 1000)   # force many flushes
    rng = np.random.default_rng(3)
    gaps = rng.lognormal(np.log(0.02), 0.6, 7000)
    h = ItlHistogram()
    exact = []
    for i, g in enumerate(gaps[:3000]):
        w = 1 + i % 3
        h.add(float(g), w)
        exact += [g] * w
    for j in range(3000, 7000, 40):
        run = gaps[j:j + 40]
        h.add_many(run if j % 80 else run.tolist(), 2)
        exact += list(run) * 2
    exact = np.sort(np.asarray(exact))
    assert h.n == len(exact)
    assert h.total == pytest.approx(exact.sum(), rel=1e-12)
    for q in (0.01, 0.5, 0.9, 0.99):
        assert h.quantile(q) == pytest.approx(np.percentile(exact, q * 100), rel=1e-3)
    other = ItlHistogram()
    other.add(5.0, 10)
    h.merge(other)
    assert h.n == len(exact) + 10 and h.quantile(1.0) == pytest.approx(5.0, rel=1e-3)


def test_itl_quantile_interpolates_between_order_statistics_as_numpy_does():
    """A simulated ITL percentile is compared with a recorded run's, computed with
    ``np.percentile`` (linear, as ``vllm bench serve``): the two must be one definition.
    Gaps {1, 100, 1, 100} ms: the median is 50.5 ms, not the lower order statistic."""
    from simulator.report.recorder import ItlHistogram
    gaps = [0.001, 0.1, 0.001, 0.1]
    h = ItlHistogram()
    h.add_many(gaps)
    for q in (0.0, 0.25, 0.5, 0.9, 0.99, 1.0):
        assert h.quantile(q) == pytest.approx(np.percentile(gaps, q * 100), rel=1e-3)
    assert h.quantile(0.5) == pytest.approx(0.0505, rel=1e-3)


def test_one_percentile_definition_for_simulated_and_real_latencies():
    """``pct_ms`` (every summary, the recorded run's side, the autoscaler's metric) and
    the ITL histogram are one statistic: linear between order statistics, in ms."""
    from simulator.report.percentile import pct_ms
    from simulator.report.recorder import ItlHistogram
    x = np.array([0.001, 0.1, 0.001, 0.1, 0.05])
    h = ItlHistogram()
    h.add_many(x)
    for q in (50, 90, 99):
        assert pct_ms(x, q) == pytest.approx(np.percentile(x, q) * 1e3)
        assert h.quantile(q / 100) * 1e3 == pytest.approx(pct_ms(x, q), rel=1e-3)
    assert np.isnan(pct_ms([], 99)) and pct_ms([], 99, empty=0.0) == 0.0


def test_goodput_and_slo_attainment_by_each_class_own_slo():
    """``good_requests`` / ``request_goodput`` / ``slo_attainment``, computed by hand from
    the per-request table: a request is good when it finished and meets its class's own
    SLO (else the scenario's default), every bound ``<=``, a 1-token request's TPOT (NaN)
    passing its TPOT bound; attainment over every request, goodput per second of the run,
    throughput over completed requests only (as ``vllm bench serve``)."""
    from simulator.loops.simulate import simulate
    from simulator.report.metrics import requests_table, summarize
    from conftest import make_scenario_dict
    from simulator.config.scenario import validate_scenario
    d = make_scenario_dict()
    d["workload"]["num_requests"] = 300
    d["workload"]["arrival"] = {"kind": "poisson", "rate": 30.0}
    d["workload"]["output_tokens"] = {"kind": "uniform", "low": 1, "high": 60}
    d["workload"]["classes"] = [{"name": "P0", "share": 0.5, "slo": {"ttft_ms": 20, "tpot_ms": 11.5}},
                                {"name": "P1", "share": 0.5}]
    d["slo"] = {"ttft_ms": 30}
    # Requests over 300 tokens are refused: unfinished, never good.
    d["engine"]["kv"] = {"num_blocks": 400, "max_model_len": 300}
    sc = validate_scenario(d)
    df = requests_table(simulate(sc, 0))
    s = summarize(df, None, sc)
    fin = df["finished"].to_numpy(bool)
    ttft, tpot = df["ttft"].to_numpy() * 1e3, df["tpot"].to_numpy() * 1e3
    p0 = df["class"].to_numpy() == "P0"
    good = fin & np.where(p0, (ttft <= 20) & (np.isnan(tpot) | (tpot <= 11.5)), ttft <= 30)
    # The case must tell the rules apart: some fail each bound, some pass, some unfinished.
    assert 0 < good.sum() < fin.sum() and (p0 & fin & (ttft > 20) & (ttft <= 30)).any()
    assert (p0 & fin & (ttft <= 20) & (tpot > 11.5)).any() and (~p0 & fin & (ttft > 30)).any()
    assert (~fin).any() and (p0 & fin & (ttft <= 20) & np.isnan(tpot)).any()
    dur = df["last_delivered"].to_numpy()[fin].max() - df["arrival"].min()
    assert s["good_requests"] == good.sum()
    assert s["slo_attainment"] == pytest.approx(good.sum() / len(df))
    assert s["request_goodput"] == pytest.approx(good.sum() / dur)
    assert s["request_throughput"] == pytest.approx(fin.sum() / dur)
    # TPOT per request: (last - first delivered) / (output tokens - 1).
    n = df["output_tokens"].to_numpy()
    m = fin & (n > 1)
    want = (df["last_delivered"] - df["first_delivered"]).to_numpy()[m] / (n[m] - 1)
    assert s["median_tpot_ms"] == pytest.approx(np.median(want) * 1e3)
