"""Simulator speed: simulated requests per wall-second and peak memory.

Runs the chunked policy on 4 replicas of the H200 reference profile with
Azure-conv-like traffic (lognormal prompts ~1k tokens, outputs ~200) at a load
that keeps each replica busy but stable, for 10k, 100k and 1M requests (pass
sizes as arguments to change). A benchmark, not a test: it prints its figures.

    python benchmarks/sim_speed.py [--loop auto|compiled|simpy] [--policy NAME]
        [--cost fitted|profile] [10000 100000 1000000]

The default runs this configuration on the compiled loop (``simulator.loops.compiled``,
numba); ``--loop simpy`` on SimPy. Both give identical results.
The compiled loop is compiled once per machine and then loaded from numba's cache:
a warm-up run prints how long that took, apart from the timed runs.
"""
from __future__ import annotations

import resource
import sys
import time

from simulator.config.scenario import validate_scenario
from simulator.loops.simulate import simulate

REPLICAS = 4


def scenario(n: int, policy: str = "chunked", cost: str = "fitted"):
    return validate_scenario({
        "name": "speed", "seed": 1,
        "workload": {"kind": "synthetic", "num_requests": n,
                     "arrival": {"kind": "poisson", "rate": 3.5 * REPLICAS},
                     "prompt_tokens": {"kind": "lognormal", "mean": 1155, "cv": 0.9, "max": 4000},
                     "output_tokens": {"kind": "lognormal", "mean": 211, "cv": 0.9, "max": 1000}},
        "cluster": {"replicas": REPLICAS, "router": "least_outstanding"},
        "engine": {"policy": policy, "max_num_seqs": 64, "max_num_batched_tokens": 512,
                   "kv": {"num_blocks": 16384}},
        "model": {"cost": {"kind": cost, "path": "profiles/h200-llama3-8b-refbench.json"}},
    })


def main(sizes: list[int], loop: str = "auto", policy: str = "chunked",
         cost: str = "fitted") -> None:
    if loop in ("auto", "compiled"):
        from simulator.loops.simulate import Unsupported
        t0 = time.perf_counter()
        try:
            simulate(scenario(200, policy, cost), loop="compiled")
            print(f"compiled loop ready in {time.perf_counter() - t0:.1f} s (compiling takes "
                  f"~45 s once per machine and version; later runs load the cache)")
        except Unsupported as e:
            print(f"compiled loop unavailable: {e}")
    print(f"{'requests':>10} {'wall s':>8} {'req/s':>9} {'steps':>10} {'steps/s':>9} "
          f"{'max RSS MB':>10}  loop")
    for n in sizes:
        sc = scenario(n, policy, cost)
        t0 = time.perf_counter()
        res = simulate(sc, loop=loop)
        wall = time.perf_counter() - t0
        # Peak RSS of the process so far (sizes run in increasing order, so it is this run's).
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{n:>10,} {wall:>8.2f} {n / wall:>9,.0f} {res.rec.steps:>10,} "
              f"{res.rec.steps / wall:>9,.0f} {rss:>10.0f}  {res.meta['loop']}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    opts = {"--loop": "auto", "--policy": "chunked", "--cost": "fitted"}
    while args[:1] and args[0] in opts:
        opts[args[0]], args = args[1], args[2:]
    main([int(a) for a in args] or [10_000, 100_000, 1_000_000], opts["--loop"], opts["--policy"],
         opts["--cost"])
