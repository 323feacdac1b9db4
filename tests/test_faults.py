"""Replica faults and circuit breaking (``cluster.faults``, ``cluster.breaker``), checked
against closed forms and arithmetic: the availability of an alternating exponential
up/down process, the exact wait of requests caught by a scheduled outage of the only
replica, every request ending exactly once with failed attempts and retries adding up,
the breaker's state machine, routing around an open breaker, the compiled loop's reason,
and bad YAML."""
from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from conftest import make_scenario_dict
from simulator.cluster.breaker import CLOSED, HALF_OPEN, OPEN, Breaker
from simulator.cluster.faults import up_down_times
from simulator.config.faults import BreakerConfig
from simulator.config.scenario import validate_scenario
from simulator.loops.simulate import Unsupported, simulate
from simulator.report.metrics import requests_table
from simulator.report.output import run_summary as summary_of_run
from simulator.wire import clients as C


def _scenario(cluster: dict, n: int = 120, rate: float = 4.0, arrival="poisson",
              client=None, **wl):
    d = make_scenario_dict()
    if client is not None:
        d["client"] = client
    d["workload"].update({"num_requests": n, "arrival": {"kind": arrival, "rate": rate},
                          "prompt_tokens": {"kind": "constant", "value": 200},
                          "output_tokens": {"kind": "constant", "value": 20}, **wl})
    d["cluster"] = cluster
    return validate_scenario(d)


# -- availability: MTBF / (MTBF + MTTR) ---------------------------------------------------

def test_availability_of_exponential_up_and_down_times():
    """An alternating renewal process with Exp(a) up and Exp(b) down times is up a
    fraction a / (a + b) of a long run; the fraction's standard deviation over a horizon
    T is sqrt(2 a^2 b^2 / ((a + b)^3 T)) (the renewal-reward CLT with both times'
    variances a^2 and b^2). Held to 5 sigma, for three seeds."""
    a, b, horizon = 100.0, 10.0, 2e6
    sigma = math.sqrt(2 * a * a * b * b / ((a + b) ** 3 * horizon))
    for seed in (1, 2, 3):
        down = 0.0
        for f, r in up_down_times(np.random.default_rng(seed), a, b):
            if f >= horizon:
                break
            down += min(r, horizon) - f
        assert abs((1 - down / horizon) - a / (a + b)) < 5 * sigma, (seed, down / horizon)


def test_the_simulated_failure_process_has_that_availability():
    """The fault model's own SimPy process (``Faults`` with MTBF 100 s, MTTR 10 s on two
    replicas, no requests) over 2e5 s: each replica's down time from its timeline is
    within 5 sigma of MTTR / (MTBF + MTTR) (sigma as above)."""
    from types import SimpleNamespace

    import simpy

    from simulator.cluster.faults import Faults
    from simulator.config.faults import FaultsConfig
    a, b, horizon = 100.0, 10.0, 2e5
    env = simpy.Environment()
    fl = Faults(env, FaultsConfig(mtbf_s=a, mttr_s=b), None, 0, 2,
                np.random.default_rng(7), 16)
    fleet = SimpleNamespace(replicas=[None, None], built=[], make_replica=lambda s: None)
    fl.attach(SimpleNamespace(all_resolved=False, fleet=fleet, seqs={}))
    env.run(until=horizon)
    sigma = math.sqrt(2 * a * a * b * b / ((a + b) ** 3 * horizon))
    meta = fl.meta(horizon)
    for avail in meta["availability"]:
        assert abs(avail - a / (a + b)) < 5 * sigma, avail
    assert meta["failures"] > 2 * 0.9 * horizon / (a + b)


def test_mtbf_run_accounts_every_outage():
    """A run with MTBF/MTTR on two replicas: each replica's down time in the summary is
    the sum of its timeline's fail -> recover intervals, every failure recovers or is
    still on at the end, and every request completes (retries)."""
    sc = _scenario({"replicas": 2, "faults": {"mtbf_s": 20.0, "mttr_s": 4.0,
                                              "max_retries": 10}}, n=200, rate=2.0)
    res = simulate(sc, loop="simpy")
    meta = res.meta["faults"]
    tl = meta["timeline"]
    assert meta["failures"] == sum(e["event"] == "fail" for e in tl) >= 2
    for slot in (0, 1):
        ev = [e for e in tl if e["replica"] == slot and e["event"] in ("fail", "recover")]
        total = sum(ev[i + 1]["time_s"] - ev[i]["time_s"] for i in range(0, len(ev) - 1, 2))
        if len(ev) % 2:
            total += res.sim_end - ev[-1]["time_s"]
        assert meta["down_s"][slot] == pytest.approx(total, rel=1e-12, abs=1e-12)
        assert meta["availability"][slot] == pytest.approx(1 - total / res.sim_end)
    df = requests_table(res)
    assert (df["outcome"] == "completed").all()


# -- one replica, one outage: the wait is the time to recovery ------------------------------

def test_scheduled_outage_of_the_only_replica_waits_until_recovery():
    """One replica down from s = 10.2 s for D = 5 s, the gateway told at once (detect_s
    0), requests every 0.5 s: a request reaching the gateway during the outage, or in
    flight on the replica when it failed (retried), is routed exactly at s + D; its
    fault_lost_s is s + D minus its first arrival at the gateway (the zero network:
    its send time); every other request loses nothing. The mean over those sent during
    the outage is the arithmetic mean of (s + D - arrival)."""
    s, d = 10.2, 5.0
    sc = _scenario({"replicas": 1, "faults": {"outages": [{"replica": 0, "start_s": s,
                                                           "duration_s": d}]}},
                   n=60, rate=2.0, arrival="constant")
    res = simulate(sc, loop="simpy")
    df = requests_table(res)
    arr = df["arrival"].to_numpy()
    lost = df["fault_lost_s"].to_numpy()
    hit = lost > 0
    during = (arr >= s) & (arr < s + d)
    assert during.sum() == 10 and (hit & during).sum() == 10
    # Caught in flight: sent before s, still on the replica at s (a few ms of work).
    assert (arr[hit & ~during] > s - 1.0).all() and (arr[hit & ~during] < s).all()
    assert np.allclose(df["enqueued"].to_numpy()[hit], s + d, rtol=0, atol=1e-9)
    assert np.allclose(lost[hit], s + d - arr[hit], rtol=0, atol=1e-9)
    assert (lost[~hit] == 0).all()
    assert (df["outcome"] == "completed").all()
    phases = summary_of_run(res)["faults"]["phases"]
    assert phases["during"]["requests"] == 10
    assert phases["during"]["mean_fault_lost_s"] == pytest.approx(
        float(np.mean(s + d - arr[during])), abs=1e-9)
    assert res.meta["faults"]["down_s"] == [pytest.approx(d)]


# -- lost vs retried: every request ends exactly once ----------------------------------------

def _outage_run(in_flight: str, max_retries: int = 2, breaker=None):
    cl = {"replicas": 2, "faults": {"outages": [{"replica": 0, "start_s": 5.0,
                                                 "duration_s": 6.0}],
                                    "detect_s": 2.0, "in_flight": in_flight,
                                    "max_retries": max_retries}}
    if breaker is not None:
        cl["breaker"] = breaker
    sc = _scenario(cl, n=150, rate=10.0)
    sc.engine.max_num_seqs = 8     # a queue on each replica: in-flight requests to lose
    return simulate(sc, loop="simpy")


@pytest.mark.parametrize("mode", ["lost", "retry"])
def test_lost_and_retried_requests_add_up(mode):
    """Every request ends exactly once (completed or failed, nothing unfinished); each
    failed attempt is one held by the failing replica or routed to it before the health
    check: lost, each is a failed request; retried, each is a gateway retry (its own
    attempt row, outcome failed) and every request completes."""
    res = _outage_run(mode)
    meta = res.meta["faults"]
    df = requests_table(res)
    out = df["outcome"].to_numpy()
    assert set(out) <= {"completed", "failed"} and len(out) == 150
    n_failed_attempts = meta["in_flight_failed"] + meta["refused_while_down"]
    assert meta["in_flight_failed"] > 0 and meta["refused_while_down"] > 0
    att = res.meta["attempts"]
    assert int((att["outcome"] == C.FAILED).sum()) == n_failed_attempts
    assert len(att["rid"]) == 150 + int(df["fault_retries"].sum())
    if mode == "lost":
        assert (out == "failed").sum() == n_failed_attempts == meta["lost"]
        assert df["fault_retries"].sum() == 0
    else:
        assert (out == "completed").all()
        assert df["fault_retries"].sum() == meta["retried"] == n_failed_attempts
        assert meta["lost"] == 0
    s = summary_of_run(res)
    assert sum(s["overall"]["outcomes"].values()) == 150
    assert s["overall"]["outcomes"]["failed"] == (out == "failed").sum()


def test_retries_past_the_limit_fail():
    """max_retries 0 in retry mode: the first failure is final, as in lost mode."""
    a, b = _outage_run("retry", max_retries=0), _outage_run("lost")
    assert (requests_table(a)["outcome"] == requests_table(b)["outcome"]).all()


def test_breaker_keeps_requests_off_a_failed_replica():
    """Without a health check inside the outage (detect_s past it), a replica that
    failed is routed to until its breaker opens after 3 failures; then only its
    half-open probes reach it, one per 2 s cool-down: at most 3 + ceil(6 / 2) requests
    are refused there, where without a breaker about half of 6 s x 10 req/s are."""
    cl = {"replicas": 2, "faults": {"outages": [{"replica": 0, "start_s": 5.0,
                                                 "duration_s": 6.0}], "detect_s": 100.0}}
    with_b = simulate(_scenario({**cl, "breaker": {"failures": 3, "cooldown_s": 2.0}},
                                n=150, rate=10.0), loop="simpy").meta["faults"]
    without = simulate(_scenario(cl, n=150, rate=10.0), loop="simpy").meta["faults"]
    opened = [e for e in with_b["timeline"] if e["event"] == "breaker_open"]
    assert opened and opened[0]["time_s"] >= 5.0
    assert with_b["refused_while_down"] <= 3 + math.ceil(6.0 / 2.0)
    assert without["refused_while_down"] > 20
    assert with_b["timeline"][-1]["event"] == "breaker_closed"


# -- the breaker's state machine ------------------------------------------------------------

def test_breaker_opens_after_exactly_n_failures_and_half_opens_after_cooldown():
    b = Breaker(BreakerConfig(failures=3, cooldown_s=10.0, probes=2))
    b.failure(1.0)
    b.failure(2.0)
    b.success(2.5, 0.1)          # a success resets the count
    b.failure(3.0)
    b.failure(4.0)
    assert b.state == CLOSED and b.allows(4.0)
    b.failure(5.0)               # the third in a row
    assert b.state == OPEN and not b.allows(5.0) and b.opens == 1
    assert not b.allows(14.999999)
    assert b.allows(15.0) and b.state == HALF_OPEN
    assert b.routed(15.0) and b.routed(15.0)
    assert not b.allows(15.0)    # both probes out
    b.success(16.0, 0.1)
    assert b.state == HALF_OPEN
    b.success(16.5, 0.1)
    assert b.state == CLOSED and b.fails == 0
    # A failed probe opens it again, for a fresh cool-down.
    for t in (20.0, 21.0, 22.0):
        b.failure(t)
    assert b.poll(32.0) == HALF_OPEN
    b.routed(32.0)
    b.failure(33.0)
    assert b.state == OPEN and b.reopen_at == 43.0 and b.opens == 3
    assert [s for _, s in b.log] == [OPEN, HALF_OPEN, CLOSED, OPEN, HALF_OPEN, OPEN]


def test_breaker_opens_on_a_rolling_p99():
    """P99 of the window's TTFTs above the bound opens it, once min_samples are in."""
    b = Breaker(BreakerConfig(failures=100, p99_ms=500.0, window_s=10.0, min_samples=10))
    for i in range(9):
        b.success(float(i), 0.9)       # slow, but too few samples
    assert b.state == CLOSED
    b.success(9.0, 0.9)
    assert b.state == OPEN
    # 49 x 0.1 s then one 0.9 s: P99 (linear between order statistics, as numpy) is
    # 0.1 + 0.51 x 0.8 = 0.508 s: over a 500 ms bound, under a 510 ms one.
    for bound, state in ((500.0, OPEN), (510.0, CLOSED)):
        b2 = Breaker(BreakerConfig(failures=100, p99_ms=bound, window_s=10.0, min_samples=10))
        for i in range(50):
            b2.success(i * 0.1, 0.9 if i == 49 else 0.1)
        assert b2.state == state, bound
    b3 = Breaker(BreakerConfig(failures=100, p99_ms=500.0, window_s=1.0, min_samples=5))
    for i in range(20):                # slow ones leave the 1 s window before 5 gather
        b3.success(float(i), 0.9)
    assert b3.state == CLOSED


# -- loops, bad input --------------------------------------------------------------------------

def test_compiled_loop_declines_with_a_reason():
    sc = _scenario({"replicas": 1, "faults": {"outages": [{"replica": 0, "start_s": 1.0,
                                                           "duration_s": 1.0}]}}, n=20)
    with pytest.raises(Unsupported, match="replica faults and circuit breaking"):
        simulate(sc, loop="compiled")
    assert "replica faults" in simulate(sc).meta["loop"]


@pytest.mark.parametrize("faults,field", [
    ({"mtbf_s": -5, "mttr_s": 10}, "cluster.faults.mtbf_s"),
    ({"mtbf_s": 100}, "cluster.faults"),
    ({"outages": [{"replica": 3, "start_s": 1, "duration_s": 2}]}, "cluster.faults.outages"),
    ({"outages": [{"replica": 0, "start_s": 1, "duration_s": 0}]}, "duration_s"),
    # A replica down for 1e300 s held its requests (and the clock) that long: the time
    # series then could not be allocated (an internal error, exit 70). Bounded at 1e7 s.
    ({"outages": [{"replica": 0, "start_s": 1, "duration_s": 1e300}]}, "duration_s"),
    ({"outages": [{"replica": 0, "start_s": float("nan"), "duration_s": 1}]}, "start_s"),
    # MTBF 1e-9 s: a billion failures per simulated second (the run never ended).
    ({"mtbf_s": 1e-9, "mttr_s": 1e-9}, "cluster.faults.mtbf_s"),
    ({"mtbf_s": 10, "mttr_s": "x"}, "cluster.faults.mttr_s"),
    ({"mtbf_s": 10, "mttr_s": 1, "in_flight": "maybe"}, "cluster.faults.in_flight"),
    ({"outages": []}, "cluster.faults"),
])
def test_bad_faults_yaml_is_one_line_exit_2(tmp_path, faults, field):
    from test_fuzz import run_cli
    d = make_scenario_dict()
    d["cluster"] = {"replicas": 2, "faults": faults}
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(d))
    code, _, err = run_cli(["run", p])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert str(p) in lines[0] or p.name in lines[0]
    assert field in lines[0], lines[0]


# -- degradation under overload ----------------------------------------------------------------

class _Rep:
    def __init__(self, q):
        self.q = q

    def n_queued(self):
        return self.q


def test_degrade_rule_routes_to_the_small_pool_and_caps_the_output():
    """Overloaded means the main replicas' mean waiting count reaches the bound: then the
    request goes to the degrade pool and its output (and KV reservation) is cut; below
    it, it never goes to the pool."""
    from types import SimpleNamespace

    from simulator.cluster.degrade import Degrade
    from simulator.config.faults import DegradeConfig
    from simulator.loops.simpy.replica import SimSeq
    from simulator.model.kv.blocks import request_blocks
    wl = SimpleNamespace(output_tokens=np.array([300, 300]))
    dg = Degrade(DegradeConfig(queue_per_replica=3, max_output_tokens=50, pool="small"),
                 wl, [2], lambda aid: aid, 16)
    reps = [_Rep(2), _Rep(3), _Rep(100)]        # mean over the main two: 2.5 < 3
    seq = SimSeq(0, 0.0, 1000, 300, 0, request_blocks(1000, 300, 16), 0, False)
    assert dg.route([0, 1, 2], seq, reps) == [0, 1] and seq.output_tokens == 300
    reps[0].q = 3                               # mean 3: overloaded
    seq1 = SimSeq(1, 0.0, 1000, 300, 0, request_blocks(1000, 300, 16), 0, False)
    assert dg.route([0, 1, 2], seq1, reps) == [2]
    assert seq1.output_tokens == 50 and seq1.blocks_needed == request_blocks(1000, 50, 16)
    assert list(dg.columns()["degraded"]) == [False, True]
    assert list(dg.columns()["output_tokens"]) == [300, 50]
    # The pool down (not routable): the cap alone, on the main replicas.
    seq2 = SimSeq(0, 0.0, 1000, 300, 0, request_blocks(1000, 300, 16), 0, False)
    assert dg.route([0, 1], seq2, reps) == [0, 1] and seq2.output_tokens == 50


def _degrade_scenario(degrade):
    d = make_scenario_dict()
    d["workload"].update({"num_requests": 200, "arrival": {"kind": "poisson", "rate": 40.0},
                          "prompt_tokens": {"kind": "constant", "value": 400},
                          "output_tokens": {"kind": "constant", "value": 120}})
    d["cluster"] = {"pools": [{"name": "big", "replicas": 1}, {"name": "small", "replicas": 1}]}
    if degrade is not None:
        d["cluster"]["degrade"] = degrade
    d["engine"]["max_num_seqs"] = 8
    return validate_scenario(d)


def test_degraded_requests_are_served_by_the_small_pool_with_the_cap():
    """Under a burst the degraded requests (and only they) run on the small pool's replica
    and generate exactly the cap; the table's output_tokens and the summary's output
    total count what was served."""
    res = simulate(_degrade_scenario({"queue_per_replica": 2, "max_output_tokens": 16,
                                      "pool": "small"}), loop="simpy")
    df = requests_table(res)
    deg = df["degraded"].to_numpy(bool)
    assert 0 < deg.sum() < len(df) and (df["outcome"] == "completed").all()
    assert ((df["replica"] == 1).to_numpy() == deg).all()
    assert (df["output_tokens"][deg] == 16).all() and (df["output_tokens"][~deg] == 120).all()
    assert (res.rec.generated == df["output_tokens"].to_numpy()).all()
    s = summary_of_run(res)
    assert s["overall"]["total_output_tokens"] == 16 * deg.sum() + 120 * (~deg).sum()
    assert s["degrade"]["degraded_requests"] == deg.sum()


def test_degrade_never_triggered_is_the_plain_run():
    """A bound no queue reaches: the run is the one without degrade, bit for bit (the
    degrade pool then serves nothing, as a pool it is kept out of routing)."""
    a = simulate(_degrade_scenario({"queue_per_replica": 1e9, "max_output_tokens": 16}),
                 loop="simpy")
    b = simulate(_degrade_scenario(None), loop="simpy")
    assert not requests_table(a)["degraded"].any()
    for col in ("first_delivered", "last_delivered", "replica"):
        assert np.array_equal(getattr(a.rec, col), getattr(b.rec, col), equal_nan=True), col


def test_a_failed_replica_comes_back_with_an_empty_prefix_cache():
    """Prefix caching on, every prompt opening with the same 512-token system prompt: before
    the outage a request finds it cached; the requests routed at the recovery find a fresh
    replica (its KV, prefix cache included, dropped), so the first of them computes it
    again (cached_tokens 0), and the ones after it hit again."""
    d = make_scenario_dict()
    d["workload"].update({"num_requests": 40, "arrival": {"kind": "constant", "rate": 2.0},
                          "prompt_tokens": {"kind": "constant", "value": 100},
                          "output_tokens": {"kind": "constant", "value": 10},
                          "classes": [{"name": "all", "share": 1.0,
                                       "system_prompt_tokens": 512}]})
    d["engine"]["kv"]["prefix_caching"] = True
    d["cluster"] = {"replicas": 1, "faults": {"outages": [{"replica": 0, "start_s": 10.2,
                                                           "duration_s": 5.0}]}}
    df = requests_table(simulate(validate_scenario(d), loop="simpy"))
    cached = df["cached_tokens"].to_numpy()
    routed_at_recovery = np.isclose(df["enqueued"].to_numpy(), 15.2, rtol=0, atol=1e-9)
    before = df["arrival"].to_numpy() < 10.0
    assert (cached[before][1:] >= 512).all()          # after the first, the prefix hits
    first = np.flatnonzero(routed_at_recovery)[0]
    assert cached[first] == 0
    later = df["arrival"].to_numpy() > 16.0
    assert (cached[later] >= 512).all()


def test_gateway_breakers_half_open_on_a_timer_and_fail_an_abandoned_probe():
    """``Breakers`` in simulated time: the cool-down's timer half-opens the breaker (the
    held requests are released), the one probe goes out, its client gives up (it will
    never succeed nor fail): the next check, a cool-down later, counts it as a failure
    and the breaker opens again."""
    import simpy

    from simulator.cluster.breaker import Breakers
    env = simpy.Environment()
    log, released, gone = [], [], set()
    br = Breakers(env, BreakerConfig(failures=2, cooldown_s=5.0, probes=1), 1,
                  lambda s, e: log.append((env.now, e)), lambda: released.append(env.now),
                  lambda aid: aid in gone)
    env.run(until=1.0)
    br.failure(0, 1.0)
    br.failure(0, 1.0)
    assert not br.allows(0, 1.0)
    env.run(until=6.5)
    assert log == [(1.0, "breaker_open"), (6.0, "breaker_half_open")] and released == [6.0]
    br.routed(0, 7, 6.5)
    assert not br.allows(0, 6.5)          # its one probe is out
    gone.add(7)                           # its client left
    env.run(until=12.0)
    assert log[-1] == (11.0, "breaker_open") and br.opens == [2]
    env.run(until=16.5)
    br.routed(0, 8, 16.5)
    env.run(until=17.0)
    br.success(0, 8, 17.0, 0.05)
    assert log[-1] == (17.0, "breaker_closed") and br.allows(0, 17.0)


def test_faults_that_never_strike_give_the_plain_run_bit_for_bit():
    """An outage after the last request and a breaker that never opens: the run is the
    plain one (no gateway sections), every recorded time bit for bit."""
    plain = _scenario({"replicas": 2}, n=150, rate=10.0)
    idle = _scenario({"replicas": 2, "faults": {"outages": [{"replica": 1, "start_s": 1e6,
                                                             "duration_s": 1.0}]},
                      "breaker": {"failures": 1000, "p99_ms": 1e9}}, n=150, rate=10.0)
    a, b = simulate(plain, loop="simpy"), simulate(idle, loop="simpy")
    for col in ("enqueued", "scheduled", "first_token", "last_token", "first_delivered",
                "last_delivered", "replica"):
        assert np.array_equal(getattr(a.rec, col), getattr(b.rec, col), equal_nan=True), col
    assert b.meta["faults"]["failures"] == 0


def test_client_read_timeouts_through_an_outage():
    """One replica down 10.2-15.2 s, requests every 0.5 s, clients with a 3 s read timeout
    and no retries: a request sent during the outage is held until 15.2 s, so those sent
    before 12.2 s give up (timed_out, after losing exactly their 3 s to the outage) and
    those from 12.5 s on get their first byte in time; a request whose first byte had
    come before the failure (in flight, retried by the gateway) is not timed out by its
    restarted stream."""
    s, d = 10.2, 5.0
    sc = _scenario({"replicas": 1, "faults": {"outages": [{"replica": 0, "start_s": s,
                                                           "duration_s": d}]}},
                   n=40, rate=2.0, arrival="constant",
                   client={"read_timeout_s": 3.0, "retry": None},
                   output_tokens={"kind": "constant", "value": 300})
    df = requests_table(simulate(sc, loop="simpy"))
    arr, out = df["arrival"].to_numpy(), df["outcome"].to_numpy()
    during = (arr >= s) & (arr < s + d)
    gave_up = during & (arr < s + d - 3.0)
    assert gave_up.sum() == 4 and (out[gave_up] == "timed_out").all()
    assert np.allclose(df["fault_lost_s"].to_numpy()[gave_up], 3.0, rtol=0, atol=1e-9)
    assert (out[during & (arr >= s + d - 3.0)] == "completed").all()
    victims = (df["fault_retries"] > 0).to_numpy()
    assert victims.any() and (out[victims] == "completed").all()
    assert (out[~during] == "completed").all()


def test_a_sweep_row_carries_the_fault_figures():
    """``planning.executors.flatten`` of a faults run: the tallies and each phase's
    figures as ``faults.*`` cells, equal to the summary's."""
    from simulator.planning.executors import flatten
    res = _outage_run("lost")
    s = summary_of_run(res)
    row = flatten(s, 10.0)
    f = s["faults"]
    assert row["faults.lost"] == f["lost"] > 0
    assert row["faults.refused_while_down"] == f["refused_while_down"]
    for ph in ("before", "during", "after"):
        assert row[f"faults.{ph}.requests"] == f["phases"][ph]["requests"]
        assert row[f"faults.{ph}.slo_attainment"] == f["phases"][ph]["slo_attainment"]
    assert sum(row[f"faults.{ph}.failed"] for ph in ("before", "during", "after")) == f["lost"]


def test_a_client_moving_elsewhere_meets_the_fault_checks_of_where_it_went():
    """Replica 1 fails at 1 s for 5 s and the health check never notices within it;
    clients go elsewhere when told a wait past 0.2 s (``on_long_wait: elsewhere``), and
    those retried off replica 1 pile up on replica 0 (a seeded random router: first
    attempts go to either). The empty, failed replica 1
    publishes a zero wait, so clients told a long wait on replica 0 move there: each
    must fail there (refused while down) and be retried, never be queued on the stopped
    replica (where it would wait forever, unfinished: the clock is capped at 200 s so
    that the run ends either way). Every request ends (completed, or balked: a retry
    avoids replica 1, so told a long wait it has nowhere to go); none was admitted to
    replica 1 during its outage."""
    s, d = 1.0, 5.0
    sc = _scenario({"replicas": 2, "router": "random",
                    "faults": {"outages": [{"replica": 1, "start_s": s, "duration_s": d}],
                               "detect_s": 1000.0, "max_retries": 50}},
                   n=200, rate=30.0, client={"wait_patience_s": 0.2,
                                             "on_long_wait": "elsewhere",
                                             "read_timeout_s": None})
    sc.max_sim_time_s = 200.0
    sc.engine.max_num_seqs = 2      # a queue on replica 0: estimates past the patience
    res = simulate(sc, loop="simpy")
    df = requests_table(res)
    out = df["outcome"].to_numpy()
    assert set(out) <= {"completed", "timed_out"}, df["outcome"].value_counts()
    assert (out == "timed_out").sum() == res.meta["traffic"]["balked"]
    on1 = (df["replica"] == 1).to_numpy()
    enq = df["enqueued"].to_numpy()
    assert not (on1 & (enq >= s) & (enq < s + d)).any()
    assert res.meta["traffic"]["moved_elsewhere"] > 10
    assert res.meta["faults"]["refused_while_down"] > 10


def test_degraded_answers_are_reported_apart_from_the_slo_attainment():
    """A degraded (capped, small-model) answer is cheaper and faster, so it may meet the
    latency SLO: ``overall.slo_attainment`` counts it (the latency SLO, as vLLM's
    goodput), and ``degrade`` says how many of the good ones were degraded and the
    attainment of the undegraded: good_degraded + (good and not degraded) = good, and
    slo_attainment_undegraded = (good - good_degraded) / requests, from the table."""
    from simulator.report.metrics import good_mask
    d = _degrade_scenario({"queue_per_replica": 2, "max_output_tokens": 16,
                           "pool": "small"}).model_dump(mode="json", exclude_none=True)
    d["workload"]["classes"] = [{"name": "all", "share": 1.0, "slo": {"ttft_ms": 400}}]
    sc = validate_scenario(d)
    res = simulate(sc, loop="simpy")
    df = requests_table(res)
    s = summary_of_run(res)
    good = good_mask(df, sc)
    deg = df["degraded"].to_numpy(bool)
    n = len(df)
    dg = s["degrade"]
    assert 0 < dg["good_degraded"] == int((good & deg).sum()) < s["overall"]["good_requests"]
    assert dg["slo_attainment_undegraded"] == pytest.approx(
        (s["overall"]["good_requests"] - dg["good_degraded"]) / n, abs=1e-12)
    assert dg["slo_attainment_undegraded"] < s["overall"]["slo_attainment"]


def test_the_small_pool_serving_while_every_main_replica_is_down_is_degraded():
    """The main pool's one replica down 2-6 s (the gateway told at once), a bound no
    queue reaches: the small pool serves only while it is down (the main pool has no
    routable replica: overloaded), and each request it serves is degraded, with the cap;
    after the recovery nothing is."""
    d = _degrade_scenario({"queue_per_replica": 1e9, "max_output_tokens": 16,
                           "pool": "small"}).model_dump(mode="json", exclude_none=True)
    d["cluster"]["faults"] = {"outages": [{"replica": 0, "start_s": 2.0, "duration_s": 4.0}]}
    d["workload"]["arrival"]["rate"] = 20.0
    df = requests_table(simulate(validate_scenario(d), loop="simpy"))
    small = (df["replica"] == 1).to_numpy()
    deg = df["degraded"].to_numpy(bool)
    enq = df["enqueued"].to_numpy()
    assert small.any() and (deg == small).all()
    assert ((enq[small] >= 2.0) & (enq[small] < 6.0)).all()
    assert (df["output_tokens"][small] == 16).all()
    assert (df["outcome"] == "completed").all()


def test_time_lost_to_exponential_outages_is_the_residual_repair_time():
    """One replica failing with MTBF 20 s, MTTR 5 s (exponential), the gateway told at
    once, Poisson requests: a request arriving while the replica is down is held until
    its recovery, so it loses exactly (recovery - arrival) when it is not caught by a
    later failure (no fault retry); the outages' mean length is MTTR within 5 standard
    errors (MTTR / sqrt(outages), exponential); and the mean loss of the requests that
    arrive during an outage is MTTR too (memoryless repair: the residual of an
    exponential is the same exponential), within 5 standard errors of the outages'
    own mean (requests in one outage share its residual, so the outages, not the
    requests, are the independent samples). Every completed request's breakdown adds up
    to its E2E, the time lost inside its T_net."""
    mtbf, mttr = 20.0, 5.0
    sc = _scenario({"replicas": 1, "faults": {"mtbf_s": mtbf, "mttr_s": mttr,
                                              "max_retries": 100}}, n=2000, rate=0.5)
    res = simulate(sc, loop="simpy")
    df = requests_table(res)
    iv = [(e["time_s"], e["event"]) for e in res.meta["faults"]["timeline"]
          if e["event"] in ("fail", "recover")]
    downs = [(iv[i][0], iv[i + 1][0]) for i in range(0, len(iv) - 1, 2)]
    assert all(a == "fail" for _, a in iv[0::2]) and len(downs) > 100
    arr, lost = df["arrival"].to_numpy(), df["fault_lost_s"].to_numpy()
    clean = (df["fault_retries"] == 0).to_numpy()
    inside, per_outage = np.zeros(len(df), bool), []
    for a, b in downs:
        m = (arr >= a) & (arr < b)
        inside |= m
        assert np.allclose(lost[m & clean], b - arr[m & clean], rtol=0, atol=1e-9)
        assert (lost[m] >= b - arr[m] - 1e-9).all()
    lengths = np.array([b - a for a, b in downs])
    assert abs(lengths.mean() - mttr) < 5 * mttr / math.sqrt(len(lengths))
    assert abs(lost[inside].mean() - mttr) < 5 * mttr / math.sqrt(len(lengths))
    done = (df["outcome"] == "completed").to_numpy()
    parts = df[["t_net", "t_queue", "t_prefill", "t_decode", "t_stream"]].sum(axis=1)
    assert done.all()
    assert np.allclose(parts[done], df["e2el"][done], rtol=0, atol=1e-9)
    assert (df["t_net"].to_numpy()[done] >= lost[done] - 1e-9).all()


def test_a_fault_run_is_the_same_for_its_seed_and_its_retries_add_up():
    """The outage with retries, a breaker and MTBF failures on top, run twice with one
    seed: every recorded time equal bit for bit, the same timeline; another seed gives
    other failures. Each completed request's breakdown (retried ones included: the
    time lost on a failed attempt is in its T_net) adds up to its E2E."""
    cl = {"replicas": 2, "faults": {"mtbf_s": 15.0, "mttr_s": 3.0, "detect_s": 1.0,
                                    "refuse_s": 0.5, "max_retries": 5},
          "breaker": {"failures": 2, "cooldown_s": 2.0}}
    def run(seed=1):
        sc = _scenario(cl, n=150, rate=10.0)
        sc.seed = seed
        sc.engine.max_num_seqs = 8     # queues to be caught by the failures
        return simulate(sc, loop="simpy")
    a, b = run(), run()
    for col in ("enqueued", "scheduled", "first_token", "last_token", "last_delivered"):
        assert np.array_equal(getattr(a.rec, col), getattr(b.rec, col), equal_nan=True), col
    assert a.meta["faults"]["timeline"] == b.meta["faults"]["timeline"]
    assert run(2).meta["faults"]["timeline"] != a.meta["faults"]["timeline"]
    df = requests_table(a)
    done = (df["outcome"] == "completed").to_numpy()
    retried = (df["fault_retries"] > 0).to_numpy()
    assert (done & retried).sum() > 0
    parts = df[["t_net", "t_queue", "t_prefill", "t_decode", "t_stream"]].sum(axis=1)
    assert np.allclose(parts[done], df["e2el"][done], rtol=0, atol=1e-9)
    assert (df["t_net"].to_numpy()[done] >= df["fault_lost_s"].to_numpy()[done] - 1e-9).all()
