"""Big runs end to end: ``latsim run`` of the quickstart scenario at a million requests (and
more), results written, as a user runs it. Prints, per size: wall time, CPU time, the
run's own "simulated in" time, peak memory (the process's maximum resident set), the
size of what it wrote, and the machine's load average (other work on a small box
slows the wall time; the CPU time is the steadier figure).

First it warms the compiled event loop (a small ``--loop compiled`` run: it compiles the
loop when its cache is cold, ~1-2 min on 2 cores, and loads it in ~1 s after), and
reports that separately: the figures below are for a machine that has run latsim before.

    python benchmarks/big_run.py                        # 1,000,000 requests
    python benchmarks/big_run.py --requests 1000000 10000000
    python benchmarks/big_run.py --table-format csv     # the CSV writer instead of Parquet

Targets on the 2-core box: 1M requests under 30 s and 1 GB; 10M without running out
of memory.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCENARIO = REPO / "scenarios" / "quickstart.yaml"


def latsim_run(args: list[str]) -> dict:
    """Run ``latsim run ARGS`` in a child process; its wall and CPU seconds, peak RSS
    (bytes), exit code and output."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "simulator.cli", "run", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    # ``wait4`` would give this child's own rusage, but communicate() has reaped it; the
    # children's maximum is this child's when each size runs in a fresh interpreter below.
    import resource
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"rc": proc.returncode, "wall": wall, "cpu": ru.ru_utime + ru.ru_stime,
            "rss": ru.ru_maxrss * 1024, "out": out, "err": err}


def measure_one(n: int, fmt: str, keep: bool) -> None:
    """Child mode: one size in this (fresh) process, so RUSAGE_CHILDREN is its own."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"latsim-big-{n}-"))
    shutil.rmtree(out_dir)
    load0 = os.getloadavg()[0]
    r = latsim_run([str(SCENARIO), "--set", f"workload.num_requests={n}", "--out", str(out_dir),
                    "--table-format", fmt])
    load1 = os.getloadavg()[0]
    sim = re.search(r"simulated in ([\d.]+) s", " ".join(r["out"].split()))
    files = sorted(out_dir.glob("*")) if out_dir.exists() else []
    size = sum(f.stat().st_size for f in files)
    print(f"{n:>12,} requests: exit {r['rc']}, wall {r['wall']:7.1f} s, CPU {r['cpu']:7.1f} s, "
          f"simulated in {sim.group(1) if sim else '?':>7} s, peak RSS "
          f"{r['rss'] / 2**20:7,.0f} MiB, wrote {size / 2**20:7,.1f} MiB "
          f"({', '.join(f'{f.name} {f.stat().st_size / 2**20:,.1f} MiB' for f in files)}); "
          f"load average {load0:.1f} -> {load1:.1f}", flush=True)
    if r["rc"] != 0:
        print("  stderr: " + " | ".join(r["err"].strip().splitlines()[-3:]), flush=True)
    if not keep:
        shutil.rmtree(out_dir, ignore_errors=True)


def main() -> None:
    """Warm the compiled loop, then measure each size in a fresh interpreter."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--table-format", default="auto", choices=("auto", "csv", "parquet"))
    ap.add_argument("--keep", action="store_true", help="keep the result folders")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)   # child mode
    a = ap.parse_args()
    if a.one is not None:
        measure_one(a.one, a.table_format, a.keep)
        return
    with tempfile.TemporaryDirectory() as d:
        w = latsim_run([str(SCENARIO), "--set", "workload.num_requests=2000", "--loop",
                        "compiled", "--out", str(Path(d) / "warm")])
    compiled = "compiled it" if "compiling the event loop" in w["err"] else "loaded it"
    print(f"warm-up (2,000 requests, --loop compiled): {w['wall']:.1f} s ({compiled}), exit "
          f"{w['rc']}", flush=True)
    for n in a.requests:
        # A fresh interpreter per size: its children's peak RSS is this run's alone.
        cmd = [sys.executable, __file__, "--one", str(n), "--table-format", a.table_format]
        subprocess.run(cmd + (["--keep"] if a.keep else []), check=False)


if __name__ == "__main__":
    main()
