"""The SimPy-free loop (``simulator.loops.fast.loop``) is the SimPy model, bit for bit
(``loop="python"``: this file tests the Python loop; ``test_compiled`` the compiled one).

Every recorded array, the ITL histogram, the time series, the step tallies, the
cost-model tallies, the connection counts, the KV tallies and the end of the run
must be *identical* (not close) between ``loop="simpy"`` and ``loop="auto"``, on
random configurations that cover what the fast loop runs: the three policies
(priority classes with aging among them),
several replicas and routers, paged and contiguous memory, watermarks, tight and
loose limits, preemption by recompute and by swap with both victim rules, prefix
caching of per-class system prompts, ties in time (constant
arrivals, zero network), cost noise, keep-alive pools, and a clock stop.
Configurations it cannot run (per-request streams, a policy of the user's) must run
on SimPy and say so.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ZERO_NET, make_scenario
from simulator.loops.fast.loop import Unsupported
from simulator.report.recorder import TIMESTAMPS
from simulator.loops.simulate import simulate

ARRAYS = TIMESTAMPS + ("replica", "new_connection", "rejected", "generated", "preemptions",
                       "recomputed_tokens", "preempted_s", "cached_tokens", "swapped_bytes")


def assert_identical(a, b) -> None:
    """Two runs' results are the same, bit for bit."""
    for f in ARRAYS:
        np.testing.assert_array_equal(getattr(a.rec, f), getattr(b.rec, f), err_msg=f)
    ia, ib = a.rec.itl, b.rec.itl
    assert (ia.n, ia.total) == (ib.n, ib.total)
    assert list(ia.counts) == list(ib.counts)
    assert (a.rec.steps, a.rec.step_time_total) == (b.rec.steps, b.rec.step_time_total)
    for sa, sb in zip(a.rec.series, b.rec.series, strict=True):
        for x, y in zip(sa, sb, strict=True):
            assert list(x) == list(y)
    assert a.sim_end == b.sim_end
    assert (a.cost_lookups, a.extrapolations) == (b.cost_lookups, b.extrapolations)
    assert a.connections == b.connections
    assert a.meta["kv"] == b.meta["kv"]


def _scenario(n, seed, policy, replicas, router, alloc, max_len, watermark, blocks, max_seqs,
              budget, chunk, arrival, rate, net, noise, until, reuse, prompt_hi, out_hi,
              aging=1.0, preemption="recompute", victim="priority", swap_gb=4.0,
              caching=False, sys_prompt=0):
    arr = ({"kind": "poisson", "rate": rate} if arrival == "poisson" else
           {"kind": "gamma", "rate": rate, "burstiness": 0.3} if arrival == "gamma" else
           {"kind": "constant", "rate": rate})
    wl = {"kind": "synthetic", "num_requests": n, "arrival": arr,
          "prompt_tokens": {"kind": "uniform", "low": 1, "high": prompt_hi},
          "output_tokens": {"kind": "uniform", "low": 1, "high": out_hi},
          "classes": [{"name": "P0", "share": 1, "system_prompt_tokens": sys_prompt},
                      {"name": "P1", "share": 2, "system_prompt_tokens": sys_prompt},
                      {"name": "P2", "share": 1}]}
    network = dict(ZERO_NET) if net == "zero" else {
        "distance_km": 800, "tls": "1.2", "clients": 3, "pool_size": 2, "keepalive_s": 0.5,
        "connection_reuse": reuse}
    eng = {"policy": policy, "max_num_seqs": min(max_seqs, budget),
           "max_num_batched_tokens": budget, "chunk_size": chunk, "aging_s": aging,
           "kv": {"num_blocks": blocks, "allocation": alloc, "watermark": watermark,
                  "max_model_len": max_len, "preemption": preemption, "victim": victim,
                  "swap_space_gb": swap_gb,
                  "prefix_caching": caching and alloc == "paged"}}
    extra = {"max_sim_time_s": until} if until else {}
    sc = make_scenario(seed=seed, workload=wl, engine=eng, network=network,
                       cluster={"replicas": replicas, "router": router}, **extra)
    if noise:
        sc.model.cost.noise = True
    return sc


@settings(max_examples=90, deadline=None, derandomize=True)
@given(n=st.integers(1, 150), seed=st.integers(0, 10_000),
       policy=st.sampled_from(["chunked", "fifo", "priority_aging"]), replicas=st.integers(1, 3),
       router=st.sampled_from(["round_robin", "least_outstanding", "random"]),
       alloc=st.sampled_from(["paged", "contiguous"]), max_len=st.sampled_from([None, 400]),
       watermark=st.sampled_from([0.0, 0.05]), blocks=st.sampled_from([40, 200, 4000]),
       max_seqs=st.sampled_from([1, 4, 16, 64]), budget=st.sampled_from([32, 128, 512]),
       chunk=st.sampled_from([None, 16, 100]),
       arrival=st.sampled_from(["poisson", "gamma", "constant"]),
       rate=st.sampled_from([2.0, 40.0, 400.0]), net=st.sampled_from(["zero", "wan"]),
       noise=st.booleans(), until=st.sampled_from([None, 0.7, 5.0]), reuse=st.booleans(),
       prompt_hi=st.sampled_from([40, 300]), out_hi=st.sampled_from([2, 60, 200]),
       aging=st.sampled_from([0.05, 1.0, 30.0]),
       preemption=st.sampled_from(["recompute", "swap"]),
       victim=st.sampled_from(["priority", "latest"]), caching=st.booleans(),
       sys_prompt=st.sampled_from([0, 40, 100]))
def test_fast_loop_is_the_simpy_model_bit_for_bit(**cfg):
    sc = _scenario(**cfg)
    ref = simulate(sc, loop="simpy")
    res = simulate(sc, loop="python")
    assert ref.meta["loop"] == "simpy"
    assert res.meta["loop"] == "fast" or res.meta["loop"].startswith("simpy (")
    assert_identical(ref, res)


def test_fast_loop_runs_the_common_configurations():
    """The equivalence above would be vacuous if the fast loop never ran: with room
    to spare it must run both policies, every router and both allocations."""
    for policy in ("chunked", "fifo", "priority_aging"):
        for router in ("round_robin", "least_outstanding", "random"):
            for alloc in ("paged", "contiguous"):
                sc = _scenario(300, 3, policy, 2, router, alloc, None, 0.0, 20000, 16, 256,
                               None, "poisson", 20.0, "wan", False, None, True, 300, 60)
                res = simulate(sc, loop="python")
                assert res.meta["loop"] == "fast", (policy, router, alloc)
                assert_identical(simulate(sc, loop="simpy"), res)


_NUMBA = pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                            reason="the compiled loop needs numba")


@pytest.mark.parametrize("loop", ["fast", pytest.param("compiled", marks=_NUMBA)])
@pytest.mark.parametrize("victim", ["priority", "latest"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_runs_on_the_fast_loops(victim, preemption, loop):
    """Preemption by recompute and swap, both victim rules, on the Python loop and on
    the compiled one (``test_compiled``)."""
    sc = _scenario(80, 1, "chunked", 1, "round_robin", "paged", None, 0.0, 40, 64, 512,
                   None, "poisson", 400.0, "zero", False, None, True, 300, 200,
                   victim=victim, preemption=preemption)
    res = simulate(sc, loop=loop)
    assert res.rec.preemptions.sum() > 0 and res.rec.preempted_s.sum() > 0
    if preemption == "swap":
        assert res.rec.swapped_bytes.sum() > 0 and res.meta["kv"]["swap_copy_s"] > 0
    else:
        assert res.rec.recomputed_tokens.sum() > 0
    assert_identical(simulate(sc, loop="simpy"), res)


@pytest.mark.parametrize("over, why", [
    ({"stream": {"every_tokens": 4}}, "per-request stream models"),
    ({"cluster": {"replicas": 2, "router": "nearest_region"}}, "router 'nearest_region'"),
])
def test_what_the_fast_loop_does_not_model_runs_on_simpy(over, why):
    res = simulate(make_scenario(**over))
    assert res.meta["loop"] == f"simpy ({why})"


def test_fast_loop_asked_for_an_unsupported_run_says_why():
    sc = make_scenario(stream={"every_tokens": 4})
    with pytest.raises(Unsupported, match="per-request stream models"):
        simulate(sc, loop="fast")


def test_unknown_loop_is_an_error():
    with pytest.raises(ValueError, match="unknown loop 'turbo'"):
        simulate(make_scenario(), loop="turbo")


@pytest.mark.parametrize("seed", range(12))
def test_memory_bound_runs_are_identical_whether_or_not_they_fall_back(seed):
    """Blocks scarce enough that growth sometimes finds too few free: with or without
    preemptions, every run equals SimPy's (and the first six do preempt)."""
    sc = _scenario(60, seed, "chunked", 1 + seed % 2, "least_outstanding", "paged", None,
                   0.05 * (seed % 3 == 0), 60 + 12 * seed, 16, 128, None, "poisson", 30.0,
                   "zero", seed % 2 == 0, None, True, 120, 150)
    res = simulate(sc, loop="python")
    assert res.meta["loop"] == "fast"
    assert (res.rec.preemptions.sum() > 0) == (seed < 6)
    assert_identical(simulate(sc, loop="simpy"), res)


@pytest.mark.parametrize("seed", range(3))
def test_watermark_bound_arrivals_do_not_cut_epochs(seed):
    """A large watermark: arrivals whose blocks are free but inside the watermark
    must not end an epoch (the SimPy replica does not interrupt for them)."""
    sc = _scenario(80, seed, "chunked", 1, "round_robin", "paged", None, 0.3, 200, 16, 128,
                   None, "poisson", 20.0, "zero", False, None, True, 300, 100)
    res = simulate(sc, loop="python")
    assert res.meta["loop"] == "fast"
    assert_identical(simulate(sc, loop="simpy"), res)


def test_workload_read_in_windows_gives_the_same_run(monkeypatch):
    """The loop reads the workload's columns a window at a time; tiny windows (every
    few arrivals a refill) change nothing."""
    import simulator.loops.fast.loop as fastloop
    sc = _scenario(120, 5, "priority_aging", 2, "least_outstanding", "paged", None, 0.0, 4000,
                   16, 128, None, "gamma", 40.0, "wan", True, None, True, 300, 60)
    ref = simulate(sc, loop="simpy")
    monkeypatch.setattr(fastloop, "_WINDOW", 7)
    res = simulate(sc, loop="python")
    assert res.meta["loop"] == "fast"
    assert_identical(ref, res)


# Memory-pressure configurations (few blocks, long outputs), shared with test_compiled.
PRESSURE = dict(
    n=st.integers(5, 90), seed=st.integers(0, 10_000),
    policy=st.sampled_from(["chunked", "fifo", "priority_aging"]), replicas=st.integers(1, 2),
    watermark=st.sampled_from([0.0, 0.05]), blocks=st.sampled_from([24, 40, 64]),
    max_seqs=st.sampled_from([4, 16, 64]), budget=st.sampled_from([32, 128, 512]),
    chunk=st.sampled_from([None, 16]), rate=st.sampled_from([30.0, 400.0]),
    net=st.sampled_from(["zero", "wan"]), out_hi=st.sampled_from([60, 200]),
    aging=st.sampled_from([0.05, 1.0]), victim=st.sampled_from(["priority", "latest"]),
    preemption=st.sampled_from(["recompute", "swap"]), swap_gb=st.sampled_from([0.0, 0.01, 4.0]))


def pressure_scenario(n, seed, policy, replicas, router, watermark, blocks, max_seqs, budget,
                      chunk, rate, net, out_hi, noise=False, **kw):
    """A ``PRESSURE`` draw as a scenario: paged KV, Poisson arrivals, prompts up to 120."""
    return _scenario(n, seed, policy, replicas, router, "paged", None, watermark, blocks,
                     max_seqs, budget, chunk, "poisson", rate, net, noise, None, True, 120,
                     out_hi, **kw)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(**PRESSURE, router=st.sampled_from(["round_robin", "least_outstanding"]),
       noise=st.booleans(), caching=st.booleans(), sys_prompt=st.sampled_from([0, 40]))
def test_under_memory_pressure_the_fast_loop_preempts_as_simpy_does(**cfg):
    """Caches a few prompts large, long outputs: most runs preempt (by recompute or
    swap; a full swap space recomputes), some many times over; each must be SimPy's
    run bit for bit."""
    sc = pressure_scenario(**cfg)
    res = simulate(sc, loop="python")
    assert res.meta["loop"] == "fast"
    assert_identical(simulate(sc, loop="simpy"), res)


@pytest.mark.parametrize("policy", ["chunked", "fifo", "priority_aging"])
@pytest.mark.parametrize("blocks", [600, 3000])
def test_mooncake_prefix_hashes_give_the_same_run(policy, blocks):
    """Real prefix sharing (the Mooncake slice's hash ids, ``tests/data``) on a small
    cache (600 blocks: it evicts, preempts, and rejects the longest prompts) and a
    larger one: hits, evictions and every timestamp are SimPy's."""
    from conftest import REPO
    wl = {"kind": "trace", "path": str(REPO / "tests" / "data" / "mooncake_conv_head30.jsonl"),
          "speedup": 20.0}
    sc = make_scenario(workload=wl, engine={
        "policy": policy, "max_num_seqs": 16, "max_num_batched_tokens": 2048,
        "kv": {"num_blocks": blocks, "prefix_caching": True}})
    res = simulate(sc, loop="python")
    assert res.meta["loop"] == "fast" and res.meta["kv"]["hit_blocks"] > 0
    assert_identical(simulate(sc, loop="simpy"), res)
