"""Calibrating a profile on recorded runs (``calibrate``, ``latsim calibrate``).

The engine facts (``facts.measure_facts``) go into the profile's ``engine`` section,
the physics is fitted to the profile's rows with them, and then the engine-specific
coefficients are refitted to the runs' intervals (``refit.refit``); last the step tail
(``facts.measure_tail``). The result is written as the profile's ``meta.fit`` (used
while the rows still hash the same) and ``meta.calibration`` (what was fitted from
which run, and the step errors before and after). ``facts_only`` stops after the
facts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from simulator.cost import physics as ph
from simulator.cost.calibration.facts import (apply_calibration, measure_facts, measure_tail,
                                              with_facts)
from simulator.cost.calibration.pricing import predict_intervals, step_errors, step_pricer
from simulator.cost.calibration.recorded import RecordedRun, RunCase, run_digest
from simulator.cost.calibration.refit import refit
from simulator.cost.calibration.replay import replay
from simulator.cost.calibration.steplog import StepLog, steps_from_log


def run_steps(run: RecordedRun, scenario, c: np.ndarray) -> StepLog:
    """``run``'s steps: its step log when it has one, else ``replay`` with steps the run
    did not time priced by constants ``c``."""
    if run.steps is not None:
        return steps_from_log(run)
    return replay(run, scenario, step_pricer(c))


@dataclass
class Calibration:
    """What ``calibrate`` produced: the calibrated profile, the per-run step logs, and
    the report (``meta.calibration`` of the profile)."""

    profile: dict
    logs: list
    report: dict
    c_before: np.ndarray
    c_after: np.ndarray


def _coeff_table(c_before: np.ndarray, c_after: np.ndarray) -> dict:
    from simulator.cost.fit import PARAMS
    idx = [p[0] for p in PARAMS] + [ph.C_BOOK_SEQ_MS]
    return {ph.NAMES[i]: {"before": float(c_before[i]), "after": float(c_after[i])}
            for i in idx}


def calibrate(cases: Sequence[RunCase], profile: dict, *, facts_only: bool = False,
              profile_source: str = "", rounds: int = 6, cv: bool = True,
              log: Callable[[str], None] = lambda s: None) -> Calibration:
    """Calibrate ``profile`` on recorded runs (module doc): measure the engine facts on
    every run's steps, fit the physics to the profile's rows with them, then (unless
    ``facts_only``) refit the engine-specific coefficients to the runs' intervals; last
    the step tail (``measure_tail``). Runs without a step log are replayed again under
    the new coefficients and refitted (``rounds`` times in all), since the steps their
    tokens did not time are priced by the model. (Its length is that sequence of
    stages, each a call; the report it assembles is what ``latsim calibrate`` prints.)
    ``cv=False`` leaves out the rows' leave-one-out errors the stored fit reports (a
    refit per row): for a caller that wants only the calibrated constants."""
    from simulator.cost.fit import fit
    from simulator.cost.fitstore import fit_to_dict
    from simulator.cost.fitted import fitted_constants, step_tail

    base = fitted_constants(profile)
    c_before = base.c.copy()
    c_before[ph.C_SCALE] = step_tail(profile)
    logs = [run_steps(k.run, k.scenario, c_before) for k in cases]
    for k, lg in zip(cases, logs):
        log(f"{k.run.name}: {len(lg)} steps, {len(lg.meas_ms)} measured intervals "
            f"({lg.check['source']})")
    facts = measure_facts(logs, profile)
    prof = with_facts(profile, facts["facts"])
    log("engine facts: " + json.dumps({k: round(v, 6) if isinstance(v, float) else v
                                       for k, v in facts["facts"].items()}))
    log("fitting the physics to the profile's rows with them ...")
    rows_fit = fit(prof, cv=cv)
    c_after = rows_fit.c.copy()
    rf = None
    tail = 1.0
    if not facts_only:
        replayed = any(k.run.steps is None for k in cases)
        best = None
        for i in range(max(1, rounds)):
            if replayed:
                logs = [run_steps(k.run, k.scenario, c_after) for k in cases]
            rf = refit(rows_fit.c, logs)
            c_after = rf.c
            if not replayed:
                break
            # The steps the run did not time are priced by the model, so a better model
            # replays the run more faithfully: go on while the recorded times
            # contradict the replay less.
            bad = sum(lg.check.get("conflicts", 0) for lg in logs)
            log(f"round {i + 1}: {bad} recorded times contradict the replay")
            if best is not None and bad >= best[0]:
                logs, rf, c_after = best[1], best[2], best[2].c
                break
            best = (bad, logs, rf)
        log(f"refitted {', '.join(rf.free) or 'nothing'}")
        if "bookkeeping_seq_ms" in rf.free:
            prof["engine"]["bookkeeping_seq_ms"] = float(c_after[ph.C_BOOK_SEQ_MS])
            facts["facts"]["bookkeeping_seq_ms"] = float(c_after[ph.C_BOOK_SEQ_MS])
            facts["how"]["bookkeeping"] += ("; bookkeeping_seq_ms refitted with the host "
                                            "times (host time per sequence in a step)")
    tail = measure_tail(c_after, logs)
    from simulator.cost.profile import STEP_TAIL_RANGE
    if not tail <= STEP_TAIL_RANGE[1]:
        from simulator.errors import LatsimError
        raise LatsimError(f"the runs' steps took {tail:.3g}x their typical time on average "
                          f"(more than {STEP_TAIL_RANGE[1]:g}x): stalls, not step costs; "
                          "record them again on a machine that is not this busy",
                          source=", ".join(c.run.name for c in cases), field="--run")
    prof["engine"]["step_tail"] = tail
    facts["facts"]["step_tail"] = tail
    facts["how"]["step_tail"] = ("the runs' busy time over the median time of intervals like "
                                 "each (kind, batch, context, prefill tokens), after warm-up")
    log(f"step tail (mean over typical step time): {tail:.4f}")
    c_tail = c_after.copy()
    c_tail[ph.C_SCALE] = tail
    runs_doc = []
    for k, lg in zip(cases, logs):
        runs_doc.append({
            "run": str(k.run.folder), "format": k.run.kind, "digest": run_digest(k.run),
            "policy": k.scenario.engine.policy, "recorded_policy": k.run.recorded_policy,
            "requests": len(k.run), "steps": len(lg), "intervals": int(len(lg.meas_ms)),
            "token_clock": k.run.token_clock, "replay_check": lg.check,
            "step_errors_before": step_errors(predict_intervals(c_before, lg)[0], lg,
                                              lg.warmup),
            "step_errors_after": step_errors(predict_intervals(c_tail, lg)[0], lg,
                                             lg.warmup)})
    report = {
        "what": ("engine facts only (bookkeeping, decode waves) measured on the runs; "
                 "coefficients fitted to the profile's rows" if facts_only else
                 "engine facts measured on the runs; engine-specific coefficients refitted "
                 "to the runs' step intervals (robust fit, weak pull to the rows' fit)"),
        "base_profile": profile_source,
        "runs": runs_doc,
        "engine_facts": facts["facts"],
        "how": facts["how"],
    }
    if rf is not None:
        report.update(refitted=rf.free, kept=rf.fixed,
                      information={k: round(v, 3) for k, v in rf.info.items()},
                      coefficients=_coeff_table(rows_fit.c, c_after))
    out = apply_calibration(profile, report)
    meta = out["meta"]
    if not facts_only:
        rows_fit.c = c_after
        names = ", ".join(k.run.name for k in cases)
        d = fit_to_dict(rows_fit, out, source=f"calibrated on {names}")
        # The calibrated constants do not fit the rows as the stored errors describe:
        # those are the rows' own fit (leave-one-out), kept for reference.
        d["errors_note"] = ("errors and cv_* are of the fit to the profile's rows, before "
                            "calibration")
        meta["fit"] = d
    return Calibration(profile=out, logs=logs, report=report, c_before=c_before,
                       c_after=c_tail)
