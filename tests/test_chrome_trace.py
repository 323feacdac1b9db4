"""The decision trace (``report.decisions``) and its Chrome trace (``report.chrome``):
a traced run is the untraced one bit for bit; the JSON loads as a ``traceEvents`` trace
whose stage events are each request's breakdown exactly; the reasons are the limits'
arithmetic (a request blocked by memory: blocks needed vs free; by max_num_seqs; behind
a blocked head); admission control's refusals show; the CLI writes trace.json."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import REPO, make_profile, make_scenario, make_scenario_dict
from loopcheck import assert_identical, pressure_scenario
from simulator.loops.simulate import Unsupported, simulate
from simulator.report.chrome import STAGES, write_chrome_trace
from simulator.report.decisions import DecisionTrace
from simulator.report.metrics import requests_table
from simulator.workload.base import Workload

PROFILE = make_profile()     # prefill 1 ms per token, decode 1 ms per step


def _tiny(max_num_seqs=8, blocks=10):
    """Request 0 (100 tokens: 7 blocks of 16) runs 0..0.1 s prefill, then decodes 39
    steps to 0.139 s; request 1 (100 tokens) and 2 (10 tokens) arrive during its prefill."""
    sc = make_scenario(engine={"policy": "chunked", "max_num_seqs": max_num_seqs,
                               "max_num_batched_tokens": 256,
                               "kv": {"num_blocks": blocks, "block_size": 16,
                                      "watermark": 0.0}})
    wl = Workload(arrival_s=np.array([0.0, 0.05, 0.06]),
                  prompt_tokens=np.array([100, 100, 10]), output_tokens=np.array([40, 5, 5]),
                  priority=np.zeros(3, int))
    tr = DecisionTrace()
    return simulate(sc, 0, workload=wl, trace=tr, profile=PROFILE), tr


def test_a_request_blocked_by_memory_shows_blocks_needed_and_free():
    res, tr = _tiny()
    (r1,) = tr.records(1)
    # 10 blocks, request 0 holds ceil(100/16) = 7: request 1 needs 7, 3 are free.
    assert r1["reason"] == "memory" and r1["t"] == 0.1
    assert (r1["detail"]["needed_blocks"], r1["detail"]["free_blocks"]) == (7, 3)
    # Request 2 (1 block) would fit, but chunked admits in order: it waits behind 1.
    (r2,) = tr.records(2)
    assert r2["reason"] == "order" and r2["detail"]["behind"] == 1
    assert r2["detail"]["behind_reason"] == "memory"
    # Both are admitted when request 0's last token frees its blocks.
    assert res.rec.scheduled[1] == res.rec.scheduled[2] == res.rec.last_token[0]


def test_a_full_engine_shows_max_num_seqs():
    _, tr = _tiny(max_num_seqs=1, blocks=100)
    (r1,) = tr.records(1)
    assert r1["reason"] == "max_num_seqs"
    assert (r1["detail"]["running"], r1["detail"]["max_num_seqs"]) == (1, 1)


def test_the_chrome_trace_loads_and_its_stages_are_the_breakdown(tmp_path):
    sc = pressure_scenario(60, 4, "chunked", 2, "least_outstanding", 0.0, 40, 16, 128, 16,
                           400.0, "wan", 200)
    tr = DecisionTrace()
    res = simulate(sc, trace=tr)
    write_chrome_trace(res, tr, tmp_path / "trace.json")
    doc = json.loads((tmp_path / "trace.json").read_text())
    ev = doc["traceEvents"]
    df = requests_table(res)
    stages = {}
    for e in ev:
        assert {"ph", "pid", "tid"} <= set(e)
        if e.get("cat") == "stage":
            stages.setdefault(e["tid"], {})[e["name"]] = e
    assert set(stages) == set(range(len(df)))
    for rid, row in df.iterrows():
        got = stages[rid]
        # Each stage is its breakdown column exactly; together they are the E2E latency
        # (five float differences summed: to rounding, 1e-12 s at times of ~10 s).
        for (name, _, _), col in zip(STAGES, ("t_net", "t_queue", "t_prefill", "t_decode",
                                              "t_stream")):
            assert got[name]["args"]["seconds"] == row[col], (rid, name)
        assert abs(sum(g["args"]["seconds"] for g in got.values()) - row["e2el"]) < 1e-12
        # Back to back on the track (microseconds, to rounding).
        seq = [got[n] for n, _, _ in STAGES]
        for a, b in zip(seq, seq[1:]):
            assert abs(a["ts"] + a["dur"] - b["ts"]) < 1e-6
    # The replicas' step tracks add up to the run's steps and step time.
    steps = [e for e in ev if e.get("cat") == "step"]
    assert sum(e["args"]["steps"] for e in steps) == res.rec.steps
    assert abs(sum(e["args"]["seconds"] for e in steps) - res.rec.step_time_total) < 1e-9
    # Under this pressure some requests waited for memory, and said so.
    reasons = {e["name"] for e in ev if e.get("cat") == "wait"}
    assert "waits: memory" in reasons and "waits: order" in reasons


@pytest.mark.parametrize("policy", ["chunked", "fifo", "priority_aging", "sjf"])
def test_a_traced_run_is_the_untraced_run_bit_for_bit(policy):
    for ids in (None, [3, 17]):
        sc = pressure_scenario(70, 9, policy, 2, "round_robin", 0.05, 40, 16, 128, 16,
                               400.0, "wan", 200, preemption="swap", swap_gb=0.01)
        tr = DecisionTrace(ids)
        traced = simulate(sc, trace=tr)
        assert traced.meta["loop"] == "simpy (a decision trace)"
        assert_identical(simulate(sc, loop="simpy"), traced)
        assert tr.steps


def test_the_compiled_loop_refuses_a_trace():
    with pytest.raises(Unsupported, match="decision trace"):
        simulate(make_scenario(), loop="compiled", trace=DecisionTrace())


def test_admission_refusals_show_on_the_request(tmp_path):
    data = make_scenario_dict()
    data["workload"]["num_requests"] = 80
    data["workload"]["arrival"] = {"kind": "poisson", "rate": 50.0}
    data["engine"]["max_num_seqs"] = 2       # a queue forms: waits to record
    data["client"] = {"retry": {"max_retries": 2, "budget": None,
                                "backoff": {"initial_s": 0.2, "max_s": 1.0}}}
    data["cluster"] = {"admission": {"action": "reject", "classes": {"P0": {
        "rate": 20.0, "burst": 5, "max_queue": 4}}}}
    data["workload"]["classes"] = [{"name": "P0"}]
    from simulator.config.scenario import validate_scenario
    sc = validate_scenario(data)
    tr = DecisionTrace()
    res = simulate(sc, trace=tr)
    write_chrome_trace(res, tr, tmp_path / "t.json")
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    # The gateway's replicas fill the trace too (attempts: a first attempt is its
    # request's id), and the traced run is the untraced one.
    assert tr.steps
    assert_identical(simulate(sc, loop="simpy"), res)
    # Retries wait under their request's id (a retry's attempt id is n or more).
    assert all(0 <= r < res.rec.n for r in tr.waits)
    assert any(res.rec.attempts[r] > 1 for r in tr.waits)
    refused = {e["tid"] for e in ev if e.get("cat") == "admission"}
    assert refused and refused == set(np.flatnonzero(res.rec.reject_reason >= 0).tolist())
    assert all(e["name"].startswith("refused: ") for e in ev if e.get("cat") == "admission")


def _latsim(*args):
    """The command in process (its checks and files are the same as from a shell)."""
    from typer.testing import CliRunner

    from simulator.cli.main import app
    r = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    return r.exit_code, r.output


def test_latsim_run_writes_the_trace_and_refuses_bad_ids(tmp_path):
    r = _latsim("run", REPO / "scenarios/quickstart.yaml", "--out", tmp_path / "o", "--set",
                "workload.num_requests=60", "--chrome-trace", "--trace-requests", "3,7")
    assert r[0] == 0, r[1]
    ev = json.loads((tmp_path / "o" / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in ev if e.get("cat") == "stage"} == {3, 7}
    bad = _latsim("run", REPO / "scenarios/quickstart.yaml", "--out", tmp_path / "p", "--set",
                  "workload.num_requests=60", "--chrome-trace", "--trace-requests", "3,x")
    assert bad[0] == 2 and "--trace-requests" in bad[1]
    assert len(bad[1].strip().splitlines()) == 1 and not (tmp_path / "p").exists()
    big = _latsim("run", REPO / "scenarios/quickstart.yaml", "--out", tmp_path / "q", "--set",
                  "workload.num_requests=60", "--chrome-trace", "--trace-requests", "60")
    assert big[0] == 2 and "0..59" in big[1]
