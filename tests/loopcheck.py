"""What the loop-equivalence tests share: ``assert_identical`` (two runs' results are the
same, bit for bit), a scenario builder over the configurations the loops run, and the
memory-pressure draws (``PRESSURE``, ``pressure_scenario``)."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from conftest import REPO, ZERO_NET, make_scenario
from simulator.report.recorder import TIMESTAMPS

POLICIES = ["chunked", "fifo", "priority_aging", "fair_score", "static", "edf"]

ARRAYS = TIMESTAMPS + ("replica", "new_connection", "rejected", "generated", "preemptions",
                       "recomputed_tokens", "preempted_s", "cached_tokens", "swapped_bytes")


def assert_identical(a, b, same_books: bool = True) -> None:
    """Two runs' results are the same, bit for bit. ``same_books=False`` compares two
    bookkeepings of the SimPy replica: it samples the time series at each step or at
    each epoch's end, sums ITL gaps in another order, and an epoch cut short has
    looked up the cost of steps it did not run; those are compared for what they must
    share (every gap counted in the same bins; times and sums to rounding)."""
    for f in ARRAYS:
        x, y = getattr(a.rec, f), getattr(b.rec, f)
        if same_books or x.dtype.kind != "f":
            np.testing.assert_array_equal(x, y, err_msg=f)
        else:   # an epoch's end is ``now + (end - now)``: the same time to rounding
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12, err_msg=f)
    ia, ib = a.rec.itl, b.rec.itl
    assert ia.n == ib.n and list(ia.counts) == list(ib.counts)
    if same_books:
        assert ia.total == ib.total
        assert (a.rec.steps, a.rec.step_time_total) == (b.rec.steps, b.rec.step_time_total)
        for sa, sb in zip(a.rec.series, b.rec.series, strict=True):
            for x, y in zip(sa, sb, strict=True):
                assert list(x) == list(y)
    else:
        assert abs(ia.total - ib.total) <= 1e-9 * max(1.0, abs(ia.total))
        assert a.rec.steps == b.rec.steps
        assert abs(a.rec.step_time_total - b.rec.step_time_total) <= \
            1e-9 * max(1.0, a.rec.step_time_total)
    if same_books:
        assert a.sim_end == b.sim_end
    else:
        assert abs(a.sim_end - b.sim_end) <= 1e-12 * max(1.0, abs(a.sim_end))
    if same_books:   # (an epoch cut short looked up the steps it did not run)
        assert (a.cost_lookups, a.extrapolations) == (b.cost_lookups, b.extrapolations)
    assert a.connections == b.connections
    assert a.meta["kv"] == b.meta["kv"]


def loop_scenario(n, seed, policy, replicas, router, alloc, max_len, watermark, blocks, max_seqs,
              budget, chunk, arrival, rate, net, noise, until, reuse, prompt_hi, out_hi,
              aging=1.0, preemption="recompute", victim="priority", swap_gb=4.0,
              caching=False, sys_prompt=0, cost="profile"):
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
    if cost != "profile":
        extra["model"] = {"cost": {"kind": cost, "path": str(REPO / "profiles" /
                                                            "h200-llama3-8b-refbench.json")}}
    sc = make_scenario(seed=seed, workload=wl, engine=eng, network=network,
                       cluster={"replicas": replicas, "router": router}, **extra)
    if noise:
        sc.model.cost.noise = True
    return sc


# The configurations every loop runs (the equivalence tests draw from them).
BROAD = dict(
    n=st.integers(1, 150), seed=st.integers(0, 10_000), policy=st.sampled_from(POLICIES),
    replicas=st.integers(1, 3), aging=st.sampled_from([0.05, 1.0, 30.0]),
    router=st.sampled_from(["round_robin", "least_outstanding", "random"]),
    alloc=st.sampled_from(["paged", "contiguous"]), max_len=st.sampled_from([None, 400]),
    watermark=st.sampled_from([0.0, 0.05]), blocks=st.sampled_from([40, 200, 4000]),
    max_seqs=st.sampled_from([1, 4, 16, 64]), budget=st.sampled_from([32, 128, 512]),
    chunk=st.sampled_from([None, 16, 100]),
    arrival=st.sampled_from(["poisson", "gamma", "constant"]),
    rate=st.sampled_from([2.0, 40.0, 400.0]), net=st.sampled_from(["zero", "wan"]),
    reuse=st.booleans(), prompt_hi=st.sampled_from([40, 300]),
    out_hi=st.sampled_from([2, 60, 200]))


# Memory-pressure configurations (few blocks, long outputs), shared with test_compiled.
PRESSURE = dict(
    n=st.integers(5, 90), seed=st.integers(0, 10_000),
    policy=st.sampled_from(POLICIES), replicas=st.integers(1, 2),
    watermark=st.sampled_from([0.0, 0.05]), blocks=st.sampled_from([24, 40, 64]),
    max_seqs=st.sampled_from([4, 16, 64]), budget=st.sampled_from([32, 128, 512]),
    chunk=st.sampled_from([None, 16]), rate=st.sampled_from([30.0, 400.0]),
    net=st.sampled_from(["zero", "wan"]), out_hi=st.sampled_from([60, 200]),
    aging=st.sampled_from([0.05, 1.0]), victim=st.sampled_from(["priority", "latest"]),
    preemption=st.sampled_from(["recompute", "swap"]), swap_gb=st.sampled_from([0.0, 0.01, 4.0]),
    cost=st.sampled_from(["profile", "fitted"]))


def pressure_scenario(n, seed, policy, replicas, router, watermark, blocks, max_seqs, budget,
                      chunk, rate, net, out_hi, noise=False, **kw):
    """A ``PRESSURE`` draw as a scenario: paged KV, Poisson arrivals, prompts up to 120."""
    return loop_scenario(n, seed, policy, replicas, router, "paged", None, watermark, blocks,
                     max_seqs, budget, chunk, "poisson", rate, net, noise, None, True, 120,
                     out_hi, **kw)


