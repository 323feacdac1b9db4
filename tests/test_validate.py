"""latsim validate: the real engine and the simulator on the same trace.

Two checks, of different strength:

1. *Logic* (strict): fed the real engine's own step times (``ReplayCost``), the
   simulator must reproduce every request's scheduled / first-token / last-token
   time and the real step count, for every policy. The policies are the same objects
   in both executors, so what remains is timer resolution and the loop's
   sub-millisecond host gaps: measured max 0.21 ms on a quiet 2-core box (tiny model,
   ~500 steps per policy), 4 ms for a few requests when the box is busy; the test
   bounds the median at 0.3 ms, the 99th percentile at 10 ms, the worst at 25 ms.
2. *Cost model* (loose): with the profile the engine measured, simulated P50 TPOT
   and E2E stay within a factor of 5 of the real ones (measured: 1.3-2x on a quiet
   box, 3x for fifo TPOT when the profile and the replay ran beside other tests). On this shared CPU the tiny
   model's steps are 1-3 ms of mostly Python, serving steps measured 1.2-1.5x their
   profiled time (``step_fit``), and two real replays of one trace differed by up to
   48% in P50 TTFT, so the 10%/15% targets are a benchmark matter
   (``benchmarks/validate_cpu.py``); the factor 5 catches unit errors, wrong wiring
   or a profile of the wrong engine, which show up as 10x and more.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import REPO  # noqa: E402
from simulator.model.scheduling import make_policy  # noqa: E402
from simulator.workload import Workload  # noqa: E402


def _workload(n=80, rate=60.0, seed=1):
    rng = np.random.default_rng(seed)
    return Workload(arrival_s=np.cumsum(rng.exponential(1 / rate, n)),
                    prompt_tokens=np.clip(rng.lognormal(np.log(96), 0.8, n), 8, 384).astype(int),
                    output_tokens=np.clip(rng.lognormal(np.log(12), 0.8, n), 1, 48).astype(int),
                    priority=rng.choice(3, n), class_names=("P0", "P1", "P2"))


@pytest.mark.exclusive  # real step times, ms bounds
@pytest.mark.parametrize("policy", ["fifo", "chunked", "priority_aging"])
def test_simulator_with_real_step_times_reproduces_the_real_run(policy):
    from real_engine.profile import build_engine
    from real_engine.runner import run_trace
    from real_engine.validate import (engine_settings, policy_kwargs, real_table,
                                      replay_logic_check)
    settings = engine_settings(max_num_seqs=16, max_num_batched_tokens=128, aging_s=0.05)
    engine = build_engine("tiny", "cpu", max_num_seqs=16, max_num_batched_tokens=128)
    pol = make_policy(policy, **policy_kwargs(settings))
    engine.policy, engine.waiting = pol, pol.new_queue()
    wl = _workload()
    run = run_trace(engine, wl.arrival_s, wl.prompt_tokens, wl.output_tokens, wl.priority)
    real, _ = real_table(run, wl)
    sim, steps = replay_logic_check(run, wl, policy, settings, engine.cache.num_blocks)
    assert steps == len(run["steps"])
    cols = ["scheduled", "first_token", "last_token"]
    gap = np.abs(sim[cols].to_numpy() - real[cols].to_numpy())
    assert np.isfinite(gap).all()
    # Nearly every request within timer resolution. On a busy machine (a CPU hog beside
    # the test) a few requests' last tokens came out ~4 ms apart (5 of 80), not yet
    # explained; a logic drift would change the step count or shift most requests by
    # whole steps.
    assert np.median(gap) < 0.0003, np.median(gap)
    assert np.percentile(gap, 99) < 0.010, np.percentile(gap, 99)
    assert gap.max() < 0.025, gap.max()


@pytest.mark.exclusive  # a real engine's timing
def test_latsim_validate_end_to_end(tmp_path):
    prof = tmp_path / "tiny.json"
    r = subprocess.run([sys.executable, "-m", "simulator.cli", "profile", "--model", "tiny",
                        "--device", "cpu", "--quick", "--out", str(prof)],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "val"
    r = subprocess.run([sys.executable, "-m", "simulator.cli", "validate", "--profile", str(prof),
                        "--limit", "40", "--load", "0.4", "--max-prompt-tokens", "256",
                        "--max-output-tokens", "32", "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=600,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "real P50" in r.stdout and "with the real step times" in r.stdout
    v = json.loads((out / "validation.json").read_text())
    assert set(v["policies"]) == {"fifo", "chunked", "priority_aging"}
    for name, p in v["policies"].items():
        assert (out / f"real-{name}.csv").exists() and (out / f"sim-{name}.csv").exists()
        assert p["real"]["completed"] == p["sim"]["completed"] == 40
        assert p["logic_check"]["steps_sim"] == p["logic_check"]["steps_real"]
        for k in ("median_tpot_ms", "median_e2el_ms"):
            real, sim = p["errors"][k]["real"], p["errors"][k]["sim"]
            assert abs(math.log(sim / real)) < math.log(5), (name, k, real, sim)


def test_validate_without_profile_is_a_one_line_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "simulator.cli", "validate", "--profile",
                        str(tmp_path / "missing.json")], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 2 and "missing.json" in r.stderr and "Traceback" not in r.stderr
