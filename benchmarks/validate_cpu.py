"""Full-size CPU validation: the real engine against the simulator.

Profiles the model on this CPU (one torch thread, the same process that then
serves), then replays one synthetic trace at 50% and 85% of the simulated
saturation throughput under every policy, through the real engine in wall-clock
time and through the simulator with the profile just measured. Prints, per load,
the error table and the step-by-step fit (measured / predicted step time per kind
of step, and the host gap between steps), and the targets (P50 <= 10%, P99 <=
15% for TTFT, TPOT, E2E). A benchmark, not a test: run it on a quiet machine.

It also prints the wall-clock figures the test suite no longer asserts (tests/test_validate.py
runs the engine on a virtual clock, so that what it checks never depends on this machine's
load): per policy, how far the simulator fed the real step times lands from each request's
real scheduled / first / last token time (median, P99, max; measured 0.21 ms max on a quiet
2-core box, ~4 ms for a few requests on a busy one; bounds 0.3 / 10 / 25 ms), and the
simulated over real P50 TPOT and E2E (measured 1.3-2x with the tiny model on a quiet box;
bound 5x, what a unit error or a profile of another engine would exceed). ``--quick`` is
the tests' former setup: the tiny model, 80 requests, 16 sequences, 128 batched tokens.

    python benchmarks/validate_cpu.py [--model small] [--requests 300] [--out results/validate-cpu]
    python benchmarks/validate_cpu.py --quick
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from real_engine.model import resolve_config
from real_engine.profile import build_engine, default_grid, run_profile
from real_engine.runner import run_trace
from real_engine.validate import (at_load, compare, diagnosis_lines, engine_settings, error_table,
                                  real_table,
                                  saturation_throughput, validate, write_validation)
from simulator.report.metrics import summarize
from simulator.workload import Workload

TARGETS = {"median": 0.10, "p99": 0.15}
# With the real step times (the logic check), ms: median, P99 and worst request.
LOGIC_BOUNDS_MS = {"median_abs_ms": 0.3, "p99_abs_ms": 10.0, "max_abs_ms": 25.0}
# Simulated over real P50 TPOT and E2E with the profile just measured: within this factor.
COST_FACTOR = 5.0


def workload(n: int, seed: int, max_prompt: int, max_output: int) -> Workload:
    """Poisson arrivals (rescaled later), log-normal-ish lengths, three classes."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(max_prompt / 4), 0.8, n), 8, max_prompt).astype(int)
    output = np.clip(rng.lognormal(np.log(max_output / 4), 0.8, n), 2, max_output).astype(int)
    return Workload(arrival_s=np.cumsum(rng.exponential(1.0, n)), prompt_tokens=prompt,
                    output_tokens=output, priority=rng.choice(3, n, p=[0.2, 0.5, 0.3]),
                    class_names=("P0", "P1", "P2"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--loads", default="0.5,0.85")
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--aging-s", type=float, default=2.0)
    ap.add_argument("--quick", action="store_true", help="the tiny model, 80 requests at "
                    "40%% load, 16 sequences, 128 batched tokens, aging 0.05 s, a quick profile")
    ap.add_argument("--out", default="results/validate-cpu")
    a = ap.parse_args()
    if a.quick:
        a.model, a.requests, a.loads, a.max_prompt, a.max_output = "tiny", 80, "0.4", 384, 48
        a.max_num_seqs, a.max_num_batched_tokens, a.aging_s = 16, 128, 0.05
    con = Console()
    torch.set_num_threads(a.threads)
    settings = engine_settings(max_num_seqs=a.max_num_seqs,
                               max_num_batched_tokens=a.max_num_batched_tokens, aging_s=a.aging_s)
    # Enough KV blocks for the profile grid and for serving: one engine does both.
    blocks = default_grid(resolve_config(a.model), "cpu").max_blocks() + 64
    engine = build_engine(a.model, "cpu", max_num_seqs=a.max_num_seqs,
                          max_num_batched_tokens=a.max_num_batched_tokens,
                          threads=a.threads, num_blocks=max(blocks, 4096))
    t0 = time.perf_counter()
    prof = run_profile(a.model, "cpu", Path(a.out) / f"cpu-{a.model}.json", engine=engine,
                       quick=a.quick, log=lambda s: None)
    con.print(f"profiled {a.model} in {time.perf_counter() - t0:.0f} s: "
              f"{len(prof['prefill'])} prefill, {len(prof['decode'])} decode rows")
    wl0 = workload(a.requests, 0, a.max_prompt, a.max_output)
    cap = saturation_throughput(prof, settings, engine.cache.num_blocks, wl0)
    con.print(f"simulated saturation throughput: {cap:.2f} req/s")
    worst = {}
    for load in (float(x) for x in a.loads.split(",")):
        wl = at_load(wl0, load * cap)
        res = validate(engine, prof, wl, ["fifo", "chunked", "priority_aging"], settings,
                       log=con.print)
        con.print(error_table(res, title=f"{a.model} on CPU at {load:.0%} load "
                                         f"({load * cap:.2f} req/s)"))
        for line in diagnosis_lines(res):
            con.print("  " + line, markup=False, highlight=False)
        for name, r in res.items():
            lc = r["logic_check"]
            figs = ", ".join(f"{k.split('_')[0]} {lc[k]:.3f} ms (bound {b:g}: "
                             f"{'met' if lc[k] <= b else 'MISSED'})"
                             for k, b in LOGIC_BOUNDS_MS.items())
            steps = "same steps" if lc["steps_sim"] == lc["steps_real"] else (
                f"STEPS DIFFER: {lc['steps_sim']} simulated, {lc['steps_real']} real")
            con.print(f"  {name}: with the real step times, per request: {figs}; {steps}",
                      markup=False, highlight=False)
            ratios = []
            for k in ("median_tpot_ms", "median_e2el_ms"):
                e = r["errors"][k]
                x = e["sim"] / e["real"] if e["real"] else float("nan")
                ok = 1 / COST_FACTOR <= x <= COST_FACTOR
                ratios.append(f"{k[7:11].upper()} sim/real x{x:.2f} "
                              f"({'met' if ok else 'MISSED'}: within x{COST_FACTOR:g})")
            con.print(f"  {name}: P50 " + ", ".join(ratios), markup=False, highlight=False)
        for name, r in res.items():
            for k, e in r["errors"].items():
                m = k.split("_")[1]
                if m in ("ttft", "tpot", "e2el") and e["rel_err"] is not None:
                    q = k.split("_")[0]
                    worst[(load, q, m)] = max(worst.get((load, q, m), 0), abs(e["rel_err"]))
        # The noise floor: the same trace served twice more by the same engine. No model
        # can agree with one real run better than two real runs agree with each other.
        runs = [real_table(run_trace(engine, wl.arrival_s, wl.prompt_tokens, wl.output_tokens,
                                     wl.priority), wl) for _ in range(2)]
        rr = compare(*(summarize(df, itl) for df, itl in runs))
        con.print("  real vs real (policy of the last run): " + ", ".join(
            f"{k.replace('_ms', '')} {v['rel_err'] * 100:+.0f}%" for k, v in rr.items()
            if v["rel_err"] is not None and "itl" not in k))
        write_validation(Path(a.out) / f"load-{load}", res,
                         {"model": a.model, "load": load, "saturation_rps": cap})
    con.print("targets: |error| of P50 <= 10%, of P99 <= 15% (TTFT, TPOT, E2E; worst policy)")
    for (load, q, m), e in sorted(worst.items()):
        ok = e <= TARGETS[q]
        con.print(f"  load {load:.0%} {q:>6} {m:<5} worst {e * 100:5.1f}%  "
                  f"{'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
