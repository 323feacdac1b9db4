"""Stream pacing to a target TPOT, the write timeout for clients that do not drain,
and SSE vs WebSocket framing bytes (issue 32, item 4), against arithmetic: the pure
``ClientStream`` model first, then whole runs where the replica drives the streams.

Times are chosen as binary fractions (2^-k seconds, links of 2^k bits/s) so that the
sums the model does are exact in floating point and the tests can compare with ``==``."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import ZERO_NET, make_scenario, make_scenario_dict, make_workload
from simulator.config.scenario import validate_scenario
from simulator.config.wire import StreamConfig
from simulator.errors import LatsimError
from simulator.loops.simulate import simulate
from simulator.report.metrics import outcome_names, requests_table
from simulator.wire.clientstream import ClientStream, StreamParams, framing_bytes

# 124 B envelope + 4 B token = 128 B = 1024 bits; at 2^20 b/s a frame takes 2^-10 s.
BPS = float(2 ** 20)
FT = 2.0 ** -10
OW = 2.0 ** -5
TARGET = 2.0 ** -6          # 15.625 ms


def params(**kw) -> StreamParams:
    base = dict(frame_overhead_bytes=124.0, bytes_per_token=4.0, downlink_bps=BPS, one_way=OW)
    base.update(kw)
    return StreamParams(**base)


def play(p: StreamParams, times) -> "object":
    st = ClientStream(p, 0.0)
    for t in times:
        st.emit(float(t))
    return st.close(float(times[-1]))


def test_pacing_releases_token_k_at_first_plus_k_targets_when_generation_is_faster():
    n = 40
    gen = np.arange(n) * 2.0 ** -9                # a token every ~2 ms, far under the target
    r = play(params(target_tpot_s=TARGET), gen)
    # Token 1 leaves when it is made; token k+1 exactly k targets later (the link takes
    # 1 ms per frame, under the target, so it never queues).
    assert r.first_arrival == gen[0] + FT + OW
    assert (r.gaps == TARGET).all() and len(r.gaps) == n - 1
    assert r.last_arrival == r.first_arrival + (n - 1) * TARGET
    # E2E grows, ITL smooths: unpaced, the client would get the last token at gen[-1] + FT + OW.
    base = play(params(), gen)
    assert r.last_arrival - base.last_arrival == (n - 1) * TARGET - gen[-1]
    assert base.gaps.max() == 2.0 ** -9


def test_pacing_changes_nothing_when_generation_is_slower_than_the_target():
    gen = np.cumsum(np.full(30, 2.0 ** -5))       # 31 ms per token > 15.6 ms target
    a = play(params(), gen)
    b = play(params(target_tpot_s=TARGET), gen)
    for f in ("first_arrival", "last_arrival", "tokens_delivered", "frames", "bytes",
              "last_depart", "blocked_s", "peak_buffer_bytes"):
        assert getattr(a, f) == getattr(b, f), f
    assert np.array_equal(a.gaps, b.gaps)


def test_pacing_does_not_block_the_engine_and_a_cancel_drops_unreleased_tokens():
    p = params(target_tpot_s=TARGET, buffer_bytes=4096.0, backpressure="block")
    st = ClientStream(p, 0.0)
    for k in range(10):
        t = k * 2.0 ** -9
        assert not st.blocked(t)                  # the pacer's queue is not the send buffer
        st.emit(t)
    # Released at 0, T, ..., 9T; cancelled at 4.5 T: tokens 1..5 released, the rest dropped.
    r = st.close(4.5 * TARGET, cancelled=True)
    assert r.tokens_emitted == 10 and r.tokens_delivered == 5


def slow_block(**kw) -> StreamParams:
    # 128 B frames at 1024 b/s: one second each; the buffer holds two frames.
    return params(downlink_bps=1024.0, buffer_bytes=256.0, backpressure="block", **kw)


def test_write_timeout_fires_exactly_when_a_write_waits_past_it():
    fired = []
    st = ClientStream(slow_block(write_timeout_s=0.5), 0.0, on_write_timeout=fired.append)
    st.emit(0.0)            # departs at 1 s
    st.emit(2.0 ** -6)      # departs at 2 s: the buffer is full
    st.emit(2.0 ** -5)      # waits for the first frame to leave at 1 s: 0.97 s > 0.5 s
    assert fired == [2.0 ** -5 + 0.5]
    assert st.blocked(0.1) and st.unblock_time(0.1) == math.inf
    r = st.close(1.0, cancelled=True)
    assert r.timed_out and r.blocked_s == 0.5
    # The same client with a timeout longer than its wait: no timeout, the write waits.
    fired2 = []
    st2 = ClientStream(slow_block(write_timeout_s=2.0), 0.0, on_write_timeout=fired2.append)
    for t in (0.0, 2.0 ** -6, 2.0 ** -5):
        st2.emit(t)
    assert fired2 == [] and st2.unblock_time(0.1) == 1.0
    assert not st2.close(1.0).timed_out


def test_write_timeout_catches_a_client_that_is_gone():
    fired = []
    st = ClientStream(slow_block(write_timeout_s=0.25), 0.0, on_write_timeout=fired.append)
    st.disconnect(0.0)      # nothing will ever drain
    st.emit(0.0)
    st.emit(0.125)
    st.emit(0.25)           # would wait forever: closed 0.25 s after it began waiting
    assert fired == [0.5]


def test_sse_and_websocket_bytes_per_frame_and_their_wire_time():
    payload = 90.0 + 4.0          # JSON envelope + one 4-byte token
    assert framing_bytes("sse", payload) == 6 + 94 + 2     # "data: " ... "\n\n"
    assert framing_bytes("websocket", payload) == 2 + 94   # RFC 6455: 7-bit length
    assert framing_bytes("websocket", 126.0) == 4 + 126    # 16-bit extended length
    assert framing_bytes("websocket", 65536.0) == 10 + 65536
    assert framing_bytes(None, payload) == payload
    sse = play(params(frame_overhead_bytes=90.0, framing="sse"), [0.0])
    ws = play(params(frame_overhead_bytes=90.0, framing="websocket"), [0.0])
    assert (sse.bytes, ws.bytes) == (102.0, 96.0)
    # The one frame's wire time differs by the 6 extra bytes over the link.
    assert sse.last_arrival - ws.last_arrival == 6 * 8 / BPS


# -- in whole runs ---------------------------------------------------------------------

def timeout_run(write_timeout_s):
    # 84 B frames at 0.0016 Mb/s: 0.42 s each. Short answers (5 tokens) fit in the 1000 B
    # buffer and never wait; long ones (60) fill it, and once full every write waits
    # about one frame time (0.42 s) for room.
    out = np.array([5, 60] * 6)
    sc = make_scenario(network={**ZERO_NET, "clients": 12},
                       stream={"frame_overhead_bytes": 80, "bytes_per_token": 4,
                               "downlink_mbps": 0.0016, "buffer_bytes": 1000,
                               "backpressure": "block", "write_timeout_s": write_timeout_s})
    res = simulate(sc, 0, workload=make_workload(12, rate=4, prompt=100, output=out))
    return res, requests_table(res), out


def test_write_timeout_cancels_exactly_the_stalled_streams_and_frees_their_kv():
    res, df, out = timeout_run(0.3)
    rec, m = res.rec, res.meta["stream"]
    long = out == 60
    assert (rec.cancelled == long).all() and df["finished"].to_numpy().tolist() == (~long).tolist()
    assert m["write_timeouts"] == long.sum()
    # Cancelled by the server while running (KV freed at the step boundary), long before
    # their 60 tokens: nothing lost, every request ends exactly once.
    assert np.isfinite(rec.cancelled_at[long]).all() and (rec.generated[long] < 60).all()
    names = list(outcome_names(rec))
    assert names.count("completed") == (~long).sum() and names.count("cancelled") == long.sum()
    assert len(names) == len(out)
    # A timeout longer than the longest wait (one frame, 0.42 s) cancels nothing.
    res2, df2, _ = timeout_run(0.6)
    assert df2["finished"].all() and res2.meta["stream"]["write_timeouts"] == 0


def test_paced_run_keeps_the_breakdown_exact_and_puts_the_delay_in_t_stream():
    wl = make_workload(20, rate=2, prompt=100, output=30)
    sc = make_scenario(network=ZERO_NET, stream={"target_tpot_ms": 50.0})
    res, base = simulate(sc, 0, workload=wl), simulate(
        make_scenario(network=ZERO_NET, stream={"heartbeat_s": 1e6}), 0, workload=wl)
    d, b = requests_table(res), requests_table(base)
    parts = d["t_net"] + d["t_queue"] + d["t_prefill"] + d["t_decode"] + d["t_stream"]
    np.testing.assert_allclose(parts, d["e2el"], rtol=0, atol=1e-9)   # sums of ~1 s floats
    # The engine is untouched; only delivery moves: no client gap below the target
    # (50 ms; the ITL histogram's log bins are 5e-4 wide, so its quantiles are good to
    # that relative error) and T_stream grows.
    np.testing.assert_array_equal(d["last_token"], b["last_token"])
    assert res.rec.itl.quantile(0.0) >= 0.05 * (1 - 5e-4)
    assert base.rec.itl.quantile(0.0) < 0.04          # unpaced, the engine's own gaps
    assert (d["t_stream"] > b["t_stream"]).all()


def test_stream_features_turn_on_the_per_request_model_and_bad_values_fail():
    for kw in ({"target_tpot_ms": 20}, {"framing": "sse"},
               {"write_timeout_s": 5, "backpressure": "block", "buffer_bytes": 4096}):
        assert StreamConfig(**kw).rich
    bad = [({"target_tpot_ms": 0}, "stream.target_tpot_ms"),
           ({"framing": "grpc"}, "stream.framing"),
           ({"write_timeout_s": 5}, "needs backpressure 'block'"),
           ({"write_timeout_s": -1, "backpressure": "block", "buffer_bytes": 4096},
            "stream.write_timeout_s")]
    for stream, pat in bad:
        with pytest.raises(LatsimError, match=pat):
            validate_scenario(make_scenario_dict(stream=stream))


def test_bad_stream_yaml_is_one_line_exit_2(tmp_path):
    import yaml
    from simulator.cli.main import app
    from typer.testing import CliRunner
    d = make_scenario_dict(stream={"target_tpot_ms": -5})
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(d))
    r = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and "bad.yaml" in line and "stream.target_tpot_ms" in line


def test_compiled_loop_declines_stream_features_and_auto_says_why():
    from simulator.loops.simulate import Unsupported
    wl = make_workload(3, rate=2, prompt=50, output=5)
    for stream in ({"target_tpot_ms": 20}, {"framing": "websocket"},
                   {"write_timeout_s": 5, "backpressure": "block", "buffer_bytes": 4096}):
        sc = make_scenario(stream=stream)
        with pytest.raises(Unsupported, match="per-request stream models"):
            simulate(sc, 0, workload=wl, loop="compiled")
        res = simulate(sc, 0, workload=wl)
        assert res.meta["loop"].startswith("simpy") and "per-request stream" in res.meta["loop"]
