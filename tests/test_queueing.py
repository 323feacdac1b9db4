"""Closed-form checks: one slot, Poisson arrivals, constant (M/D/1) or exponential
(M/M/1) service, built from the simulator's own workload generators and profile
cost model.

Two steps, because a 2% check of a mean waiting time at rho = 0.9 needs millions
of customers (the waiting-time autocorrelation is long: for M/M/1 at 0.9 the
relative standard error of the mean after N customers is about 21/sqrt(N)):

1. the simulator's per-request queueing delay equals Lindley's recursion
   ``W_n = max(0, W_{n-1} + S_{n-1} - A_n)`` on the same arrivals and service
   times, exactly (1e-9 s), so the simulator *is* that single-server queue;
2. Lindley's recursion on 4-10 million customers drawn by the same generators
   matches the closed forms (M/D/1: ``rho S / (2(1 - rho))``; M/M/1:
   ``rho / (mu - lambda)``) within 2%, and the batch-means standard error is
   checked to be small enough for 2% to mean something.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import make_profile, make_scenario
from simulator.loops.simulate import simulate
from simulator.workload.arrivals import PoissonArrival, arrival_times
from simulator.workload.base import Workload
from simulator.workload.lengths import ConstantLen, ExponentialLen, sample_lengths

MS_PER_TOKEN = 1.0  # service time = prompt tokens x 1 ms (linear profile through 0)
MEAN_TOKENS = 10_000  # 10 s mean service: integer token counts make it near-continuous


def _one_slot_scenario():
    return make_scenario(engine={"policy": "fifo", "max_num_seqs": 1,
                                 "max_num_batched_tokens": 10**7, "kv": {"num_blocks": 10**7}})


def _linear_profile():
    return make_profile(prefill=((1, 0, MS_PER_TOKEN), (10**6, 0, 10**6 * MS_PER_TOKEN)))


def _draw(kind: str, rho: float, n: int, seed: int):
    rng = np.random.default_rng(seed)
    mean_s = MEAN_TOKENS * MS_PER_TOKEN / 1000.0
    arr = arrival_times(PoissonArrival(rate=rho / mean_s), n, rng)
    dist = (ConstantLen(value=MEAN_TOKENS) if kind == "MD1"
            else ExponentialLen(mean=MEAN_TOKENS, max=None))
    tokens = sample_lengths(dist, n, rng)
    return arr, tokens, tokens * MS_PER_TOKEN / 1000.0


def _lindley(arr: np.ndarray, service: np.ndarray) -> np.ndarray:
    """Waits of a FIFO single server, vectorised: W_n = X_n - min_{k<=n} X_k."""
    x = np.concatenate([[0.0], np.cumsum(service[:-1] - np.diff(arr))])
    return x - np.minimum.accumulate(np.minimum(x, 0.0))


def _closed_form(kind: str, rho: float, mean_s: float) -> float:
    if kind == "MD1":
        return rho * mean_s / (2 * (1 - rho))
    return rho * mean_s / (1 - rho)


@pytest.mark.parametrize("kind", ["MD1", "MM1"])
@pytest.mark.parametrize("rho", [0.5, 0.7, 0.9])
def test_simulator_is_the_single_server_queue(kind, rho):
    arr, tokens, service = _draw(kind, rho, 20_000, seed=11)
    wl = Workload(arrival_s=arr, prompt_tokens=tokens, output_tokens=np.ones_like(tokens),
                  priority=np.zeros_like(tokens))
    res = simulate(_one_slot_scenario(), 0, workload=wl, profile=_linear_profile())
    sim_wait = res.rec.scheduled - res.rec.enqueued
    np.testing.assert_allclose(sim_wait, _lindley(arr, service), rtol=0, atol=1e-9)
    # And the service itself is what the queue assumed: first token after S.
    np.testing.assert_allclose(res.rec.first_token - res.rec.scheduled, service, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["MD1", "MM1"])
@pytest.mark.parametrize("rho", [0.5, 0.7, 0.9])
def test_queue_matches_closed_form(kind, rho):
    n = 10_000_000 if rho >= 0.9 else 4_000_000
    arr, _, service = _draw(kind, rho, n, seed=5)
    w = _lindley(arr, service)
    mean_s = MEAN_TOKENS * MS_PER_TOKEN / 1000.0
    expected = _closed_form(kind, rho, mean_s)
    burn = n // 100  # start empty: drop the warm-up
    w = w[burn:]
    batches = w[: len(w) // 40 * 40].reshape(40, -1).mean(axis=1)
    se = batches.std(ddof=1) / np.sqrt(len(batches))
    assert se / expected < 0.01, "not enough customers for a 2% check to be meaningful"
    assert abs(w.mean() - expected) / expected < 0.02, (w.mean(), expected)
