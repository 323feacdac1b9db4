"""End-to-end properties of a simulation: conservation, the additive breakdown,
KV accounting, determinism, and what each policy is for."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from conftest import make_profile, make_scenario, make_workload
from simulator.report.metrics import requests_table, summarize
from simulator.loops.simulate import simulate


def _run(policy="chunked", n=300, rate=6.0, seed=3, **kw):
    sc = make_scenario(**kw)
    return simulate(sc, seed, policy=policy)


@pytest.mark.parametrize("policy", ["fifo", "chunked", "priority_aging"])
def test_conservation_and_breakdown(policy):
    res = _run(policy, network={"distance_km": 800, "tls": "1.2", "clients": 5, "pool_size": 2},
               stream={"downlink_mbps": 1.0})
    df = requests_table(res)
    # Every arrived request completed (no horizon set), with exactly its tokens.
    assert df["finished"].all()
    assert (res.rec.generated == res.workload.output_tokens).all()
    # The stages add up to the end-to-end latency.
    total = df[["t_net", "t_queue", "t_prefill", "t_decode", "t_stream"]].sum(axis=1)
    np.testing.assert_allclose(total, df["e2el"], rtol=0, atol=1e-9)
    assert (df[["t_net", "t_queue", "t_prefill", "t_decode", "t_stream"]] >= -1e-12).all().all()
    # TTFT and TPOT from the same timestamps.
    np.testing.assert_allclose(df["ttft"], df["first_delivered"] - df["arrival"])
    # KV: reserved blocks never exceed capacity and all return at the end.
    for i, (ts, wq, run, blk, kv, _shared) in enumerate(res.rec.series):
        assert max(blk) <= res.kv_capacity_blocks
        assert blk[-1] == 0 and kv[-1] == 0 and run[-1] == 0 and wq[-1] == 0


def test_kv_blocks_return_and_capacity_limits_admission():
    # 40 blocks of 16 tokens; each request needs ceil((100+28)/16) = 8 blocks -> 5 at once.
    sc = make_scenario(engine={"policy": "chunked", "max_num_seqs": 64,
                               "max_num_batched_tokens": 512, "kv": {"num_blocks": 40}})
    wl = make_workload(60, rate=50.0, prompt=100, output=28)
    res = simulate(sc, 0, workload=wl)
    run = np.array(res.rec.series[0][2])
    blk = np.array(res.rec.series[0][3])
    assert blk.max() <= 40 and run.max() == 5
    assert blk[-1] == 0 and res.rec.series[0][4][-1] == 0
    assert np.isfinite(res.rec.last_delivered).all()


def test_request_larger_than_cache_is_rejected_not_lost():
    sc = make_scenario(engine={"policy": "fifo", "kv": {"num_blocks": 10}})
    wl = make_workload(5, prompt=np.array([50, 500, 50, 50, 50]), output=10)
    df = requests_table(simulate(sc, 0, workload=wl))
    assert df["rejected"].tolist() == [False, True, False, False, False]
    s = summarize(df, None)
    assert s["completed"] == 4 and s["not_finished"] == 1 and s["rejected"] == 1


def test_horizon_reports_unfinished():
    sc = make_scenario(max_sim_time_s=5.0)
    res = simulate(sc, 0, policy="chunked")
    df = requests_table(res)
    s = summarize(df, res.rec.itl)
    assert s["not_finished"] > 0 and s["completed"] + s["not_finished"] == len(df)


def test_same_seed_same_table_different_seed_differs():
    a = requests_table(_run(seed=9))
    b = requests_table(_run(seed=9))
    c = requests_table(_run(seed=10))
    pd.testing.assert_frame_equal(a, b)
    assert not a["arrival"].equals(c["arrival"])


def _long_prompt_workload():
    """Short chats plus a 3800-token prompt in 30% of requests: head-of-line bait."""
    rng = np.random.default_rng(4)
    n = 400
    prompt = np.where(rng.random(n) < 0.3, 3800, 200)
    return make_workload(n, rate=5.0, prompt=prompt, output=64, seed=4)


def test_chunked_prefill_cuts_p99_itl_against_fifo():
    eng = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "chunk_size": 512,
           "kv": {"num_blocks": 16384}}
    out = {}
    for p in ("fifo", "chunked"):
        sc = make_scenario(engine={**eng, "policy": p})
        res = simulate(sc, 0, workload=_long_prompt_workload())
        out[p] = summarize(requests_table(res), res.rec.itl)
    # FIFO pauses every decode for a ~120 ms whole-prompt step; chunked spreads it.
    assert out["chunked"]["p99_itl_ms"] < 0.6 * out["fifo"]["p99_itl_ms"]


def _priority_overload():
    """One slot, 1 s service; P0 at 0.8/s and P2 at 0.3/s: over capacity for a while."""
    rng = np.random.default_rng(8)
    n = 300
    prio = np.where(rng.random(n) < 0.27, 2, 0)
    return make_workload(n, rate=1.1, prompt=1000, output=1, priority=prio, seed=8,
                         class_names=("P0", "P1", "P2"))


def _one_slot(policy, aging_s=5.0):
    return make_scenario(engine={"policy": policy, "max_num_seqs": 1,
                                 "max_num_batched_tokens": 4096, "aging_s": aging_s,
                                 "kv": {"num_blocks": 10**6}})


def test_priority_aging_serves_p0_first_and_never_starves():
    prof = make_profile(prefill=((1, 0, 1.0), (10**6, 0, 10**6)))
    wl = _priority_overload()
    res_f = simulate(_one_slot("fifo"), 0, workload=wl, profile=prof)
    res_p = simulate(_one_slot("priority_aging", aging_s=5.0), 0, workload=wl, profile=prof)
    df_f, df_p = requests_table(res_f), requests_table(res_p)
    p0 = wl.priority == 0
    assert np.percentile(df_p["ttft"][p0], 99) < np.percentile(df_f["ttft"][p0], 99)
    # Aging rule: a P2 request that reached the queue 2 x aging_s before a P0 request is
    # scheduled no later than it. That bounds every P2 wait; strict priority would not.
    enq, sch = df_p["enqueued"].to_numpy(), df_p["scheduled"].to_numpy()
    p2 = np.flatnonzero(wl.priority == 2)
    p0i = np.flatnonzero(p0)
    for a in p2:
        later = p0i[enq[p0i] >= enq[a] + 2 * 5.0]
        assert (sch[a] <= sch[later] + 1e-9).all()
    # With aging effectively off (strict priority), P2 waits far longer at the tail.
    res_s = simulate(_one_slot("priority_aging", aging_s=1e9), 0, workload=wl, profile=prof)
    wait_s = requests_table(res_s)["t_queue"].to_numpy()[p2].max()
    assert df_p["t_queue"].to_numpy()[p2].max() < wait_s


def test_fifo_prefill_step_pauses_decodes():
    """FIFO never mixes a prefill chunk with decodes; chunked does."""
    from simulator.model.scheduling import SchedulerState, Seq, make_policy
    running = [Seq(i, 0.0, 10, 5) for i in range(3)]
    for s in running:
        s.prefilled, s.generated = 10, 1
    for name, mixes in (("fifo", False), ("chunked", True)):
        pol = make_policy(name, max_num_batched_tokens=64, chunk_size=64)
        q = pol.new_queue()
        q.push(Seq(9, 0.0, 40, 5, blocks_needed=1))
        plan = pol.schedule(SchedulerState(1.0, q, running, [], 100))
        assert plan.admit == (9,)
        assert bool(plan.decode) == mixes


@pytest.mark.parametrize("policy", ["fifo", "chunked", "priority_aging"])
def test_epochs_and_step_by_step_agree(policy):
    """Fast-forwarded decode epochs, step-by-step, and per-request bookkeeping are
    three computations of the same model: identical timestamps and ITL."""
    sc = make_scenario(cluster={"replicas": 2, "router": "least_outstanding"},
                       engine={"policy": policy, "max_num_seqs": 16, "max_num_batched_tokens": 256,
                               "aging_s": 1.0, "kv": {"num_blocks": 600}},
                       workload={"kind": "synthetic", "num_requests": 400,
                                 "arrival": {"kind": "gamma", "rate": 8.0, "burstiness": 0.5},
                                 "prompt_tokens": {"kind": "lognormal", "mean": 300, "cv": 1.0,
                                                   "max": 2000},
                                 "output_tokens": {"kind": "lognormal", "mean": 60, "cv": 1.0,
                                                   "max": 400},
                                 "classes": [{"name": "P0", "share": 0.3},
                                             {"name": "P1", "share": 0.7}]})
    runs = {m: simulate(sc, 5, mode=m) for m in ("auto", "step", "slow")}
    tables = {m: requests_table(r) for m, r in runs.items()}
    cols = ["enqueued", "scheduled", "first_token", "last_token", "first_delivered",
            "last_delivered"]
    for m in ("step", "slow"):
        np.testing.assert_allclose(tables[m][cols], tables["auto"][cols], rtol=0, atol=1e-9)
        assert runs[m].rec.itl.n == runs["auto"].rec.itl.n
        for q in (0.5, 0.9, 0.99):
            assert runs[m].rec.itl.quantile(q) == pytest.approx(runs["auto"].rec.itl.quantile(q),
                                                                rel=2e-3)
    assert runs["auto"].rec.steps == runs["slow"].rec.steps


def test_epoch_rules():
    """``model.scheduling.epoch``: an interrupted epoch runs the step in progress to its
    end; the router sees the steps ended; an arrival ends an epoch only if the next step
    would admit it (or under aging); epochs stop at the next finish and the cap."""
    from simulator.model.scheduling import epoch as E
    ends = np.empty(3)
    E.step_ends(1.0, np.array([0.5, 0.25, 0.25]), 3, ends)
    assert list(ends) == [1.5, 1.75, 2.0]
    assert [E.steps_run(ends, 3, t) for t in (1.2, 1.5, 1.6, 1.99, 5.0)] == [1, 1, 2, 3, 3]
    assert [E.steps_ended(ends, 3, t) for t in (1.2, 1.5, 1.6, 2.0)] == [0, 1, 1, 3]
    # (aging, queue was empty, running, max seqs); then its blocks against the free ones
    assert E.arrival_interrupts(False, True, 3, 4) == E.IF_FITS
    assert E.fits_now(5, 5) and not E.fits_now(6, 5)            # no blocks: no interrupt
    assert E.arrival_interrupts(False, False, 3, 4) == E.NO     # others wait before it
    assert E.arrival_interrupts(False, True, 4, 4) == E.NO      # no sequence slot
    assert E.arrival_interrupts(True, False, 4, 4) == E.YES     # aging: any arrival
    # (decodes, chunks, held back, copy seconds, aging, waiting)
    assert E.may_start(2, 0, False, 0.0, True, 0)
    assert not any([E.may_start(0, 0, False, 0.0, False, 0), E.may_start(2, 1, False, 0.0, False, 0),
                    E.may_start(2, 0, True, 0.0, False, 0), E.may_start(2, 0, False, 0.1, False, 0),
                    E.may_start(2, 0, False, 0.0, True, 1)])
    assert E.epoch_length(110, 100, True, 4, 16, 100) == 10
    assert E.epoch_length(10 ** 6, 0, False, 4, 16, 0) == E.MAX_EPOCH_STEPS
    assert E.epoch_length(10 ** 6, 0, True, 4, 16, 8) == 32     # 2 blocks each: 32 steps


def test_progress_rules_and_the_tick_keys_agree():
    """``model.scheduling.progress``: a chunk completing the prefill (and only it) says so;
    the last token says so; a decoder kept on the replica's tick has, ``j`` ticks after
    joining, the context and tokens a per-request count gives, and finishes at its
    output count."""
    from simulator.model.scheduling import progress as P
    from simulator.model.scheduling.plan import Seq
    assert P.prefill_progress(100, 28, 130) == (128, False)
    assert P.prefill_progress(128, 2, 130) == (130, True)
    assert P.emit_tokens(8, 1, 10) == (9, False) and P.emit_tokens(9, 1, 10) == (10, True)
    s = Seq(1, 0.0, prompt_tokens=300, output_tokens=50)
    assert [s.prefill_chunk(n) for n in (256, 44)] == [False, True] and s.prefilled == 300
    prompt, out, gen, t0 = 300, 50, 7, 1000       # joins at tick 1000 with 7 tokens
    key, fin = P.tick_key(prompt, gen, t0), P.finish_tick(t0, out, gen)
    for j in (0, 5, out - gen):
        assert key + t0 + j == prompt + gen + j                  # its context
        assert P.generated_by(out, fin, t0 + j) == gen + j       # its tokens
    assert fin == t0 + out - gen
    assert P.last_token_at(t0, t0, 9.0, 4.0) == 4.0              # no step since it joined
    assert P.last_token_at(t0 + 1, t0, 9.0, 4.0) == 9.0


def test_policy_runs_carry_their_own_engine_settings():
    from simulator.config.scenario import validate_scenario
    from conftest import make_scenario_dict
    d = make_scenario_dict()
    d["policies"] = ["chunked", {"policy": "fifo", "max_num_batched_tokens": 4096},
                     {"policy": "priority_aging", "label": "prio", "aging_s": 2.0}]
    runs = dict(validate_scenario(d).policy_runs())
    assert list(runs) == ["chunked", "fifo", "prio"]
    assert runs["fifo"].engine.max_num_batched_tokens == 4096
    assert runs["chunked"].engine.max_num_batched_tokens == 256
    assert runs["prio"].engine.policy == "priority_aging" and runs["prio"].engine.aging_s == 2.0
    d["policies"] = ["fifo", {"policy": "fifo"}]
    with pytest.raises(Exception, match="labels repeat"):
        validate_scenario(d)
