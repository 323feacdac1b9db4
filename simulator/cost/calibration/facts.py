"""Engine facts measured on a run's steps, which a profile's rows cannot show, and
how they go into a profile.

**Facts** (``measure_facts``): host bookkeeping between steps, from the gaps between a
step's recorded end and the next one's recorded start (where the engine's steps are
timed without it, as the refbench engine's are; a ``latsim serve`` step holds its own
bookkeeping, so a bench run refits its part per sequence with the host times instead,
``refit``); and, for an engine whose decode attention is padded to the longest
context, where decode attention spills into a further wave of thread blocks
(``runs.score_decode_waves`` on single decode steps).

**Tails** (``measure_tail``). Real steps come in slow episodes and stalls that only
ever add time, so a robust fit (and a profile's medians) follows the typical step.
What they add on average is measured on the run whatever the model (busy time over
the median of intervals alike) and written as ``engine.step_tail``: a simulation
without step-time noise multiplies every step by it, so that busy time (and so
queueing) matches; one with noise (``model.cost.noise``) draws the tails instead.
"""
from __future__ import annotations

import copy
from typing import Sequence

import numpy as np
import pandas as pd

from simulator.cost import physics as ph
from simulator.cost.calibration.pricing import predict_intervals
from simulator.cost.calibration.steplog import StepLog
from simulator.cost.runs import cell_labels, fit_bookkeeping, score_decode_waves


def measure_facts(logs: Sequence[StepLog], profile: dict, *, waves: bool = True,
                  blocks=(2, 3, 4, 6, 8), costs=(0.25, 0.5, 0.625, 0.75, 1.0)) -> dict:
    """Engine facts of the runs (module doc): ``bookkeeping_ms`` and
    ``bookkeeping_seq_ms`` when the runs record host gaps, and, for padded decode
    attention, ``decode_blocks_per_sm`` and ``decode_wave_cost``. Returns ``{"facts":
    {...}, "how": {fact: how it was measured}}``; a fact the runs cannot show is absent
    (the profile keeps its own) and ``how`` says why."""
    facts: dict = {}
    how: dict = {}
    # Only where the bookkeeping lies between steps do the gaps measure it (a bench
    # run's steps hold it; its gaps are the serving loop's own overhead).
    gl = [lg for lg in logs if not lg.book_in_step]
    seqs = np.concatenate([lg.gap_seqs for lg in gl]) if gl else np.zeros(0)
    gaps = np.concatenate([lg.gaps_ms for lg in gl]) if gl else np.zeros(0)
    b = fit_bookkeeping(seqs, gaps)
    if b["n"] >= 20:
        facts["bookkeeping_ms"] = b["bookkeeping_ms"]
        facts["bookkeeping_seq_ms"] = b["bookkeeping_seq_ms"]
        how["bookkeeping"] = (f"least squares over {b['n']} recorded host gaps between busy "
                              f"steps (gap = a + b x sequences in the step before)")
    else:
        how["bookkeeping"] = (f"only {b['n']} recorded gaps between a step's end and the next "
                              f"one's start: kept the profile's (the host time between steps "
                              f"is then inside the refitted host time per step)")
    padded = (profile.get("engine") or {}).get("decode_attention") == "padded"
    if waves and padded:
        samples = []
        for lg in logs:
            single = lg.iv_first == lg.iv_last
            k = lg.iv_last[single]
            ok = np.array([lg.nd[i] > 0 and not lg.chunks[i] for i in k], bool)
            ok &= k >= lg.warmup
            k = k[ok]
            if not len(k):
                continue
            eng = profile.get("engine") or {}
            # Measured intervals that open at the previous step's end hold its gap too
            # (and every step holds its own when the run's steps include it).
            per_step = float(eng.get("bookkeeping_ms") or 0.0)
            per_seq = float(eng.get("bookkeeping_seq_ms") or 0.0)
            # (decode-only steps: a sequence per decode)
            book = np.array([ph.book_ms(per_step, per_seq, int(lg.nd[i])) for i in k])
            extra = np.where(lg.iv_from_start[single][ok] & (not lg.book_in_step), 0.0, book)
            samples.append((lg.nd[k], lg.ctx_max[k], lg.ctx_sum[k],
                            lg.meas_ms[single][ok], extra))
        n = sum(len(s[0]) for s in samples)
        if n >= 200 and len(set(np.concatenate([s[0] for s in samples]).tolist())) >= 8:
            w = score_decode_waves(samples, profile, blocks=blocks, costs=costs)
            facts["decode_blocks_per_sm"] = w["decode_blocks_per_sm"]
            facts["decode_wave_cost"] = w["decode_wave_cost"]
            how["decode_waves"] = (f"{n} single decode-only steps at "
                                   f"{len(set(np.concatenate([s[0] for s in samples]).tolist()))} "
                                   f"batch sizes; candidates scored (lower is better): "
                                   f"{w['scores']}")
        else:
            how["decode_waves"] = (f"only {n} single decode-only steps (or fewer than 8 batch "
                                   f"sizes): kept the profile's")
    elif waves:
        how["decode_waves"] = ("paged decode attention splits its work by page, not by "
                               "sequence: no waves of per-sequence blocks")
    return {"facts": facts, "how": how}


def apply_calibration(profile: dict, report: dict) -> dict:
    """``profile`` as ``calibrate`` leaves it, from its report (``meta.calibration``):
    the engine facts the report measured in its ``engine`` section and the report in
    ``meta.calibration``. (A refit's coefficients go to ``meta.fit`` on top of this.)"""
    out = with_facts(profile, report.get("engine_facts") or {})
    out.setdefault("meta", {})["calibration"] = report
    return out


def with_facts(profile: dict, facts: dict) -> dict:
    """A copy of ``profile`` with ``facts`` in its ``engine`` section (a stored fit is
    dropped: it no longer matches)."""
    p = copy.deepcopy(profile)
    p.setdefault("engine", {}).update(facts)
    p.get("meta", {}).pop("fit", None)
    return p


def _cells(log: StepLog) -> np.ndarray:
    """A label per interval grouping intervals alike in composition
    (``runs.cell_labels``): its kind, and the decode batch, longest context and
    prefill tokens of its last step."""
    k = log.iv_last
    return cell_labels(log.interval_kinds(), log.nd[k], log.ctx_max[k],
                       [log.chunks[i] for i in k])


def measure_tail(c: np.ndarray, logs: Sequence[StepLog]) -> float:
    """What slow episodes and stalls add to a typical step, on average: the runs'
    measured time over what the same intervals take at the median of intervals like
    them (same ``_cells`` label, the model's ratio taking out each one's composition
    within its label). The model's own bias cancels: only how a measurement spreads
    around the typical one of its kind counts. At least 1 (tails only add time)."""
    meas = typ = 0.0
    for lg in logs:
        keep = lg.iv_first >= lg.warmup
        if not keep.any():
            continue
        pred = predict_intervals(c, lg)[0][keep]
        m = lg.meas_ms[keep]
        cell = _cells(lg)[keep]
        ratio = pd.Series(m / pred).groupby(cell).transform("median").to_numpy()
        meas += float(m.sum())
        typ += float((pred * ratio).sum())
    return max(1.0, meas / typ) if typ > 0 else 1.0
