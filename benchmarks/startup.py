"""Start-up time of the command line: the wall time of ``latsim --version`` and
``latsim run --help`` (a fresh interpreter each, the installed console script when on
PATH, else ``python -m simulator.cli``), median of ``--repeat`` runs. The goal is under
0.3 s on a quiet machine: no command's modules (pandas, numba, the web stack) are
imported for either (``tests/test_startup.py`` checks which modules are imported). The
header says when ``PYTHONDONTWRITEBYTECODE`` is set: an editable install then compiles
latsim's own modules from source at every start (a pip-installed one has their bytecode)."""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

CASES = (["--version"], ["run", "--help"], ["cost", "--help"])


def wall(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one run of ``cmd``."""
    before = os.times()
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    t = time.perf_counter() - t0
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system -
                                                          before.children_system)
    return t, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    exe = shutil.which("latsim")
    base = [exe] if exe else [sys.executable, "-m", "simulator.cli"]
    wall(base + ["--version"])   # warm the file cache once
    print(f"{' '.join(base)}; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs; median of {args.repeat}"
          + ("; PYTHONDONTWRITEBYTECODE set: latsim's modules are compiled from source at "
             "every start" if os.environ.get("PYTHONDONTWRITEBYTECODE") else ""))
    for case in CASES:
        runs = [wall(base + case) for _ in range(args.repeat)]
        print(f"latsim {' '.join(case):<12} wall {statistics.median(r[0] for r in runs):.3f} s"
              f"  cpu {statistics.median(r[1] for r in runs):.3f} s")


if __name__ == "__main__":
    main()
