"""The profile cost model against the profile it reads, and the wire's timings."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import REPO, make_profile, make_scenario, make_workload
from simulator.cost import load_profile
from simulator.cost.profile import ProfileCostModel
from simulator.report.metrics import requests_table
from simulator.wire.network import ConnectionPools, NetworkTiming
from simulator.loops.simulate import simulate

REFBENCH = REPO / "profiles" / "h200-llama3-8b-refbench.json"


@pytest.fixture(scope="module")
def refbench():
    return load_profile(REFBENCH)


def test_measured_rows_are_reproduced_exactly(refbench):
    """Every measured row comes back as measured, plus the host's bookkeeping between
    steps (``engine.bookkeeping_ms``), which the timed rows do not include."""
    m = ProfileCostModel(refbench)

    def bk(n):
        return m.bookkeeping_ms + m.bookkeeping_seq_ms * n
    for r in refbench["prefill"]:
        assert m.step_time(0, 0, 0, [(r["chunk"], r["prior"])]) == \
            pytest.approx((r["ms"] + bk(1)) / 1e3)
    for r in refbench["decode"]:
        b, c = r["batch"], r["context"]
        assert m.step_time(b, c, b * c, []) == pytest.approx((r["ms"] + bk(b)) / 1e3)
    assert m.extrapolations == 0


def test_bookkeeping_per_sequence_is_charged_by_the_profile_model_too(refbench):
    """``engine.bookkeeping_seq_ms`` (what ``latsim calibrate`` writes) is host time per
    sequence a step held, in the profile model as in the physics models (one
    ``physics.book_ms``): 8 decodes at 0.1 ms + 0.01 ms each add 0.18 ms, a step with
    8 decodes and a chunk 0.19 ms; the replay's pricing splits the same amount off."""
    from simulator.cost.calibration.pricing import model_pricer
    prof = json.loads(json.dumps(refbench))
    prof["engine"].update(bookkeeping_ms=0.0, bookkeeping_seq_ms=0.0)
    bare = ProfileCostModel(prof)
    prof["engine"].update(bookkeeping_ms=0.1, bookkeeping_seq_ms=0.01)
    m = ProfileCostModel(prof)
    assert (m.step_time(8, 1024, 8 * 1024, []) - bare.step_time(8, 1024, 8 * 1024, [])) * 1e3 \
        == pytest.approx(0.18)
    mixed = [(128, 0)]
    assert (m.step_time(8, 1024, 8192, mixed) - bare.step_time(8, 1024, 8192, mixed)) * 1e3 \
        == pytest.approx(0.19)
    core, book = model_pricer(m)(8, 1024, 8192, [(128, 0, True)])
    assert book == pytest.approx(0.19)
    assert core == pytest.approx(bare.step_time(8, 1024, 8192, mixed) * 1e3)


def test_interpolates_between_rows_and_counts_extrapolation(refbench):
    m = ProfileCostModel(refbench)
    lo = m.step_time(0, 0, 0, [(1024, 0)])
    hi = m.step_time(0, 0, 0, [(2048, 0)])
    mid = m.step_time(0, 0, 0, [(1536, 0)])
    assert mid == pytest.approx((lo + hi) / 2)
    assert m.extrapolations == 0
    m.step_time(0, 0, 0, [(8192, 0)])
    assert m.extrapolations == 1


def test_mixed_steps_do_not_count_the_fixed_cost_twice(refbench):
    m = ProfileCostModel(refbench)
    errs = []
    for r in refbench["mixed"]:
        b, c = r["batch"], r["context"]
        pred = m.step_time(b, c, b * c, [(r["chunk"], r["prior"])]) * 1e3
        naive = (m.step_time(b, c, b * c, []) + m.step_time(0, 0, 0, [(r["chunk"], 0)])) * 1e3
        errs.append(abs(pred - r["ms"]) / r["ms"])
        assert abs(pred - r["ms"]) < abs(naive - r["ms"])
    # Fitted on these same four rows; the spread is what a one-parameter overlap can do.
    assert max(errs) < 0.11 and np.mean(errs) < 0.06


def test_padded_vs_paged_decode_context():
    prof = make_profile(decode=((8, 100, 10.0), (8, 1000, 20.0)), padded=True)
    padded = ProfileCostModel(prof)
    prof["engine"]["decode_attention"] = "paged"
    paged = ProfileCostModel(prof)
    # 7 short sequences and one long one: padded pays for the longest, paged for the mean.
    ctx = [100] * 7 + [1000]
    assert padded.step_time(8, max(ctx), sum(ctx), []) == pytest.approx(0.020)
    assert paged.step_time(8, max(ctx), sum(ctx), []) == pytest.approx(
        (10 + 10 * (np.mean(ctx) - 100) / 900) / 1e3)


def test_refbench_conversion_matches_committed_profile(data_dir):
    """The shipped refbench profile is the conversion of data/h200-refbench/profile.csv
    plus one documented calibration step (profiles/README.md): the engine facts that
    ``latsim calibrate`` measured on the engine's two recorded runs, in its ``engine``
    section, the report in ``meta.calibration`` and the refitted coefficients in
    ``meta.fit``. Nothing else differs, the report names those runs by the hash of their
    files as they are in data/, and the bookkeeping it records is what the runs' host
    gaps give (the other facts and the refit are re-done in tests/test_calibrate.py)."""
    from simulator.cost.calibration import apply_calibration, read_recorded_run, run_digest
    from simulator.cost.convert import refbench_to_profile
    from simulator.cost.runs import measure_bookkeeping, read_run
    conv = refbench_to_profile(data_dir / "h200-refbench" / "profile.csv")
    committed = json.loads(REFBENCH.read_text())
    cal = committed["meta"]["calibration"]
    fitted = dict(committed, meta={k: v for k, v in committed["meta"].items() if k != "fit"})
    assert apply_calibration(conv, cal) == fitted
    assert committed["meta"]["fit"]["source"] == "calibrated on load50-fifo, load90-chunked"
    assert cal["base_profile"] == "data/h200-refbench/profile.csv"
    runs = data_dir / "h200-refbench" / "runs"
    names = ["load50-fifo", "load90-chunked"]
    assert [r["run"] for r in cal["runs"]] == [f"data/h200-refbench/runs/{n}" for n in names]
    for r, n in zip(cal["runs"], names):
        assert r["digest"] == run_digest(read_recorded_run(runs / n))
    facts = committed["engine"]
    b = measure_bookkeeping([read_run(runs / n) for n in names])
    assert facts["bookkeeping_ms"] == b["bookkeeping_ms"]
    assert facts["bookkeeping_seq_ms"] == b["bookkeeping_seq_ms"]
    assert {"decode_blocks_per_sm", "decode_wave_cost", "step_tail"} <= set(facts)


def test_bad_profile_is_one_line_error(tmp_path):
    from simulator.errors import LatsimError
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"format": "latsim-profile/1", "prefill": [{"chunk": 1}],
                             "decode": [{"batch": 1, "context": 1, "ms": 1}]}))
    with pytest.raises(LatsimError, match=r"p.json: field 'prefill\[0\]\.prior'"):
        load_profile(p)


def test_rtt_and_handshakes():
    sc = make_scenario(network={"distance_km": 1000, "base_rtt_ms": 2, "tls": "1.2",
                                "gateway_ms": 0, "request_overhead_bytes": 0,
                                "bytes_per_prompt_token": 0})
    t = NetworkTiming.from_config(sc.network)
    assert t.rtt == pytest.approx(0.002 + 2 * 1000 / 200_000)   # 12 ms
    assert t.handshake == pytest.approx(3 * t.rtt)               # TCP + TLS 1.2 (2 RTT)
    for tls, rtts in (("1.3", 2), ("0rtt", 1), ("none", 1)):
        sc2 = make_scenario(network={**sc.network.model_dump(), "tls": tls})
        assert NetworkTiming.from_config(sc2.network).handshake == pytest.approx(rtts * t.rtt)


def test_keepalive_pool_reuse_and_expiry():
    pools = ConnectionPools(n_clients=1, pool_size=1, keepalive_s=10.0, reuse=True)
    assert pools.acquire(0, 0.0) == (True, True)          # first: new, pooled
    assert pools.acquire(0, 0.5) == (True, False)         # pool busy: one-off connection
    pools.release(0, 1.0, True)
    assert pools.acquire(0, 5.0) == (False, True)         # reused within keep-alive
    pools.release(0, 6.0, True)
    assert pools.acquire(0, 20.0) == (True, True)         # expired after 14 s idle
    assert (pools.new_connections, pools.reused_connections) == (3, 1)


def test_keepalive_rules_warmest_idle_expiry_and_one_off_compiled_as_in_python():
    """``wire.keepalive``: the warmest idle connection is taken, an expired one leaves the
    pool, a full pool opens one-off connections; the compiled kernels (the compiled
    loop's) and their Python functions (``ConnectionPools``') make the same moves."""
    from simulator.kernel import python_of
    from simulator.wire import keepalive as K

    def play(acq, rel, dis):
        idle, n_idle, n_open = np.zeros((2, 3)), np.zeros(2, np.int64), np.zeros(2, np.int64)
        got = [acq(idle, n_idle, n_open, 1, 0.0, 10.0, 3, True) for _ in range(4)]
        assert got == [K.NEW_POOLED] * 3 + [K.NEW_ONE_OFF]     # pool of 3 full: one-off
        for t in (1.0, 3.0, 2.0):
            rel(idle, n_idle, 1, t, True, True)
        rel(idle, n_idle, 1, 4.0, False, True)                  # a one-off just closes
        assert acq(idle, n_idle, n_open, 1, 5.0, 10.0, 3, True) == K.REUSED
        assert list(idle[1, :n_idle[1]]) == [1.0, 2.0]          # the one idle since 3 s went
        # At 11.5 s the one idle since 1 s has expired (10.5 s > 10 s): the one since 2 s
        # is taken, and the pool has one connection fewer.
        assert acq(idle, n_idle, n_open, 1, 11.5, 10.0, 3, True) == K.REUSED
        assert n_idle[1] == 0 and n_open[1] == 2
        rel(idle, n_idle, 1, 12.0, True, True)
        dis(idle, n_idle, n_open, 1, 12.0, True)                # the client closed it
        assert n_idle[1] == 0 and n_open[1] == 1
        assert acq(idle, n_idle, n_open, 0, 0.0, 10.0, 3, False) == K.NEW_ONE_OFF
        return idle, n_idle, n_open

    fs = (K.pool_acquire, K.pool_release, K.pool_discard)
    for a, b in zip(play(*fs), play(*(python_of(f) for f in fs))):
        np.testing.assert_array_equal(a, b)
    assert K.request_net_s(0.01, 0.03, True, 0.02) == 0.04
    assert K.request_net_s(0.01, 0.03, False, 0.02) == 0.03


def test_t_net_and_t_stream_in_a_run():
    net = {"distance_km": 2000, "base_rtt_ms": 0, "tls": "1.3", "gateway_ms": 1.0,
           "request_overhead_bytes": 1000, "bytes_per_prompt_token": 0, "uplink_mbps": 8.0,
           "clients": 1, "pool_size": 1, "connection_reuse": False}
    stream = {"frame_overhead_bytes": 96, "bytes_per_token": 4, "downlink_mbps": 0.8}
    sc = make_scenario(network=net, stream=stream)
    wl = make_workload(3, rate=0.01, prompt=100, output=10)
    df = requests_table(simulate(sc, 0, workload=wl))
    rtt = 2 * 2000 / 200_000
    # New connection: TCP + TLS 1.3 (2 RTT), then one way, upload 1000 B at 8 Mb/s, gateway.
    np.testing.assert_allclose(df["t_net"], 2 * rtt + rtt / 2 + 0.001 + 0.001)
    # 100 B frames at 0.8 Mb/s = 1 ms each, faster than the engine: last frame 1 ms + one way.
    np.testing.assert_allclose(df["t_stream"], 0.001 + rtt / 2)
    slow = make_scenario(network=net, stream={**stream, "downlink_mbps": 0.008})  # 100 ms/frame
    df2 = requests_table(simulate(slow, 0, workload=wl))
    assert (df2["t_stream"] > 0.5).all()   # frames queue behind a slow client
    assert (df2["tpot"] >= 0.1 - 1e-9).all()


def test_connection_setup_software_and_name_lookup_are_paid_on_new_connections_only():
    """``connect_ms`` and ``dns_ms`` add to a new connection's round trips (arithmetic:
    T_net = handshake RTTs + connect + lookup + one way + gateway), and a request that
    reuses a pooled connection pays none of them."""
    base = {"distance_km": 0, "base_rtt_ms": 0.2, "tls": "none", "gateway_ms": 0.0,
            "request_overhead_bytes": 0, "bytes_per_prompt_token": 0, "clients": 1,
            "pool_size": 1}
    wl = make_workload(4, rate=0.01, prompt=100, output=10)   # far apart: the pool is idle
    one_way = 0.0001
    fresh = make_scenario(network={**base, "connection_reuse": False, "connect_ms": 0.7,
                                   "dns_ms": 0.2})
    t = NetworkTiming.from_config(fresh.network)
    assert t.handshake == pytest.approx(0.0002 + 0.0007 + 0.0002)   # TCP, set-up, lookup
    df = requests_table(simulate(fresh, 0, workload=wl))
    np.testing.assert_allclose(df["t_net"], 0.0002 + 0.0009 + one_way, rtol=1e-9)
    pooled = make_scenario(network={**base, "connect_ms": 0.7, "dns_ms": 0.2})
    df2 = requests_table(simulate(pooled, 0, workload=wl))
    # The first request opens the pooled connection; the others reuse it.
    np.testing.assert_allclose(df2["t_net"], [0.0011 + one_way] + [one_way] * 3, rtol=1e-9)
    # Zero set-up is today's handshake exactly.
    plain = make_scenario(network={**base, "connection_reuse": False})
    assert NetworkTiming.from_config(plain.network).handshake == pytest.approx(0.0002)


def test_noise_model_is_seeded_and_fitted_to_the_spread(refbench):
    rng = np.random.default_rng
    a = ProfileCostModel(refbench, noise=True, rng=rng(1))
    b = ProfileCostModel(refbench, noise=True, rng=rng(1))
    quiet = ProfileCostModel(refbench)
    xs = [a.step_time(8, 1024, 8 * 1024, []) for _ in range(4000)]
    assert xs[:50] == [b.step_time(8, 1024, 8 * 1024, []) for _ in range(50)]
    base = quiet.step_time(8, 1024, 8 * 1024, [])
    # Mean-preserving log-normal whose sigma comes from the rows' p10/p90.
    assert np.mean(xs) == pytest.approx(base, rel=0.01)
    assert 0 < a.noise_sigma < 0.2
    assert np.std(np.log(xs)) == pytest.approx(a.noise_sigma, rel=0.1)
    # The vectorised epoch path draws from the same distribution.
    ys = [a.decode_times(8, 1024, 1)[0] for _ in range(4000)]
    assert np.mean(ys) == pytest.approx(base, rel=0.01)
    assert np.std(np.log(ys)) == pytest.approx(a.noise_sigma, rel=0.1)


def test_non_final_chunks_skip_the_lm_head():
    prof = make_profile(prefill=((64, 0, 10.0), (256, 0, 20.0)))
    prof["prefill_partial"] = [{"chunk": 64, "prior": 0, "ms": 7.0},
                               {"chunk": 256, "prior": 0, "ms": 17.5}]
    m = ProfileCostModel(prof)
    assert m.lm_head_ms == pytest.approx(2.75)   # median of 3.0 and 2.5
    assert m.step_time(0, 0, 0, [(128, 0, True)]) == pytest.approx(0.01333333, rel=1e-6)
    assert m.step_time(0, 0, 0, [(128, 0, False)]) == pytest.approx(0.01333333 - 0.00275,
                                                                   rel=1e-6)
    assert m.step_time(0, 0, 0, [(128, 0)]) == m.step_time(0, 0, 0, [(128, 0, True)])
