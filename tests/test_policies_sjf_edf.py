"""Shortest job first (``sjf``) and earliest TTFT deadline first (``edf``) against
queueing theory and exact schedules.

SJF, one server (one sequence slot, whole prompts, one output token: the simulator is
then a single-server queue, ``test_queueing``), Poisson arrivals, two job sizes (1 s and
5 s, half each): non-preemptive priority to the short class.

1. On the same arrivals the simulated waits equal a two-class non-preemptive priority
   queue (a 20-line reference below) exactly, and Kleinrock's conservation law holds on
   the sample path: the work-weighted sum of waits, sum S_i W_i, is the same under FIFO
   and SJF (the integral of the queued work, which no work-conserving non-preemptive
   order changes), to float rounding; SJF's mean wait is the lower.
2. The reference on 10^6 customers matches Cobham's formula for the class means,
   ``W_k = W0 / ((1 - sigma_{k-1})(1 - sigma_k))`` with ``W0 = lambda E[S^2] / 2``,
   within 2%, with the batch-means standard error checked below 1% so that 2% means
   something (about 3.5 standard errors).

EDF: a feasible deterministic case FIFO misses (exact times); and the compiled loop runs
``edf`` bit for bit as SimPy does.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from conftest import make_profile, make_scenario
from loopcheck import assert_identical, pressure_scenario
from simulator.loops.simulate import simulate
from simulator.workload.base import Workload
from simulator.workload.classes import SLO

SIZES_S = np.array([1.0, 5.0])      # the two job sizes (s): 1,000 and 5,000 tokens at 1 ms
RHO = 0.7


def _one_slot(policy: str, **wl):
    return make_scenario(engine={"policy": policy, "max_num_seqs": 1,
                                 "max_num_batched_tokens": 10**7, "kv": {"num_blocks": 10**7}},
                         **wl)


PROFILE = make_profile(prefill=((1, 0, 1.0), (10**6, 0, 10**6 * 1.0)))   # 1 ms per token


def _draw(n: int, seed: int):
    rng = np.random.default_rng(seed)
    lam = RHO / SIZES_S.mean()
    arr = np.cumsum(rng.exponential(1 / lam, n))
    cls = rng.integers(0, 2, n)
    return arr, cls, SIZES_S[cls]


def priority_waits(arr, service, cls) -> np.ndarray:
    """Waits of a non-preemptive single server that takes class 0 before class 1, FIFO
    within a class (the reference queue)."""
    n = len(arr)
    w = np.empty(n)
    q = (deque(), deque())
    t, i = 0.0, 0
    for _ in range(n):
        if not q[0] and not q[1]:
            t = max(t, arr[i])
        while i < n and arr[i] <= t:
            q[cls[i]].append(i)
            i += 1
        j = q[0].popleft() if q[0] else q[1].popleft()
        w[j] = t - arr[j]
        t += service[j]
    return w


def test_sjf_is_the_nonpreemptive_priority_queue_and_conserves_work():
    arr, cls, service = _draw(3000, seed=3)
    tokens = (service * 1000).astype(np.int64)
    wl = Workload(arrival_s=arr, prompt_tokens=tokens, output_tokens=np.ones_like(tokens),
                  priority=np.zeros_like(tokens))
    waits = {}
    for pol in ("fifo", "sjf"):
        res = simulate(_one_slot(pol), 0, workload=wl, profile=PROFILE)
        waits[pol] = res.rec.scheduled - res.rec.enqueued
    np.testing.assert_allclose(waits["sjf"], priority_waits(arr, service, cls), rtol=0,
                               atol=1e-9)
    # Conservation: sum S_i W_i is order-free (each term ~1e4 s^2: rounding ~1e-12 rel).
    a, b = (float((service * waits[p]).sum()) for p in ("fifo", "sjf"))
    assert abs(a - b) <= 1e-9 * a, (a, b)
    assert waits["sjf"].mean() < 0.8 * waits["fifo"].mean()
    # Not vacuous: SJF did reorder (the long jobs wait longer than under FIFO).
    assert waits["sjf"][cls == 1].mean() > waits["fifo"][cls == 1].mean()


def test_priority_queue_matches_cobhams_formula():
    n = 1_000_000
    arr, cls, service = _draw(n, seed=5)
    w = priority_waits(arr, service, cls)
    lam = RHO / SIZES_S.mean()
    w0 = lam * (SIZES_S ** 2).mean() / 2
    sigma1 = lam * 0.5 * SIZES_S[0]
    expected = (w0 / (1 - sigma1), w0 / ((1 - sigma1) * (1 - RHO)))
    burn = n // 100
    for k in (0, 1):
        wk = w[burn:][cls[burn:] == k]
        batches = wk[: len(wk) // 40 * 40].reshape(40, -1).mean(axis=1)
        se = batches.std(ddof=1) / np.sqrt(len(batches))
        assert se / expected[k] < 0.01, "not enough customers for a 2% check"
        assert abs(wk.mean() - expected[k]) / expected[k] < 0.02, (k, wk.mean(), expected[k])
    # And the order matters as the law says: FIFO's mean wait (Pollaczek-Khinchine)
    # lies above SJF's overall mean.
    fifo = w0 / (1 - RHO)
    assert 0.5 * expected[0] + 0.5 * expected[1] < fifo


def _edf_case(policy: str):
    """Three requests on one slot: A (batch) at 0 for 1 s, B (batch) at 0.1 s for 1 s, C
    (urgent, TTFT target 1.5 s) at 0.2 s for 0.5 s. FIFO runs A, B, C: C's first token at
    2.5 s, TTFT 2.3 s, missed. EDF runs A, then C (deadline 1.7 s) before B (10.1 s):
    C's TTFT 1.3 s, B's 2.4 s; every target met."""
    classes = [{"name": "urgent", "slo": {"ttft_ms": 1500}},
               {"name": "batch", "slo": {"ttft_ms": 10000}}]
    sc = _one_slot(policy, workload={"kind": "synthetic", "num_requests": 3,
                                     "arrival": {"kind": "poisson", "rate": 1.0},
                                     "prompt_tokens": {"kind": "constant", "value": 10},
                                     "output_tokens": {"kind": "constant", "value": 1},
                                     "classes": classes})
    wl = Workload(arrival_s=np.array([0.0, 0.1, 0.2]),
                  prompt_tokens=np.array([1000, 1000, 500]), output_tokens=np.ones(3, int),
                  priority=np.array([1, 1, 0]), class_names=("urgent", "batch"))
    res = simulate(sc, 0, workload=wl, profile=PROFILE)
    return res.rec.first_token - res.rec.arrival


def test_edf_meets_every_deadline_where_fifo_misses_one():
    slo = np.array([10.0, 10.0, 1.5])
    fifo, edf = _edf_case("chunked"), _edf_case("edf")
    np.testing.assert_allclose(fifo, [1.0, 1.9, 2.3], atol=1e-9)
    np.testing.assert_allclose(edf, [1.0, 2.4, 1.3], atol=1e-9)
    assert (fifo > slo).sum() == 1 and (edf <= slo).all()


def test_edf_runs_compiled_bit_for_bit():
    """Memory pressure, three classes with different targets (P2 the tightest, so the
    deadline order is not the priority order), preemptions by recompute and swap."""
    for seed, preemption in ((1, "recompute"), (2, "swap")):
        sc = pressure_scenario(80, seed, "edf", 2, "least_outstanding", 0.0, 40, 16, 128,
                               16, 400.0, "wan", 200, preemption=preemption,
                               victim="priority")
        for c, ms in zip(sc.workload.classes, (800.0, 3000.0, 200.0)):
            c.slo = SLO(ttft_ms=ms)
        ref = simulate(sc, loop="simpy")
        res = simulate(sc, loop="compiled")
        assert res.meta["loop"] == "compiled"
        assert_identical(ref, res)
        assert ref.rec.preemptions.sum() > 0      # the pressure is real


def test_sjf_declines_the_compiled_loop_with_a_reason():
    res = simulate(make_scenario(engine={"policy": "sjf", "max_num_seqs": 8,
                                         "max_num_batched_tokens": 256,
                                         "kv": {"num_blocks": 4096}}))
    assert res.meta["loop"] == ("simpy (policy 'sjf' compares every waiting request by its "
                                "own key (the compiled loop compares per-class FIFO heads))")


@pytest.mark.parametrize("w, key", [(0.0, 300.0), (0.5, 300.0 + 0.5 * 40)])
def test_sjf_key_is_remaining_prefill_plus_weighted_output(w, key):
    from simulator.model.scheduling import Seq, make_policy
    from simulator.model.scheduling.view import Waiting
    pol = make_policy("sjf", params={"output_weight": w})
    assert pol.order_key(Waiting(Seq(0, 0.0, 300, 40), float("nan"))) == key


def test_latsim_policies_says_which_loops_run_them():
    from simulator.cli.policies import policy_rows
    loops = {r["name"]: r["loops"] for r in policy_rows()}
    assert loops["edf"] == "compiled, simpy" and loops["sjf"] == "simpy"
