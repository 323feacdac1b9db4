"""Pricing a run's steps under a cost model: the physics constants' milliseconds per
step (``steps_core_book``, ``step_pricer``), any cost model's (``price_steps``,
``model_pricer``), per measured interval (``predict_intervals``, ``interval_ms``), and
the model's error on them per kind of step (``step_errors``).

A step's price is ``(core, bookkeeping)``: the step itself and the host bookkeeping
after it; a ``StepLog`` with ``book_in_step`` counts the bookkeeping inside its steps,
else in the gap after each.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from simulator.cost import physics as ph
from simulator.cost.calibration.steplog import StepLog
from simulator.cost.chunks import ChunkArrays
from simulator.kernel import kernel


@kernel
def steps_core_book(c, nd, cmax, csum, chn, chp, chf, nch, core, book):
    """Per step: the step itself (``physics.step_core_ms``) and the host bookkeeping
    after it, both times the constants' scale, into ``core`` and ``book`` (ms)."""
    for i in range(nd.shape[0]):
        core[i] = ph.step_core_ms(c, nd[i], cmax[i], csum[i], chn[i], chp[i], chf[i],
                                  nch[i], False) * c[ph.C_SCALE]
        book[i] = ph.bookkeeping_ms(c, nd[i] + nch[i]) * c[ph.C_SCALE]


def step_pricer(c: np.ndarray) -> Callable:
    """``step_ms`` for ``replay``: ``(core, bookkeeping)`` ms of one step under ``c``."""
    arrs = ChunkArrays()
    sc = float(c[ph.C_SCALE])

    def price(nd, cmax, csum, chunks):
        k = arrs.pack(chunks)
        core = ph.step_core_ms(c, nd, cmax, csum, arrs.n, arrs.p, arrs.f, k, False) * sc
        return core, ph.bookkeeping_ms(c, nd + k) * sc

    return price


def predict_intervals(c: np.ndarray, log: StepLog) -> tuple[np.ndarray, np.ndarray]:
    """The model's milliseconds of every measured interval of ``log`` (its steps, and the
    bookkeeping gaps it spans), and of every step alone (core, no bookkeeping)."""
    nd, cm, cs, chn, chp, chf, nch = log.arrays()
    core = np.empty(len(nd))
    book = np.empty(len(nd))
    steps_core_book(c, nd, cm, cs, chn, chp, chf, nch, core, book)
    cc = np.concatenate([[0.0], np.cumsum(core)])
    cb = np.concatenate([[0.0], np.cumsum(book)])
    j, k = log.iv_first, log.iv_last
    if log.book_in_step:
        return cc[k + 1] - cc[j] + cb[k + 1] - cb[j], core
    # The gaps after steps j..k-1 lie inside; the one before j too unless the interval
    # opens at j's own recorded start.
    g0 = np.where(log.iv_from_start, j, np.maximum(j - 1, 0))
    pred = cc[k + 1] - cc[j] + cb[k] - cb[g0]
    return pred, core


def price_steps(cost, log: StepLog) -> tuple[np.ndarray, np.ndarray]:
    """Any cost model's milliseconds for every step of ``log``: the step with the
    host bookkeeping after it (what ``step_time`` returns, noise off), and that
    bookkeeping alone."""
    c = _physics(cost)
    if c is not None:
        nd, cm, cs, chn, chp, chf, nch = log.arrays()
        core = np.empty(len(nd))
        book = np.empty(len(nd))
        steps_core_book(c, nd, cm, cs, chn, chp, chf, nch, core, book)
        return core + book, book
    total = np.array([cost.step_time(int(nd), int(a), int(b), [(x[0], x[1], x[2]) for x in ch])
                      for nd, a, b, ch in zip(log.nd, log.ctx_max, log.ctx_sum, log.chunks)])
    book = np.array([_bookkeeping_ms(cost, int(nd) + len(ch))
                     for nd, ch in zip(log.nd, log.chunks)], float)
    return total * 1e3, book


def interval_ms(log: StepLog, total: np.ndarray, book: np.ndarray) -> np.ndarray:
    """Model milliseconds of every measured interval from per-step ``total`` (step plus
    the bookkeeping after it) and ``book`` (``price_steps``): the steps it spans and
    the gaps between them, plus the gap before its first step unless it opens at that
    step's own recorded start."""
    ct = np.concatenate([[0.0], np.cumsum(total)])
    j, k = log.iv_first, log.iv_last
    if log.book_in_step:
        return ct[k + 1] - ct[j]
    before = np.where(log.iv_from_start | (j == 0), 0.0, book[np.maximum(j - 1, 0)])
    return ct[k + 1] - ct[j] - book[k] + before


def _ratio_stats(v: np.ndarray) -> dict:
    """Count, median, p10 and p90 of model / measured ratios."""
    return {"n": int(len(v)), "median": float(np.median(v)),
            "p10": float(np.percentile(v, 10)), "p90": float(np.percentile(v, 90))}


def _bias_by_quarter(pred: np.ndarray, log: StepLog, keep: np.ndarray) -> list:
    """The busy-time bias over each quarter of the run's time (by when an interval
    starts; ``from_s`` / ``to_s`` from the run's first step): a model right on average
    can still be off at the start of a run, where an engine warms up."""
    if not len(log.iv_first) or not keep.any():
        return []
    t0 = float(log.start[0])
    span = float(log.end[log.iv_last].max()) - t0
    t = log.start[log.iv_first] - t0
    q = np.minimum((t / span * 4.0).astype(np.int64), 3) if span > 0 else np.zeros(len(t), int)
    out = []
    for i in range(4):
        sel = keep & (q == i)
        bias = float(pred[sel].sum() / log.meas_ms[sel].sum() - 1.0) if sel.any() else math.nan
        out.append({"from_s": span * i / 4.0, "to_s": span * (i + 1) / 4.0,
                    "intervals": int(sel.sum()), "bias": bias})
    return out


def step_errors(pred: np.ndarray, log: StepLog, skip: int = 0) -> dict:
    """Where a model's error on a run comes from, given its milliseconds of every
    measured interval (``predict_intervals``, ``interval_ms``): per kind of step
    (``decode`` only, ``prefill`` only, ``mixed``; ``multi`` for intervals over several
    steps; ``prefill_chunks`` / ``mixed_chunks`` for those of the prefill-only and mixed
    steps with two or more chunks) the median, p10 and p90 of model / measured time, and
    the total busy-time bias (sum of model over sum of measured, minus one) and the same
    over each quarter of the run's time (``busy_bias_by_quarter``), over intervals from
    step ``skip`` on (``median_abs``: median |model / measured - 1|)."""
    keep = log.iv_first >= skip
    r = pred[keep] / log.meas_ms[keep]
    kinds = log.interval_kinds()[keep]
    out: dict = {}
    for k in ("decode", "prefill", "mixed", "multi"):
        sel = kinds == k
        if sel.sum():
            out[k] = _ratio_stats(r[sel])
    # Steps with several prefill chunks apart too: the host and attention work a chunk
    # adds is where a model's chunk accounting shows.
    nch = np.array([len(ch) for ch in log.chunks], np.int64)[log.iv_last][keep]
    for k in ("prefill", "mixed"):
        sel = (kinds == k) & (nch >= 2)
        if sel.sum():
            out[f"{k}_chunks"] = _ratio_stats(r[sel])
    out["busy_bias"] = float(pred[keep].sum() / log.meas_ms[keep].sum() - 1.0) if keep.any() \
        else math.nan
    out["busy_bias_by_quarter"] = _bias_by_quarter(pred, log, keep)
    out["median_abs"] = float(np.median(np.abs(r - 1.0))) if len(r) else math.nan
    out["intervals"] = int(keep.sum())
    return out


def model_pricer(cost) -> Callable:
    """``step_ms`` for ``replay`` from any cost model: ``(step, bookkeeping)`` ms."""
    c = _physics(cost)
    if c is not None:
        return step_pricer(c)
    def price(nd, cmax, csum, chunks):
        t = cost.step_time(nd, cmax, csum, [(x[0], x[1], x[2]) for x in chunks]) * 1e3
        bk = _bookkeeping_ms(cost, nd + len(chunks))
        return t - bk, bk

    return price


def _physics(cost) -> np.ndarray | None:
    """The physics constants of a cost model priced by them (None for any other)."""
    c = getattr(cost, "c", None)
    return c if isinstance(c, np.ndarray) and c.shape == (ph.N_CONST,) else None


def _bookkeeping_ms(cost, n_seqs: int) -> float:
    """The host bookkeeping a cost model's ``step_time`` holds after a step of
    ``n_seqs`` sequences (ms; ``physics.book_ms``)."""
    return ph.book_ms(float(getattr(cost, "bookkeeping_ms", 0.0) or 0.0),
                      float(getattr(cost, "bookkeeping_seq_ms", 0.0) or 0.0),
                      n_seqs) * float(getattr(cost, "scale", 1.0))
