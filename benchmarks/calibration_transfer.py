"""How far a calibration on recorded runs carries: ``latsim calibrate`` of the plain
conversion of the H200 reference profile on each published run alone and on both,
then each run replayed under each calibration (the simulator vs the run's real
P50/P99 of TTFT, TPOT, ITL and E2E).

A calibration checked on the run it was fitted to says how well the physics can
describe that run; checked on the other run it says what a user calibrating on one
recorded run of their server should expect on traffic they did not record. (The
shipped profile is the calibration on both runs: ``profiles/README.md``.)

Run: ``python benchmarks/calibration_transfer.py`` (about half a minute on two cores).
"""
from __future__ import annotations

from pathlib import Path

from simulator.config.scenario import load_scenario
from simulator.cost.calibration import (RunCase, calibrate, compare, match_policy,
                                        read_recorded_run)
from simulator.cost.convert import refbench_to_profile
from simulator.cost.fitted import FittedCostModel
from simulator.loops.simulate import simulate
from simulator.report.metrics import requests_table, summarize

REPO = Path(__file__).resolve().parents[1]
RUNS = ("load50-fifo", "load90-chunked")


def main() -> None:
    converted = refbench_to_profile(REPO / "data" / "h200-refbench" / "profile.csv")
    refbench, _ = load_scenario(REPO / "scenarios" / "refbench-h200.yaml",
                                ["model.cost.kind=fitted"])
    runs = {n: read_recorded_run(REPO / "data" / "h200-refbench" / "runs" / n) for n in RUNS}
    cases = {n: RunCase(r, *match_policy(refbench, r, "refbench-h200.yaml"))
             for n, r in runs.items()}
    calibrations = {n: calibrate([cases[n]], converted, cv=False).profile for n in RUNS}
    calibrations["both"] = calibrate(list(cases.values()), converted, cv=False).profile
    print("run             calibrated on    worst  | error % of the real P50/P99")
    for n in RUNS:
        scenario, base = load_scenario(REPO / "scenarios" / f"refbench-{n}.yaml")
        for src in (n, "both", *[m for m in RUNS if m != n]):
            res = simulate(scenario, workload=runs[n].workload(), base_dir=base,
                           cost_model=FittedCostModel(calibrations[src]), loop="simpy")
            errs = {k: 100 * e["rel_err"] for k, e in
                    compare(runs[n].real, summarize(requests_table(res), res.rec.itl)).items()}
            worst = max(abs(v) for v in errs.values())
            print(f"{n:15s} {src:15s} {worst:6.1f}  | " + " ".join(
                f"{k.removesuffix('_ms').replace('median', 'p50')} {v:+.1f}"
                for k, v in errs.items()))


if __name__ == "__main__":
    main()
