"""Refitting the engine-specific coefficients of the physics to a run's intervals
(``refit``).

Host times and achieved efficiencies and rates are refitted; never the model's shape,
its transition exponents or the kernels' device floor. It is a robust (Huber) fit of
the log error of the model's interval times, with a weak pull towards the profile's
values, freeing only the coefficients the run's steps pin down (their information,
``_pinned``), solved by the one cost solver (``simulator.cost.solve``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from simulator.cost import physics as ph
from simulator.cost.calibration.pricing import predict_intervals
from simulator.cost.calibration.steplog import StepLog
from simulator.cost.solve import huber_loss, jacobian, solve


# Calibration fit: the relative error a steady step is expected to have on a serving
# run (about 1% jitter, timing of client-side tokens), Huber beyond this many of it,
# how far (in log units) the run may move a coefficient before the pull towards the
# profile's value matters, and the information a coefficient needs to be refitted
# (the run alone would pin it to 2% in log units, correlations aside).
SIGMA_RUN = 0.02
HUBER_RUN = 2.0
PRIOR_SD = 0.3
PINNED_INFO = 1.0 / 0.02 ** 2
# The engine-specific coefficients a run may refit: host times, achieved efficiencies
# and one-block rates. The transition exponents and the kernels' device floor describe
# the shape of the physics, not the engine's speed, and stay as the profile fitted them.
CALIBRATED = (ph.C_H_STEP, ph.C_H_DECODE, ph.C_H_CHUNK, ph.C_H_PREFIX, ph.C_H_GRAPH,
              ph.C_E_WEIGHTS, ph.C_E_GEMM, ph.C_E_FLASH, ph.C_E_MASKED, ph.C_CTA_PREFIX,
              ph.C_E_DECODE, ph.C_CTA_DECODE, ph.C_E_DECODE_EAGER)


# A run whose steps hold the host's bookkeeping (``StepLog.book_in_step``) cannot tell
# the part per step from the host time per step, but can show the part per sequence:
# it is refitted too, from a typical value (ms) within these bounds.
BOOK_SEQ = (0.02, 1e-4, 50.0)
# How ``solve`` runs the refit (its damping schedule, stopping rule and finite
# differences: absolute steps, forward even at an upper bound; the normal equations as
# ``J^T W J``), as the stored calibrations were computed.
FD_STEP = 1e-6
SOLVER = {"lam": 1e-2, "tries": 10, "ridge": 0.0, "tol": 1e-9, "lam_min": 1e-9,
          "step": FD_STEP, "relative_step": False, "step_inside": False,
          "sqrt_weights": False}


def _pinned(J: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Information of each coefficient on the run: ``sum w (dlog t / dlog x)^2 /
    sigma^2`` over the intervals (the inverse squared spread it would be known to
    alone)."""
    return (w[:, None] * (J / SIGMA_RUN) ** 2).sum(axis=0)


@dataclass
class Refit:
    """What ``refit`` did: the constants, which coefficients moved and why not the
    others, the loss before and after."""

    c: np.ndarray
    free: list
    fixed: dict
    info: dict
    loss0: float
    loss: float


def refit(c0: np.ndarray, logs: Sequence[StepLog], *, iters: int = 60) -> Refit:
    """Refit the engine-specific coefficients (``CALIBRATED``) of ``c0`` to the runs'
    intervals (module doc): ``solve`` on log coefficients, within the profile fit's
    bounds, of the Huber loss (``HUBER_RUN``) of ``log(model / measured) / SIGMA_RUN``
    plus ``((x - x0) / PRIOR_SD)^2 / 2``; only coefficients with ``PINNED_INFO`` or
    more information on the runs are free. Intervals in each run's warm-up are left
    out; each run weighs alike however many intervals it has."""
    from simulator.cost.fit import PARAMS, with_log_coefficients

    c_in = c0
    bounds = {p[0]: (p[2], p[3]) for p in PARAMS}
    bounds[ph.C_BOOK_SEQ_MS] = BOOK_SEQ[1:]
    graphs = c0[ph.C_GRAPHS] > 0
    cand = [i for i in CALIBRATED
            if graphs or i not in (ph.C_H_GRAPH, ph.C_E_DECODE_EAGER)]
    c0 = c0.copy()
    if logs and all(lg.book_in_step for lg in logs):
        cand.append(ph.C_BOOK_SEQ_MS)
        c0[ph.C_BOOK_SEQ_MS] = max(c0[ph.C_BOOK_SEQ_MS], BOOK_SEQ[0])
    meas = [lg.meas_ms[lg.iv_first >= lg.warmup] for lg in logs]
    logm = np.log(np.concatenate(meas)) if meas else np.zeros(0)
    # Each run counts alike, however many intervals it has.
    w = np.concatenate([np.full(len(m), len(logm) / max(len(m), 1) / max(len(logs), 1))
                        for m in meas]) if meas else np.zeros(0)
    ties = {} if graphs else {ph.C_E_DECODE_EAGER: ph.C_E_DECODE}

    def consts(idx, x):
        return with_log_coefficients(c0, idx, ties, x)

    def data_resid(c):
        out = []
        for lg in logs:
            p, _ = predict_intervals(c, lg)
            out.append(np.log(np.maximum(p[lg.iv_first >= lg.warmup], 1e-9)))
        return (np.concatenate(out) - logm) / SIGMA_RUN

    def resid(idx):
        return lambda x: data_resid(consts(idx, x))

    def huber(r):
        return huber_loss(r, HUBER_RUN)

    x0_all = np.log(np.maximum(c0[cand], 1e-12))
    r0 = data_resid(c0)
    loss0 = float(np.sum(w * huber(r0)))
    J0 = jacobian(resid(cand), x0_all, r0, step=FD_STEP) * SIGMA_RUN
    info = _pinned(J0, w)
    free = [i for i, v in zip(cand, info) if v >= PINNED_INFO and c0[i] < 1e5]
    fixed = {ph.NAMES[i]: ("not pinned by the run's steps (information "
                           f"{v:.3g} < {PINNED_INFO:.0f})" if c0[i] < 1e5 else
                           "no one-block bound in the profile's fit")
             for i, v in zip(cand, info) if i not in free}
    if ph.C_BOOK_SEQ_MS not in free:
        c0[ph.C_BOOK_SEQ_MS] = c_in[ph.C_BOOK_SEQ_MS]
    if not free:
        return Refit(c=c0.copy(), free=[], fixed=fixed,
                     info={ph.NAMES[i]: float(v) for i, v in zip(cand, info)},
                     loss0=loss0, loss=loss0)
    x0 = np.log(c0[free])
    sol = solve(resid(free), x0, np.log([bounds[i][0] for i in free]),
                np.log([bounds[i][1] for i in free]), huber=HUBER_RUN, weights=w,
                prior=(x0, PRIOR_SD), iters=iters, **SOLVER)
    return Refit(c=consts(free, sol.x), free=[ph.NAMES[i] for i in free], fixed=fixed,
                 info={ph.NAMES[i]: float(v) for i, v in zip(cand, info)},
                 loss0=loss0, loss=float(np.sum(w * huber(sol.r))))
