"""How well a cost model reproduces a recorded run (``latsim validate --run``): the
run's traffic simulated and compared with what really happened (``simulate_run``,
``compare``), and the model's time for the run's measured intervals
(``validate_recorded``).
"""
from __future__ import annotations

import copy
import math
from typing import Optional

import numpy as np

from simulator.cost.calibration.pricing import interval_ms, model_pricer, price_steps, step_errors
from simulator.cost.calibration.recorded import METRICS, RecordedRun, RunCase
from simulator.cost.calibration.replay import replay
from simulator.cost.calibration.steplog import steps_from_log


def simulate_run(scenario, run: RecordedRun, *, cost_model=None, base_dir=None,
                 profile: Optional[dict] = None) -> dict:


    """Simulate ``scenario`` (one policy run) on the run's own traffic (its arrivals,
    lengths and classes) with the SimPy loop; its P50/P99s (ms) as ``summarize`` gives
    them. ``cost_model`` replaces the scenario's ``model.cost``.

    A run recorded until a deadline with requests unfinished (an overload run, say)
    reports the requests that finished by then, the early ones; the simulation is seen
    through the same window (``window_end``): only requests it finished by then count,
    else the late requests it carries to the end would be compared with none. (ITL
    pools every simulated gap: the simulator keeps them as a histogram, not by time.)"""
    from simulator.loops.simulate import simulate
    from simulator.report.metrics import requests_table, summarize

    res = simulate(scenario, workload=run.workload(), cost_model=cost_model,
                   base_dir=base_dir, profile=profile, loop="simpy")
    df = requests_table(res)
    end = run.window_end()
    if end is not None:
        df["finished"] = df["finished"].to_numpy(bool) & \
            (df["last_delivered"].to_numpy(float) <= end)
    out = summarize(df, res.rec.itl)
    out["window_end_s"] = end
    return out


def compare(real: dict, sim: dict) -> dict:
    """``{median_/p99_<metric>_ms: {real, sim, rel_err}}``: (sim - real) / real."""
    out = {}
    for m in METRICS:
        for q in ("median", "p99"):
            k = f"{q}_{m}_ms"
            r, s = real.get(k), sim.get(k)
            ok = (r is not None and s is not None and math.isfinite(r) and math.isfinite(s)
                  and r > 0)
            out[k] = {"real": r, "sim": s, "rel_err": (s - r) / r if ok else None}
    return out


def noiseless_cost(scenario, base_dir=None, profile: Optional[dict] = None):
    """The scenario's cost model with its step-time noise off (for pricing steps)."""
    from simulator.cost import build_cost_model, profile_search_dirs
    cfg = scenario.model.cost
    if getattr(cfg, "noise", False):
        cfg = cfg.model_copy(update={"noise": False})
    return build_cost_model(cfg, np.random.default_rng(0), profile_search_dirs(base_dir),
                            profile=profile)


def validate_recorded(case: RunCase, *, base_dir=None, profile: Optional[dict] = None,
                      cost_model=None) -> dict:
    """A recorded run against the simulator (``latsim validate --run``): the run's
    traffic simulated under the scenario (``simulate_run``; ``cost_model`` replaces the
    scenario's), real vs simulated P50/P99 (``compare``), and where the error comes
    from: the model's time for every measured interval of the run's steps against the
    measurement (``step_errors``, after warm-up), with the replay's check."""
    cost = cost_model if cost_model is not None else noiseless_cost(case.scenario, base_dir,
                                                                    profile)
    log = steps_from_log(case.run) if case.run.steps is not None else \
        replay(case.run, case.scenario, model_pricer(cost))
    total, book = price_steps(cost, log)
    errs = step_errors(interval_ms(log, total, book), log, log.warmup)
    sim = simulate_run(case.scenario, case.run, base_dir=base_dir, profile=profile,
                       cost_model=copy.deepcopy(cost_model) if cost_model is not None else None)
    return {"run": str(case.run.folder), "policy": case.scenario.engine.policy,
            "label": case.label, "requests": len(case.run), "real": case.run.real, "sim": sim,
            "errors": compare(case.run.real, sim), "step_errors": errs,
            "replay_check": log.check, "notes": list(case.run.notes),
            "cost_model": {k: v for k, v in cost.describe().items()
                           if k in ("kind", "fit_source", "step_tail", "bookkeeping_ms",
                                    "decode_blocks_per_sm", "alpha")}}
