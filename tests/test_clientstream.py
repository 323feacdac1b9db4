"""The per-request SSE stream model against closed forms: bandwidth-bound delivery,
coalescing, heartbeats, the three backpressure policies, disconnects and HTTP/2
link sharing; and the stream config's validation and seeded draws."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import make_scenario_dict
from simulator.wire.clientstream import ClientStream, Link, StreamParams, StreamStats
from simulator.config.scenario import validate_scenario
from simulator.config.wire import StreamConfig
from simulator.errors import LatsimError
from simulator.wire.stream import DisconnectDraws, client_downlinks_bps, stream_params

F = 100.0          # frame bytes: 96 B envelope + 4 B token
BPS = 800_000.0    # 1 ms per 100 B frame


def params(**kw) -> StreamParams:
    base = dict(frame_overhead_bytes=96.0, bytes_per_token=4.0, downlink_bps=BPS, one_way=0.01)
    base.update(kw)
    return StreamParams(**base)


def drive(st: ClientStream, n: int, dt: float, t0: float = 0.0, obey_block: bool = True):
    """An engine producing ``n`` tokens ``dt`` apart, pausing while the stream blocks it.
    Returns the emit times and the stream's result."""
    t = t0
    times = []
    for _ in range(n):
        if obey_block and st.blocked(t):
            t2 = st.unblock_time(t)
            assert t2 > t and not st.blocked(t2)
            t = t2
        st.emit(t)
        times.append(t)
        t += dt
    return np.array(times), st.close(times[-1])


def test_bandwidth_bound_client_gets_frames_at_the_link_rate():
    n = 50
    c = F * 8 / BPS
    st = ClientStream(params(), 0.0)
    for _ in range(n):
        st.emit(0.0)       # the engine is infinitely fast: the link is the bottleneck
    r = st.close(0.0)
    assert r.frames == n and r.bytes == n * F
    assert r.first_arrival == pytest.approx(c + 0.01)
    assert r.last_arrival == pytest.approx(n * c + 0.01)        # N x frame_bytes x 8 / bps
    np.testing.assert_allclose(r.gaps, c)
    assert r.peak_buffer_bytes == n * F and r.tokens_delivered == n


def test_engine_bound_client_sees_the_engine_gaps_plus_one_frame_time():
    times = np.array([0.0, 0.02, 0.05, 0.051, 0.3])
    st = ClientStream(params(), 0.0)
    for t in times:
        st.emit(t)
    r = st.close(times[-1])
    c = F * 8 / BPS
    # Token 4 comes 1 ms after token 3, while frame 3 is still on the wire: it queues.
    arrivals = np.array([times[0] + c, times[1] + c, times[2] + c, times[2] + 2 * c,
                         times[4] + c]) + 0.01
    np.testing.assert_allclose(np.concatenate(([r.first_arrival], r.first_arrival + np.cumsum(r.gaps))),
                               arrivals)
    assert r.peak_buffer_bytes == 2 * F


@pytest.mark.parametrize("k", [1, 2, 5, 10])
def test_coalescing_every_k_tokens_divides_the_frames(k):
    n = 40
    st = ClientStream(params(every_tokens=k), 0.0)
    times, r = drive(st, n, 0.01)
    assert r.frames == n // k
    assert r.bytes == pytest.approx(n // k * 96 + n * 4)
    # Tokens of one frame arrive together; frames are k engine steps apart.
    arrivals = (r.first_arrival + np.concatenate(([0.0], np.cumsum(r.gaps)))).reshape(-1, k)
    assert np.all(arrivals == arrivals[:, :1])
    np.testing.assert_allclose(np.diff(arrivals[:, 0]), k * 0.01)
    assert r.last_arrival == pytest.approx(times[-1] + (96 + 4 * k) * 8 / BPS + 0.01)


def test_coalescing_by_time_flushes_after_every_ms():
    # Tokens every 10 ms, flush 35 ms after the oldest pending one: 4 tokens per frame,
    # written at 35 ms, 75 ms, ...; the last partial frame at close.
    n = 18
    st = ClientStream(params(every_tokens=None, every_ms=35.0), 0.0)
    times, r = drive(st, n, 0.010)
    assert r.frames == math.ceil(n / 4)
    first_frame = (96 + 16) * 8 / BPS
    assert r.first_arrival == pytest.approx(0.035 + first_frame + 0.01)
    assert np.count_nonzero(r.gaps) == r.frames - 1


def test_count_or_time_whichever_first():
    st = ClientStream(params(every_tokens=3, every_ms=25.0), 0.0)
    for t in (0.0, 0.001, 0.002, 0.100, 0.200):   # 3 quickly (count), then sparse (timer)
        st.emit(t)
    r = st.close(0.300)
    assert r.frames == 3                 # [3 tokens], [token at .100 flushed at .125], [.200]
    assert r.tokens_delivered == 5


@pytest.mark.parametrize("wait", [0.5, 14.9, 15.0, 31.0, 47.3, 120.0])
def test_heartbeats_while_waiting_are_floor_wait_over_period(wait):
    st = ClientStream(params(heartbeat_s=15.0, heartbeat_bytes=8.0), 100.0)
    st.emit(100.0 + wait)
    r = st.close(100.0 + wait)
    hb = math.floor(wait / 15.0)
    assert r.heartbeats == hb
    assert r.bytes == pytest.approx(F + 8 * hb)
    assert r.frames == 1


def test_heartbeats_resume_when_the_stream_stalls_and_not_when_busy():
    st = ClientStream(params(heartbeat_s=1.0), 0.0)
    st.emit(0.5)           # no heartbeat before (0.5 < 1)
    st.emit(4.2)           # stalled 3.7 s after the first frame: 3 heartbeats at 1.5, 2.5, 3.5
    assert st.close(4.2).heartbeats == 3
    # A very slow client: its queue is never empty, so every due heartbeat is skipped.
    slow = ClientStream(params(heartbeat_s=1.0, downlink_bps=80.0), 0.0)   # 10 s per frame
    slow.emit(0.0)
    slow.emit(0.0)
    assert slow.close(15.0).heartbeats == 0


def test_block_never_holds_more_than_capacity_and_paces_the_engine():
    cap = 5 * F
    n = 200
    c = F * 8 / BPS
    st = ClientStream(params(buffer_bytes=cap, backpressure="block"), 0.0)
    times, r = drive(st, n, 0.0001)    # an engine 10x faster than the client
    assert r.peak_buffer_bytes <= cap
    assert r.peak_buffer_bytes == cap
    assert r.blocked_s > 0 and not r.degraded
    assert r.tokens_delivered == n and r.frames == n
    # The client is the bottleneck all the same: the last frame leaves at n x c.
    assert r.last_arrival == pytest.approx(n * c + 0.01)
    # ... and the engine was held back to the client's pace: token j's write waits for
    # frame j - 5 to leave (at (j - 4) c), and the engine stops while it waits, so token
    # j + 1 comes no earlier than that.
    j = np.arange(6, n)
    assert np.all(times[j] >= (j - 5) * c - 1e-12)
    assert np.all(times[j] <= (j - 5) * c + 0.0001 + 1e-12)


def test_buffer_policy_grows_and_reports_its_peak():
    # Tokens every 1 ms, frames take 3.2 ms: at the 10th write (t = 9 ms) floor(9/3.2) = 2
    # frames have left, so 8 are queued.
    c = 0.0032
    st = ClientStream(params(downlink_bps=F * 8 / c, buffer_bytes=3 * F), 0.0)
    times, r = drive(st, 10, 0.001, obey_block=False)
    assert r.peak_buffer_bytes == pytest.approx(8 * F)
    assert r.over_capacity and not r.degraded and r.blocked_s == 0
    assert not st.blocked(times[-1])


def test_degrade_sends_the_rest_as_one_body_at_close():
    n = 30
    st = ClientStream(params(buffer_bytes=3 * F, backpressure="degrade"), 0.0)
    for _ in range(n):
        st.emit(0.0)       # a burst: the 4th frame would overflow the 3-frame buffer
        assert not st.blocked(0.0)
    r = st.close(0.5)
    assert r.degraded and r.frames == 3 + 1
    assert r.tokens_delivered == n
    body = 96 + 4 * (n - 3)
    assert r.bytes == pytest.approx(3 * F + body)
    # The body is written at close, when the three streamed frames are long gone.
    assert r.last_arrival == pytest.approx(0.5 + body * 8 / BPS + 0.01)
    assert np.all(r.gaps[3:] == 0) and r.gaps[2] > 0.4


def test_a_silent_disconnect_leaves_a_block_stream_blocked_forever():
    st = ClientStream(params(buffer_bytes=3 * F, backpressure="block"), 0.0)
    st.emit(0.0)
    st.disconnect(0.0005)      # mid-way through the first frame: it never completes
    for t in (0.001, 0.002, 0.003):
        st.emit(t)
    assert st.blocked(10.0) and st.unblock_time(10.0) == math.inf
    r = st.close(50.0, cancelled=True)
    assert r.tokens_delivered == 0 and r.cancelled
    assert math.isnan(r.first_arrival)
    assert st.close(60.0) is r          # idempotent


def test_first_token_callback_gets_the_client_arrival():
    seen = []
    st = ClientStream(params(every_tokens=2), 0.0, on_first_token=seen.append)
    st.emit(0.1)
    assert seen == []                   # still pending (coalescing)
    st.emit(0.2)
    assert seen == [pytest.approx(0.2 + (96 + 8) * 8 / BPS + 0.01)]
    st.emit(0.3)
    st.close(0.3)
    assert len(seen) == 1


def test_http2_streams_share_the_clients_downlink():
    n = 20
    c = F * 8 / BPS
    link = Link()
    a, b = ClientStream(params(), 0.0, link), ClientStream(params(), 0.0, link)
    for _ in range(n):
        a.emit(0.0)
        b.emit(0.0)
    ra, rb = a.close(0.0), b.close(0.0)
    assert max(ra.last_arrival, rb.last_arrival) == pytest.approx(2 * n * c + 0.01)
    own = ClientStream(params(), 0.0)
    for _ in range(n):
        own.emit(0.0)
    assert own.close(0.0).last_arrival == pytest.approx(n * c + 0.01)


def test_stats_add_up():
    stats = StreamStats()
    for k in (1, 2):
        st = ClientStream(params(every_tokens=k), 0.0)
        drive(st, 10, 0.01)
        stats.add(st.result)
    d = stats.as_dict()
    assert (d["streams"], d["frames"], d["tokens_delivered"]) == (2, 15, 20)
    assert d["tokens_per_frame"] == pytest.approx(20 / 15)


def test_params_and_config_reject_inconsistent_settings():
    with pytest.raises(ValueError, match="needs buffer_bytes"):
        StreamParams(backpressure="block")
    with pytest.raises(ValueError, match="every_tokens or every_ms"):
        StreamParams(every_tokens=None)
    bad = [
        ({"backpressure": "degrade"}, r"stream.*needs buffer_bytes"),
        ({"buffer_bytes": 50}, r"smaller than one frame"),
        ({"downlink_mbps": 5, "downlink": {"kind": "fixed", "mbps": 3}}, r"not both"),
        ({"every_tokens": None}, r"cannot both be null"),
        ({"backpressure": "drop", "buffer_bytes": 1000}, r"stream.backpressure"),
        ({"downlink": {"kind": "lognormal", "median_mbps": 5}}, r"sigma"),
        ({"disconnect": {"probability": 1.5}}, r"stream.disconnect.probability"),
        ({"disconnect": {"probability": 0.1, "after_first_token": {"kind": "weibull"}}},
         r"after_first_token"),
    ]
    for stream, pat in bad:
        with pytest.raises(LatsimError, match=pat):
            validate_scenario(make_scenario_dict(stream=stream))
    assert not StreamConfig().rich
    assert StreamConfig(heartbeat_s=15).rich


def test_downlink_draws_are_seeded_and_follow_the_distribution():
    rng = np.random.default_rng
    tiers = StreamConfig(downlink={"kind": "tiers", "tiers": [{"mbps": 100, "share": 3},
                                                              {"mbps": 1, "share": 1}]})
    a = client_downlinks_bps(tiers, 4000, rng(3))
    np.testing.assert_array_equal(a, client_downlinks_bps(tiers, 4000, rng(3)))
    assert set(np.unique(a)) == {1e6, 100e6}
    assert np.mean(a == 1e6) == pytest.approx(0.25, abs=0.03)
    logn = StreamConfig(downlink={"kind": "lognormal", "median_mbps": 20, "sigma": 1.0,
                                  "min_mbps": 0.5})
    b = client_downlinks_bps(logn, 4000, rng(3))
    assert np.median(b) == pytest.approx(20e6, rel=0.1) and b.min() >= 0.5e6
    np.testing.assert_array_equal(client_downlinks_bps(StreamConfig(), 3, rng(0)), 50e6)
    p = stream_params(logn, b[0], 0.02)
    assert p.downlink_bps == b[0] and p.one_way == 0.02


def test_disconnect_draws():
    cfg = StreamConfig(disconnect={"probability": 0.2, "signalled": 0.75,
                                   "after_first_token": {"kind": "uniform", "low_s": 1,
                                                         "high_s": 3}}).disconnect
    d = DisconnectDraws.sample(cfg, 20_000, np.random.default_rng(1))
    assert d.leaves.mean() == pytest.approx(0.2, abs=0.01)
    assert d.signalled.mean() == pytest.approx(0.75, abs=0.01)
    assert d.after_s.min() >= 1 and d.after_s.max() <= 3


# -- in whole runs (the replica drives the streams) -------------------------------------

from conftest import ZERO_NET, ZERO_STREAM, make_scenario, make_workload  # noqa: E402
from simulator.report.metrics import requests_table  # noqa: E402
from simulator.loops.simulate import simulate  # noqa: E402


def test_rich_model_with_neutral_settings_reproduces_the_default_model():
    stream = {"frame_overhead_bytes": 96, "bytes_per_token": 4, "downlink_mbps": 0.02}
    net = {"distance_km": 1000, "tls": "1.3", "clients": 8}
    wl = make_workload(80, rate=6, prompt=300, output=30)
    a = simulate(make_scenario(stream=stream, network=net), 0, workload=wl, mode="slow")
    # A heartbeat period no request lasts turns the per-request streams on, changing nothing.
    b = simulate(make_scenario(stream={**stream, "heartbeat_s": 1e6}, network=net), 0,
                 workload=wl)
    assert "stream" in b.meta and "stream" not in a.meta
    da, db = requests_table(a), requests_table(b)
    for col in ("enqueued", "scheduled", "first_token", "last_token", "first_delivered",
                "last_delivered"):
        np.testing.assert_allclose(db[col], da[col], rtol=0, atol=1e-12)
    assert b.rec.itl.n == a.rec.itl.n
    assert b.rec.itl.quantile(0.99) == a.rec.itl.quantile(0.99)
    assert b.meta["stream"]["frames"] == wl.output_tokens.sum()


def test_heartbeats_in_a_run_count_the_waits_in_queue_and_prefill():
    sc = make_scenario(stream={**ZERO_STREAM, "heartbeat_s": 0.05},
                       engine={"policy": "fifo", "max_num_seqs": 1,
                               "max_num_batched_tokens": 2048, "kv": {"num_blocks": 4096}})
    wl = make_workload(30, rate=20, prompt=300, output=5)
    res = simulate(sc, 0, workload=wl)
    df = requests_table(res)
    wait = (df["first_token"] - df["enqueued"]).to_numpy()
    assert wait.max() > 0.2                                   # a real queue
    assert res.meta["stream"]["heartbeats"] == np.floor(wait / 0.05).sum()


SLOW_TIERS = {"kind": "tiers", "tiers": [{"mbps": 50, "share": 0.5},
                                         {"mbps": 0.016, "share": 0.5}]}


@pytest.fixture(scope="module")
def backpressure_runs():
    wl = make_workload(40, rate=2, prompt=200, output=60, seed=4)
    out = {}
    for policy in ("block", "buffer", "degrade"):
        sc = make_scenario(network={**ZERO_NET, "clients": 10},
                           stream={"frame_overhead_bytes": 80, "bytes_per_token": 4,
                                   "downlink": SLOW_TIERS, "buffer_bytes": 1000,
                                   "backpressure": policy})
        res = simulate(sc, 0, workload=wl)
        out[policy] = (res, requests_table(res))
    return out


def test_backpressure_policies_in_a_run(backpressure_runs):
    (rb, db), (rf, dfb), (rd, dd) = (backpressure_runs[k] for k in ("block", "buffer", "degrade"))
    sb, sf, sd = rb.meta["stream"], rf.meta["stream"], rd.meta["stream"]
    assert db["finished"].all() and dfb["finished"].all() and dd["finished"].all()
    # block: never more than the buffer queued; the slow clients' requests were held.
    assert sb["peak_buffer_bytes_max"] <= 1000 and sb["blocked_streams"] > 0
    # buffer: the queue grew past it, in server memory.
    assert sf["peak_buffer_bytes_max"] > 1000 and sf["over_capacity"] > 0
    assert sf["blocked_s"] == 0
    # degrade: the overflowing streams switched to one body each.
    assert sd["degraded"] == sf["over_capacity"] and sd["frames"] < sf["frames"]
    # Blocking moves the slow clients' wait from streaming to decoding; their end-to-end
    # latency is set by their link either way.
    slow = (db["t_stream"] > 0.5) | (dfb["t_stream"] > 0.5)
    assert slow.any()
    assert (db["t_decode"][slow] > dfb["t_decode"][slow]).all()
    assert (db["t_stream"][slow] < dfb["t_stream"][slow]).all()
    np.testing.assert_allclose(db["e2el"][slow], dfb["e2el"][slow], rtol=0.05)
    # ... and a single body is faster for them than 60 enveloped frames.
    assert (dd["e2el"][slow] < dfb["e2el"][slow]).all()


def disconnect_run(signalled: bool, output: int):
    sc = make_scenario(
        cluster={"replicas": 1, "gpus_per_replica": 2},
        network={**ZERO_NET, "distance_km": 2000},
        stream={**ZERO_STREAM, "disconnect": {
            "probability": 1.0, "signalled": 1.0 if signalled else 0.0,
            "after_first_token": {"kind": "constant", "s": 1.0},
            "heartbeat_timeout_s": 45.0, "gpu_cost_per_hour": 3.6}})
    res = simulate(sc, 0, workload=make_workload(1, rate=1.0, prompt=100, output=output))
    return res, requests_table(res)


def test_silent_disconnect_is_found_by_the_heartbeat_timeout_and_priced():
    res, df = disconnect_run(signalled=False, output=8000)   # would decode for > 60 s
    rec, m = res.rec, res.meta["stream"]
    t_left = rec.first_delivered[0] + 1.0
    assert rec.cancelled[0] and not df["finished"][0]
    # Cancelled at the first step boundary after the 45 s timeout, long before its end.
    assert t_left + 45.0 <= rec.cancelled_at[0] < t_left + 45.0 + 0.05
    assert rec.generated[0] < 8000
    assert (m["disconnects_unsignalled"], m["disconnects_cancelled"]) == (1, 1)
    wasted = rec.cancelled_at[0] - t_left
    assert m["wasted_request_s_unsignalled"] == pytest.approx(wasted)
    # Alone on its replica it held both GPUs the whole time.
    assert m["wasted_gpu_s_unsignalled"] == pytest.approx(2 * wasted)
    assert m["wasted_cost_usd_unsignalled"] == pytest.approx(2 * wasted / 3600 * 3.6)


def test_signalled_disconnect_cancels_one_way_later():
    res, df = disconnect_run(signalled=True, output=8000)
    rec, m = res.rec, res.meta["stream"]
    t_left = rec.first_delivered[0] + 1.0
    one_way = 2000 / 200_000
    assert t_left + one_way <= rec.cancelled_at[0] < t_left + one_way + 0.05
    assert m["disconnects_signalled"] == 1 and m["wasted_gpu_s_unsignalled"] == 0
    assert m["wasted_gpu_s_signalled"] == pytest.approx(2 * (rec.cancelled_at[0] - t_left))


def test_silent_disconnect_of_a_request_that_ends_first_wastes_its_remaining_decode():
    res, df = disconnect_run(signalled=False, output=400)    # ends a few s after leaving
    from simulator.report.metrics import outcome_names, unfinished
    rec, m = res.rec, res.meta["stream"]
    t_left = rec.first_delivered[0] + 1.0
    assert rec.last_token[0] > t_left
    assert not df["finished"][0]                 # its client never got the end
    assert m["disconnects_cancelled"] == 0       # the server never cancelled it ...
    assert np.isnan(rec.cancelled_at[0])
    # ... but its client is gone: it ended cancelled, not unfinished (a run that ended
    # with it "never completed" exited 1: scenarios/slow-clients.yaml did).
    assert rec.cancelled[0] and df["cancelled"][0]
    assert list(outcome_names(rec)) == ["cancelled"]
    assert unfinished(df, None) == {"rejected": 0, "cancelled": 1, "refused": 0,
                                    "timed_out": 0, "failed": 0, "cut": 0, "stuck": 0}
    assert m["wasted_request_s_unsignalled"] == pytest.approx(rec.last_token[0] - t_left)


def test_shipped_slow_clients_scenario_runs_under_each_policy():
    from simulator.config.scenario import load_scenario
    from conftest import REPO
    peaks = {}
    for policy in ("block", "buffer", "degrade"):
        sc, base = load_scenario(REPO / "scenarios" / "slow-clients.yaml",
                                 [f"stream.backpressure={policy}", "workload.num_requests=150",
                                  # more slow clients than shipped, so that 150 requests meet some
                                  "stream.downlink.tiers=[{mbps: 50, share: 0.7}, "
                                  "{mbps: 0.016, share: 0.3}]"])
        res = simulate(sc, base_dir=base)
        m = res.meta["stream"]
        assert m["streams"] > 0 and m["disconnects"] == (m["disconnects_signalled"]
                                                          + m["disconnects_unsignalled"])
        peaks[policy] = m["peak_buffer_bytes_max"]
        assert (m["blocked_streams"] > 0) == (policy == "block")
        assert (m["degraded"] > 0) == (policy == "degrade")
    assert peaks["block"] <= 2048 < peaks["buffer"]


def test_batch_share_seconds_integrates_one_over_the_batch():
    from simulator.report.metrics import batch_share_seconds
    ts, running = [0.0, 1.0, 2.0, 3.0], [1, 2, 4, 0]
    # 0.5 s alone, 1 s in a batch of 2, 0.5 s in a batch of 4.
    assert batch_share_seconds(ts, running, 0.5, 2.5) == pytest.approx(0.5 + 0.5 + 0.125)
    # After the last sample (batch 0 read as 1: the request itself) and before the first.
    assert batch_share_seconds(ts, running, 3.0, 5.0) == pytest.approx(2.0)
    assert batch_share_seconds(ts, running, -1.0, 0.0) == pytest.approx(1.0)
    assert batch_share_seconds(ts, running, 2.0, 2.0) == 0.0
