"""Trace read speed: how long ``build_trace`` takes on each real trace in ``data/``.

Reads every trace the test suite checks against the data README (Azure 2023 code and
conversation, their Vidur re-encodings, Mooncake conversation and
synthetic), best of ``--repeat`` reads, and prints the rows, wall seconds, rows per
second and the peak resident memory of the process. A benchmark, not a test: run it
on demand.

    python benchmarks/trace_read.py [--repeat N] [--data PATH]
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import numpy as np

from simulator.workload.traces import TraceWorkload, build_trace

DATA = Path(__file__).resolve().parents[1] / "data"
TRACES = [
    "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
    "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
    "vidur/processed_traces/splitwise_code.csv",
    "vidur/processed_traces/splitwise_conv.csv",
    "mooncake/conversation_trace.jsonl",
    "mooncake/synthetic_trace.jsonl",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--data", type=Path, default=DATA)
    a = ap.parse_args()
    print(f"{'trace':<50} {'rows':>8} {'best s':>8} {'rows/s':>10}")
    for rel in TRACES:
        if not (a.data / rel).exists():
            print(f"{rel:<50} {'absent':>8}")
            continue
        best = float("inf")
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            wl = build_trace(TraceWorkload(path=rel), np.random.default_rng(0), a.data)
            best = min(best, time.perf_counter() - t0)
        n = len(wl.arrival_s)
        print(f"{rel:<50} {n:>8} {best:>8.3f} {n / best:>10.0f}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
