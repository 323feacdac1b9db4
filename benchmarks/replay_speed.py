"""Replay speed: the development vLLM runs and the Mooncake prefix scenario, end to end
through ``latsim run`` (a subprocess: start-up, reading, simulating and writing, as a
user waits for it).

Each run of ``data/vllm-h100-runs/`` becomes its scenario exactly as
``benchmarks/vllm_runs.py`` builds it (imported, not copied: its model, launch arguments,
inference-perf traffic, prefix caching on; ``engine: {preset: vllm}`` where this checkout
has it, or ``--explicit``: vLLM's settings one by one, without the API-server front end
and async scheduling). It prints per run the wall time of the whole command, its CPU
time (user + system: steadier than wall time on a shared machine), the simulating time
``latsim run`` reports, the requests it simulated, simulated requests
per wall second (whole command and simulating only) and the loop that ran (with why, when
it is SimPy). Then ``scenarios/mooncake-prefix.yaml`` (Mooncake's hour of conversation
traffic, prefix caching off and on: two runs in one command). A benchmark, not a test.

    python benchmarks/replay_speed.py [--runs NAME_SUBSTRING ...] [--explicit]
        [--loop auto|compiled|simpy] [--no-mooncake] [--out results/replay-speed.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import vllm_runs  # noqa: E402  (its scenario builder: one place)
from simulator.cost.calibration.aggregates import read_summary_run  # noqa: E402
from simulator.errors import LatsimError  # noqa: E402

MOONCAKE = ROOT / "scenarios" / "mooncake-prefix.yaml"
_SIMULATED = re.compile(r"simulated in ([0-9.]+) s")


def latsim_run(scenario: Path, out: Path, loop: str, *extra: str) -> dict:
    """``latsim run SCENARIO --out OUT``: wall time, what it reports, its exit code."""
    cmd = [sys.executable, "-m", "simulator.cli", "run", str(scenario), "--out", str(out),
           "--force", "--loop", loop, *extra]
    before = os.times()
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system -
                                                          before.children_system)
    row = {"wall_s": wall, "cpu_s": cpu, "rc": p.returncode}
    m = _SIMULATED.search(p.stdout)
    row["sim_s"] = float(m.group(1)) if m else float("nan")
    summary = out / "summary.json"
    if p.returncode in (0, 1) and summary.is_file():
        d = json.loads(summary.read_text())
        runs = [d] if "overall" in d else list(d.values())
        row["requests"] = sum(int(r["overall"]["num_requests"]) for r in runs)
        row["loops"] = sorted({r["run"]["event_loop"] for r in runs})
    else:
        row["error"] = (p.stderr.strip().splitlines() or ["?"])[-1]
    return row


def vllm_rows(names, explicit: bool, loop: str, work: Path) -> list[dict]:
    """One ``latsim_run`` per development vLLM run."""
    vllm_runs.ENGINE_PRESET = vllm_runs.ENGINE_PRESET and not explicit
    dirs = sorted(p for p in vllm_runs.RUNS_DIR.iterdir() if (p / "exp-config.yaml").is_file())
    if names:
        dirs = [d for d in dirs if any(s in d.name for s in names)]
    rows = []
    for d in dirs:
        try:
            data, _ = vllm_runs.scenario_for(d, read_summary_run(d))
        except LatsimError as e:
            rows.append({"run": d.name, "skipped": str(e)})
            continue
        path = work / f"{d.name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        print(f"... {d.name}", file=sys.stderr, flush=True)
        rows.append({"run": d.name, **latsim_run(path, work / d.name, loop)})
    return rows


def _fmt(row: dict) -> str:
    if "skipped" in row:
        return f"{row['run'][:44]:44s}  skipped: {row['skipped']}"
    if "error" in row:
        return f"{row['run'][:44]:44s}  exit {row['rc']}: {row['error']}"
    n = row["requests"]
    return (f"{row['run'][:44]:44s} {row['wall_s']:7.2f} {row['cpu_s']:7.2f} "
            f"{row['sim_s']:7.2f} {n:9,d} "
            f"{n / row['wall_s']:9,.0f} {n / row['sim_s']:10,.0f}  {'; '.join(row['loops'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="*", default=None,
                    help="only vLLM runs whose name has one of these substrings")
    ap.add_argument("--explicit", action="store_true",
                    help="vLLM's settings one by one (vllm_runs.explicit_engine)")
    ap.add_argument("--loop", default="auto", choices=("auto", "compiled", "simpy"))
    ap.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake scenario")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="replay-speed-") as tmp:
        work = Path(tmp)
        # First, untimed commands load (or compile) the kernels of both loops: every
        # row then measures a warm machine, as a user's second run does.
        for loop in ("simpy", "compiled"):
            latsim_run(ROOT / "scenarios" / "quickstart.yaml", work / "warm", loop,
                       "--set", "workload.num_requests=300",
                       "--set", "engine.kv.prefix_caching=true")
        rows = vllm_rows(a.runs, a.explicit, a.loop, work)
        if not a.no_mooncake:
            print(f"... {MOONCAKE.name}", file=sys.stderr, flush=True)
            rows.append({"run": MOONCAKE.name + " (2 runs)",
                         **latsim_run(MOONCAKE, work / "mooncake", a.loop)})
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
          + ("; PYTHONDONTWRITEBYTECODE set: latsim's modules are compiled from source at "
             "every start" if os.environ.get("PYTHONDONTWRITEBYTECODE") else ""))
    print(f"{'run':44s} {'wall s':>7s} {'cpu s':>7s} {'sim s':>7s} {'requests':>9s} "
          f"{'req/s':>9s} {'sim req/s':>10s}  loop")
    for row in rows:
        print(_fmt(row))
    done = [r for r in rows if "requests" in r]
    if done:
        tot_n = sum(r["requests"] for r in done)
        tot_w = sum(r["wall_s"] for r in done)
        print(f"{'total':44s} {tot_w:7.2f} {sum(r['cpu_s'] for r in done):7.2f} "
              f"{sum(r['sim_s'] for r in done):7.2f} "
              f"{tot_n:9,d} {tot_n / tot_w:9,.0f}")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
