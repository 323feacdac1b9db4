"""Sweep speed: a 100-point sweep of 10k-request simulations on the local executor.

The scenario is ``sim_speed``'s (4 replicas of the H200 reference profile behind
``least_outstanding``, lognormal prompts ~1.2k and outputs ~200 tokens), 10,000
requests per point; the grid is arrival rate (10 values) x policy (2) x token
budget (5) = 100 points, one seed. Prints the wall time and points per minute.
A benchmark, not a test: run it on demand.

    python benchmarks/sweep_speed.py [--workers N] [--requests N] [--limit N]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from simulator.planning.sweep import parse_axis, run_sweep

REPO = Path(__file__).resolve().parents[1]
GRID = ["workload.arrival.rate=10:14.5:0.5", "engine.policy=chunked,priority_aging",
        "engine.max_num_batched_tokens=512,1024,1536,2048,4096"]


def scenario(n: int) -> dict:
    return {
        "name": "sweep-speed", "seed": 1,
        "workload": {"kind": "synthetic", "num_requests": n,
                     "arrival": {"kind": "poisson", "rate": 14.0},
                     "prompt_tokens": {"kind": "lognormal", "mean": 1155, "cv": 0.9, "max": 4000},
                     "output_tokens": {"kind": "lognormal", "mean": 211, "cv": 0.9, "max": 1000}},
        "cluster": {"replicas": 4, "router": "least_outstanding"},
        "engine": {"policy": "chunked", "max_num_seqs": 64, "max_num_batched_tokens": 512,
                   "kv": {"num_blocks": 16384}},
        "model": {"cost": {"kind": "profile",
                           "path": str(REPO / "profiles/h200-llama3-8b-refbench.json")}},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--limit", type=int, default=None, help="run only the first N points")
    a = ap.parse_args()
    axes = [parse_axis(g) for g in GRID]
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        res = run_sweep(scenario(a.requests), REPO, axes, Path(out), workers=a.workers,
                        limit=a.limit)
        wall = time.perf_counter() - t0
    workers = a.workers or os.cpu_count()
    print(f"{res.ran} points x {a.requests:,} requests on {workers} worker(s): "
          f"{wall:.1f} s wall, {res.ran / wall * 60:.1f} points/minute, "
          f"{res.ran * a.requests / wall:,.0f} simulated requests/s")


if __name__ == "__main__":
    main()
