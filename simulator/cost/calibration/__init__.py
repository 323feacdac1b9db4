"""Calibrate the physics step-cost model on recorded serving runs, and measure how well
a cost model reproduces one (``latsim calibrate``, ``latsim validate --run``).

A recorded run is what a server really did with some traffic. The subpackage, one
concept a module:

- ``recorded``: reading a run (refbench folders, ``latsim bench --out``) into a
  ``RecordedRun``; which policy run of a scenario served it (``match_policy``).
- ``steplog``: a run's steps and the intervals its recorded times measure
  (``StepLog``), from its step log when it has one (``steps_from_log``).
- ``replay``: the steps of a run without one, rebuilt by the scenario's own
  scheduling policy over the recorded requests.
- ``pricing``: a cost model's milliseconds for steps and intervals, and its error on
  them per kind of step.
- ``facts``: engine facts measured on the steps (host bookkeeping, decode waves, the
  step tail).
- ``refit``: the engine-specific coefficients refitted to the intervals (a robust fit
  by the one cost solver, ``simulator.cost.solve``).
- ``driver``: ``calibrate``, the whole calibration of a profile.
- ``validate``: real vs simulated for a run, and where the error comes from.
"""
from simulator.cost.calibration.driver import Calibration, calibrate, run_steps
from simulator.cost.calibration.facts import (apply_calibration, measure_facts, measure_tail,
                                              with_facts)
from simulator.cost.calibration.pricing import (interval_ms, model_pricer, predict_intervals,
                                                price_steps, step_errors, step_pricer,
                                                steps_core_book)
from simulator.cost.calibration.recorded import (METRICS, RUN_POLICIES, RecordedRun, RunCase,
                                                 match_policy, read_recorded_run, run_digest)
from simulator.cost.calibration.refit import (BOOK_SEQ, CALIBRATED, HUBER_RUN, PINNED_INFO,
                                              PRIOR_SD, SIGMA_RUN, Refit, refit)
from simulator.cost.calibration.replay import ReplayError, replay
from simulator.cost.calibration.steplog import WARMUP_STEPS, StepLog, steps_from_log
from simulator.cost.calibration.validate import (compare, noiseless_cost, simulate_run,
                                                 validate_recorded)

__all__ = [
    "BOOK_SEQ", "CALIBRATED", "HUBER_RUN", "METRICS", "PINNED_INFO", "PRIOR_SD",
    "RUN_POLICIES", "SIGMA_RUN", "WARMUP_STEPS", "Calibration", "RecordedRun", "Refit",
    "ReplayError", "RunCase", "StepLog", "apply_calibration", "calibrate", "compare",
    "interval_ms", "match_policy", "measure_facts", "measure_tail", "model_pricer",
    "noiseless_cost", "predict_intervals", "price_steps", "read_recorded_run", "refit",
    "replay", "run_digest", "run_steps", "simulate_run", "step_errors", "step_pricer",
    "steps_core_book", "steps_from_log", "validate_recorded", "with_facts",
]
