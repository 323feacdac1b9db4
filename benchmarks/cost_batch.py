"""``latsim cost`` for scripts: the time to price 10,000 steps (``--n``), mixed prefill
and decode steps of llama-2-70b on 4 x A100-80GB, three ways:

- the Python API ``simulator.cost.step_ms`` on arrays (the model already set up);
- ``latsim cost --steps FILE.csv`` end to end (a fresh process: start-up and model
  set-up included), and the same with ``--json`` rows from stdin (``--steps -``).

The goal is under a second for the 10,000 steps. Before the batch mode each ``latsim
cost`` call paid the whole start-up and set-up (2-3 s of CPU): 10,000 calls, hours."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

CONFIG = dict(model="llama-2-70b", gpu="a100-80gb", tp=4)


def steps(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, 5, n)            # 0: a decode-only step
    tokens = rng.integers(16, 2049, n)
    batch = rng.integers(0, 65, n)             # 0: a prefill-only step
    batch[prompts == 0] = np.maximum(batch[prompts == 0], 1)
    context = rng.integers(64, 4097, n)
    return prompts, tokens, batch, context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    args = ap.parse_args()
    from simulator.cost import step_ms
    p, L, b, c = steps(args.n)
    t0 = time.perf_counter()
    step_ms(prefill=(p[:1], L[:1]), decode=(b[:1], c[:1]), **CONFIG)   # set-up, once
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    ms = step_ms(prefill=(p, L), decode=(b, c), **CONFIG)
    api = time.perf_counter() - t0
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"step_ms API: {args.n:,} steps in {api:.3f} s ({api / args.n * 1e6:.1f} us/step; "
          f"model set-up {setup:.2f} s once); median step {np.median(ms):.2f} ms")
    exe = shutil.which("latsim")
    base = [exe] if exe else [sys.executable, "-m", "simulator.cli"]
    flags = ["cost", "--model", CONFIG["model"], "--gpu", CONFIG["gpu"], "--tp",
             str(CONFIG["tp"])]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "steps.csv")
        with open(path, "w") as f:
            f.write("prefill,decode\n")
            for i in range(args.n):
                f.write(f"{f'{p[i]}x{L[i]}' if p[i] else ''},{f'{b[i]}@{c[i]}' if b[i] else ''}\n")
        t0 = time.perf_counter()
        r = subprocess.run(base + flags + ["--steps", path], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        assert r.returncode == 0, r.stderr
        rows = r.stdout.count("\n") - 1
        t1 = time.perf_counter()
        subprocess.run(base + ["--version"], capture_output=True, check=True)
        start = time.perf_counter() - t1
        print(f"latsim cost --steps FILE.csv: {rows:,} rows in {wall:.2f} s end to end "
              f"(start-up alone {start:.2f} s)")
        lines = "".join(f'{{"prefill": [{p[i]}, {L[i]}], "decode": "{b[i]}@{c[i]}"}}\n'
                        if p[i] and b[i] else
                        (f'{{"prefill": "{p[i]}x{L[i]}"}}\n' if p[i] else
                         f'{{"decode": [{b[i]}, {c[i]}]}}\n') for i in range(args.n))
        t0 = time.perf_counter()
        r = subprocess.run(base + flags + ["--steps", "-", "--json"], input=lines,
                           capture_output=True, text=True)
        wall = time.perf_counter() - t0
        assert r.returncode == 0, r.stderr
        print(f"latsim cost --steps - --json: {r.stdout.count(chr(10)):,} rows in {wall:.2f} s "
              "end to end")


if __name__ == "__main__":
    main()
