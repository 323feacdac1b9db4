"""One model, several ways to run it: they must agree bit for bit.

The SimPy replica keeps its books two ways: per request (``mode="slow"``, every decoder
visited every step) and by a replica-wide decode tick with decode epochs (``auto``).
Every recorded array, the ITL histogram, the time series, the step, cost, connection
and KV tallies and the end of the run must be *identical* between them, on random
configurations of everything SimPy runs: the four built-in policies, several replicas
and routers, paged and contiguous memory, watermarks, tight and loose limits,
preemption by recompute and by swap with both victim rules, prefix caching of
per-class system prompts and of real Mooncake hash ids, ties in time,
keep-alive pools. (The compiled loop is checked against SimPy in ``test_compiled``,
clock stops included.) And ``auto`` must say which loop ran and why.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO, make_scenario
from loopcheck import (BROAD, POLICIES, PRESSURE, assert_identical, loop_scenario,
                       pressure_scenario)
from simulator.loops.simulate import Unsupported, simulate


def _modes_agree(sc):
    ref = simulate(sc)
    slow = simulate(sc, loop="simpy", mode="slow")
    assert ref.meta["loop"].startswith("simpy")
    assert_identical(ref, slow, same_books=False)
    return ref


@settings(max_examples=70, deadline=None, derandomize=True)
@given(**BROAD, preemption=st.sampled_from(["recompute", "swap"]),
       victim=st.sampled_from(["priority", "latest"]), caching=st.booleans(),
       sys_prompt=st.sampled_from([0, 40, 100]))
def test_simpy_tick_bookkeeping_is_the_per_request_one_bit_for_bit(**cfg):
    """(Cost noise and a clock stop are left out: an epoch draws its steps' noise at
    once and records its gaps at its end, so a cut epoch differs by design.)"""
    _modes_agree(loop_scenario(noise=False, until=None, **cfg))


@settings(max_examples=50, deadline=None, derandomize=True)
@given(**PRESSURE, router=st.sampled_from(["round_robin", "least_outstanding"]),
       caching=st.booleans(), sys_prompt=st.sampled_from([0, 40]))
def test_under_memory_pressure_both_bookkeepings_preempt_alike(**cfg):
    """Caches a few prompts large, long outputs: most runs preempt (by recompute or
    swap; a full swap space recomputes), some many times over."""
    _modes_agree(pressure_scenario(**cfg))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("blocks", [600, 3000])
def test_mooncake_prefix_hashes_give_the_same_run(policy, blocks):
    """Real prefix sharing (the Mooncake slice's hash ids, ``tests/data``) on a small
    cache (600 blocks: it evicts, preempts, and rejects the longest prompts) and a
    larger one: hits, evictions and every timestamp agree."""
    wl = {"kind": "trace", "path": str(REPO / "tests" / "data" / "mooncake_conv_head30.jsonl"),
          "speedup": 20.0}
    sc = make_scenario(workload=wl, engine={
        "policy": policy, "max_num_seqs": 16, "max_num_batched_tokens": 2048,
        "kv": {"num_blocks": blocks, "prefix_caching": True}})
    res = _modes_agree(sc)
    assert res.meta["kv"]["hit_blocks"] > 0
    assert "below 1,000" in res.meta["loop"]
    # The compiled loop runs prefix caching too (``test_compiled``): the same run.
    assert_identical(res, simulate(sc, loop="compiled"))


@pytest.mark.parametrize("over, why", [
    ({"stream": {"every_tokens": 4}}, "per-request stream models"),
    ({"network": {"protocol": "http2"}}, "per-request stream models"),
])
def test_auto_says_why_a_run_is_on_simpy(over, why):
    res = simulate(make_scenario(**over))
    assert res.meta["loop"] == f"simpy ({why})"


def test_a_small_run_is_on_simpy_and_says_so():
    res = simulate(make_scenario())
    assert res.meta["loop"].startswith("simpy (") and "below 1,000" in res.meta["loop"]


def test_compiled_loop_asked_for_an_unsupported_run_says_why():
    sc = make_scenario(stream={"every_tokens": 4})
    with pytest.raises(Unsupported, match="per-request stream models"):
        simulate(sc, loop="compiled")


def test_unknown_loop_is_an_error():
    with pytest.raises(ValueError, match="unknown loop 'turbo'"):
        simulate(make_scenario(), loop="turbo")


def test_auto_runs_a_large_prefix_cached_run_compiled():
    """Prefix caching no longer sends ``auto`` to SimPy: a run past the compile
    threshold with shared system prompts runs compiled, and hits."""
    wl = {"kind": "synthetic", "num_requests": 1_000, "arrival": {"kind": "poisson", "rate": 40.0},
          "prompt_tokens": {"kind": "uniform", "low": 50, "high": 400},
          "output_tokens": {"kind": "uniform", "low": 5, "high": 60},
          "classes": [{"name": "chat", "share": 1, "system_prompt_tokens": 64}]}
    res = simulate(make_scenario(workload=wl, engine={
        "policy": "chunked", "max_num_seqs": 32, "max_num_batched_tokens": 256,
        "kv": {"num_blocks": 4096, "prefix_caching": True}}))
    assert res.meta["loop"] == "compiled"
    assert res.meta["kv"]["hit_blocks"] > 0
