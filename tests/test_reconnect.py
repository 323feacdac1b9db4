"""SSE auto-reconnect (``stream.reconnect``; ``wire.streamdrop``, ``wire.reconnect``):
closed forms on one request (resume: the added time is detection + retry + handshake +
one way, no token lost; restart: the tokens generated again are those the dropped
attempt generated before its cancel took effect, and the new attempt is the first one
shifted by the retry), drawn drops over many requests, the write timeout as a drop, no
drops bit-identical to no reconnect config, and bad input."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import make_profile, make_scenario, make_scenario_dict, make_workload
from loopcheck import assert_identical
from simulator.loops.simulate import simulate
from simulator.report.metrics import BREAKDOWN, add_derived, requests_table
from simulator.wire.network import NetworkTiming

NET = {"distance_km": 1000, "tls": "1.3"}       # RTT 12 ms: handshake 24 ms, one way 6 ms
STREAM = {"frame_overhead_bytes": 80, "bytes_per_token": 4, "heartbeat_s": 5}
FRAME_S = 84 * 8 / 50e6                           # one frame on the 50 Mb/s downlink


def _run(rc=None, *, n=1, output=200, stream=None, wl=None, **over):
    st = {**STREAM, **(stream or {})}
    if rc is not None:
        st["reconnect"] = rc
    sc = make_scenario(stream=st, network=dict(NET), **over)
    res = simulate(sc, 0, workload=wl if wl is not None else
                   make_workload(n, rate=2.0, prompt=100, output=output), loop="simpy")
    return sc, res, add_derived(requests_table(res))


def _gap(sc, retry_ms, detect_ms=0.0):
    tm = NetworkTiming.from_config(sc.network)
    return detect_ms / 1000 + retry_ms / 1000 + tm.handshake + tm.one_way, tm


def _adds_up(df):
    # Five differences of timestamps of a few seconds summed: rounding of 1e-15 s each.
    np.testing.assert_allclose(df[list(BREAKDOWN)].sum(axis=1), df["e2el"], rtol=0, atol=1e-12)


def test_resume_after_the_last_token_adds_detect_retry_handshake_one_way():
    _sc, _b, base = _run()
    t_d = float(base.last_token[0]) + (FRAME_S + 0.006) / 2    # the last frame in flight
    sc, res, df = _run({"mode": "resume", "drops_at_s": [t_d], "retry_ms": 500,
                        "detect_ms": 20})
    gap, tm = _gap(sc, 500, 20)
    assert gap == pytest.approx(0.5 + 0.02 + 0.024 + 0.006, abs=1e-12)
    # The last frame is lost, written again when the reconnection reaches the server and
    # arrives one frame time and one way later.
    assert df.last_delivered[0] == pytest.approx(t_d + gap + FRAME_S + tm.one_way, abs=1e-12)
    # Nothing before the stream changed; the gap is in T_stream.
    for c in ("t_net", "t_queue", "t_prefill", "t_decode", "ttft"):
        assert df[c][0] == base[c][0], c
    assert df.t_stream[0] == pytest.approx(t_d + gap + FRAME_S + tm.one_way
                                           - base.last_token[0], abs=1e-12)
    _adds_up(df)
    s = res.meta["stream"]
    assert s["tokens_delivered"] == s["tokens_emitted"] == 200
    rc = s["reconnect"]
    assert (rc["drops"], rc["resumed"], rc["tokens_replayed"]) == (1, 1, 1)
    assert rc["reconnect_gap_s"] == pytest.approx(gap, abs=1e-12)
    assert res.connections["new"] == 2          # the reconnection is a new connection


def test_resume_under_drawn_drops_loses_no_token():
    sc, res, df = _run({"mode": "resume", "drop_per_s": 0.5, "retry_ms": 300,
                        "max_reconnects": 20}, n=60, output=300)
    gap, _tm = _gap(sc, 300)
    s = res.meta["stream"]
    rc = s["reconnect"]
    assert rc["resumed"] == rc["drops"] > 20 and rc["given_up"] == 0
    assert df["finished"].all() and (res.rec.generated == 300).all()
    assert s["tokens_delivered"] == s["tokens_emitted"] == 60 * 300
    # Each reconnection reaches the server retry + handshake + one way after its drop.
    assert rc["reconnect_gap_s"] == pytest.approx(rc["resumed"] * gap, rel=1e-12)
    _adds_up(df)


def _constant_steps(tmp_path):
    """A profile whose every decode step takes 10 ms (one point: no interpolation)."""
    import json
    p = tmp_path / "const.json"
    p.write_text(json.dumps(make_profile(decode=((1, 1, 10.0),))))
    return {"cost": {"kind": "profile", "path": str(p)}}


def test_restart_regenerates_what_the_dropped_attempt_generated(tmp_path):
    model = _constant_steps(tmp_path)
    _sc, _b, base = _run(model=model)
    ft = float(base.first_token[0])
    step = (float(base.last_token[0]) - ft) / 199
    assert step == pytest.approx(0.010, rel=1e-9)
    t_d = ft + 0.5003                      # mid-decode; the reset reaches the server mid-step
    sc, res, df = _run({"mode": "restart", "drops_at_s": [t_d], "retry_ms": 500,
                        "detect_ms": 20}, model=model)
    tm = NetworkTiming.from_config(sc.network)
    # The server cancels when the reset reaches it (one way after the drop); the step in
    # flight completes: the first token and one per completed decode step.
    regenerated = math.ceil((t_d + tm.one_way - ft) / step) + 1
    rc = res.meta["stream"]["reconnect"]
    assert (rc["drops"], rc["restarted"], rc["tokens_regenerated"]) == (1, 1, regenerated)
    # The new attempt, sent retry_ms after the client noticed, is the first one shifted.
    retry = t_d + 0.02 + 0.5 - float(base.arrival[0])
    assert df.attempts[0] == 2 and df.retry_s[0] == pytest.approx(retry, abs=1e-12)
    assert df.e2el[0] == pytest.approx(base.e2el[0] + retry, abs=1e-9)
    assert df.t_net[0] == pytest.approx(base.t_net[0] + retry, abs=1e-9)
    for c in ("t_queue", "t_prefill", "t_decode", "t_stream"):
        assert df[c][0] == pytest.approx(base[c][0], abs=1e-9), c
    assert df.finished[0] and not df.cancelled[0] and res.rec.generated[0] == 200
    _adds_up(df)
    s = res.meta["stream"]
    # The client got the first attempt's tokens that arrived before the drop, then all.
    before = math.floor((t_d - ft - FRAME_S - tm.one_way) / step) + 1
    assert s["tokens_delivered"] == before + 200
    assert s["tokens_emitted"] == regenerated + 200


def test_restart_with_prefix_caching_hits_its_own_prompt(tmp_path):
    model = _constant_steps(tmp_path)
    eng = make_scenario_dict()["engine"]
    eng["kv"] = {"num_blocks": 4096, "prefix_caching": True}
    wl = make_workload(1, rate=2.0, prompt=2000, output=200)
    wl.shared_prefix_tokens = np.array([1600])   # a system prompt: blocks with keys
    _sc, _b, base = _run(model=model, engine=eng, wl=wl)
    t_d = float(base.first_token[0]) + 0.5003
    _sc, _r, df = _run({"mode": "restart", "drops_at_s": [t_d], "retry_ms": 100},
                       model=model, engine=eng, wl=wl)
    # The second attempt finds the first one's system-prompt blocks cached: it prefills
    # only the rest (1 ms per token on this profile: 2 s alone, ~0.4 s after the hit).
    assert df.attempts[0] == 2 and df.t_prefill[0] < 0.5 * base.t_prefill[0]


def test_a_stream_lost_without_reconnect_is_cancelled():
    _sc, _b, base = _run()
    t_d = float(base.first_token[0]) + 0.5
    _sc, res, df = _run({"mode": "none", "drops_at_s": [t_d]})
    assert df.cancelled[0] and not df.finished[0]
    assert res.meta["stream"]["reconnect"]["given_up"] == 1


def test_a_client_that_cannot_drain_times_out_again_after_each_reconnection():
    # 1 kb/s: one 84-byte frame takes 0.67 s to leave, past the 0.5 s write timeout; a
    # two-frame buffer. Every reconnection's replay fills the buffer and times out again.
    st = {"downlink_mbps": 0.001, "buffer_bytes": 200, "backpressure": "block",
          "write_timeout_s": 0.5}
    sc, res, df = _run({"mode": "resume", "max_reconnects": 3, "retry_ms": 100},
                       stream=st, output=20)
    rc = res.meta["stream"]["reconnect"]
    gap, _tm = _gap(sc, 100)
    assert rc["drops"] == 4 and rc["resumed"] == 3 and rc["given_up"] == 1
    assert rc["reconnect_gap_s"] == pytest.approx(3 * gap, rel=1e-12)
    assert df.cancelled[0] and not df.finished[0]
    assert res.meta["stream"]["write_timeouts"] == 1    # the last one closed it for good
    _sc, res0, df0 = _run(None, stream=st, output=20)     # no reconnection: closed at once
    assert df0.cancelled[0] and res0.meta["stream"]["write_timeouts"] == 1


def test_no_drops_is_bit_identical_to_no_reconnect_config():
    # A rich stream (tiers, heartbeats, a blocking buffer, disconnects): with no drop rate,
    # and with plans attached whose one scheduled drop comes after every stream ended.
    st = {**STREAM, "buffer_bytes": 2048, "backpressure": "block",
          "downlink": {"kind": "tiers", "tiers": [{"mbps": 50, "share": 0.8},
                                                  {"mbps": 0.02, "share": 0.2}]},
          "disconnect": {"probability": 0.1, "signalled": 0.5}}
    wl = make_workload(80, rate=4.0, prompt=200, output=60)
    runs = []
    for rc in (None, {"mode": "resume", "drop_per_s": 0.0},
               {"mode": "resume", "drops_at_s": [1e5]},
               {"mode": "restart", "drops_at_s": [1e5]}):
        s = dict(st) if rc is None else {**st, "reconnect": rc}
        runs.append(simulate(make_scenario(stream=s, network=dict(NET)), 0, workload=wl))
    assert runs[1].sim_end == runs[0].sim_end
    for r in runs[2:]:
        # The clock runs on to the scheduled drop (an event of the run), nothing else moves.
        assert r.sim_end == 1e5
        r.sim_end = runs[0].sim_end
    for r in runs[1:]:
        assert_identical(runs[0], r)
        a, b = dict(runs[0].meta["stream"]), dict(r.meta["stream"])
        b.pop("reconnect", None)
        assert a == b


def test_compiled_loop_declines_drops_and_auto_says_why():
    from simulator.loops.simulate import Unsupported
    sc = make_scenario(stream={"reconnect": {"mode": "resume", "drop_per_s": 0.1}})
    wl = make_workload(3, rate=2, prompt=50, output=5)
    with pytest.raises(Unsupported, match="per-request stream models"):
        simulate(sc, 0, workload=wl, loop="compiled")
    assert "per-request stream" in simulate(sc, 0, workload=wl).meta["loop"]


@pytest.mark.parametrize("field, value", [("mode", "sometimes"), ("retry_ms", -1),
                                          ("drop_per_s", 1e9), ("drops_at_s", [5, -1]),
                                          ("max_reconnects", -2), ("detect", 1)])
def test_bad_reconnect_yaml_is_one_line_exit_2(tmp_path, field, value):
    import yaml
    from typer.testing import CliRunner
    from simulator.cli.main import app
    d = make_scenario_dict(stream={"reconnect": {field: value}})
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(d))
    r = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and "bad.yaml" in line and f"stream.reconnect.{field}" in line
    assert not (tmp_path / "o").exists()


def test_drops_with_traffic_control_say_which_model_they_need():
    from simulator.errors import LatsimError
    with pytest.raises(LatsimError, match="cluster.admission cannot be combined .*connection "
                                          "drops"):
        make_scenario(stream={"reconnect": {"drop_per_s": 0.1}}, cluster={"admission": {}})
