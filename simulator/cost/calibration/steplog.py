"""A run's steps and the intervals its recorded times measure (``StepLog``), and a
refbench run's step log read as one (``steps_from_log``).

The measurements are *intervals*: from a known start (a step's recorded start, or the
recorded end of the step before it while the engine stayed busy) to a recorded end,
over one or more steps of known composition (``replay`` builds the steps of a run
without a step log).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from simulator.cost.calibration.recorded import RecordedRun
from simulator.cost.runs import chunk_arrays


# Steps at the start of a run left out of fits and error statistics (``StepLog.warmup``).
WARMUP_STEPS = 40


@dataclass
class StepLog:
    """A run's steps (arrays by step) and the measured intervals over them.

    ``chunks[i]``: ``(n, prior, completes, rid)`` of step ``i``'s prefill chunks;
    ``busy_before[i]``: the step started right after the previous one (not after an
    idle wait). An interval ``(j, k)`` runs from step ``j``'s start (``start_known``:
    its own recorded start; else the recorded end of step ``j - 1``, the gap between
    them included) to step ``k``'s recorded end; ``meas_ms`` its length. ``gaps``:
    recorded host gaps between a step's end and the next one's start, with the
    sequences of the step before (``gap_seqs``). ``book_in_step``: the recorded steps
    hold the host's bookkeeping (a ``latsim serve`` step runs from scheduling to
    applying its results, as the simulator's steps do); else it lies in the gap after
    each step (the refbench engine times the forward alone)."""

    name: str
    start: np.ndarray
    end: np.ndarray
    start_known: np.ndarray
    end_known: np.ndarray
    busy_before: np.ndarray
    nd: np.ndarray
    ctx_max: np.ndarray
    ctx_sum: np.ndarray
    chunks: list
    iv_first: np.ndarray
    iv_last: np.ndarray
    iv_from_start: np.ndarray
    meas_ms: np.ndarray
    gaps_ms: np.ndarray
    gap_seqs: np.ndarray
    book_in_step: bool = False
    check: dict = field(default_factory=dict)
    token_times: Optional[dict] = None
    _arrays: tuple = None

    def __len__(self) -> int:
        return len(self.nd)

    @property
    def warmup(self) -> int:
        """Steps at the start left out of fits and error statistics (the engine warming
        up): ``WARMUP_STEPS``, or a tenth of a shorter run."""
        return min(WARMUP_STEPS, len(self.nd) // 10)

    def arrays(self) -> tuple:
        """``nd, ctx_max, ctx_sum`` and padded ``chn, chp, chf`` with ``nch``."""
        if self._arrays is None:
            self._arrays = (self.nd.astype(np.int64), self.ctx_max.astype(np.int64),
                            self.ctx_sum.astype(np.int64)) + chunk_arrays(self.chunks)
        return self._arrays

    def kinds(self) -> np.ndarray:
        """Per step: ``decode`` (decodes only), ``prefill`` (chunks only), ``mixed``."""
        return np.array(["mixed" if (nd and ch) else "prefill" if ch else "decode"
                         for nd, ch in zip(self.nd, self.chunks)])

    def interval_kinds(self) -> np.ndarray:
        """Per interval: its step's kind, or ``multi`` when it spans several steps."""
        k = self.kinds()
        return np.where(self.iv_first == self.iv_last, k[self.iv_last], "multi")


def intervals(start, end, start_known, end_known, busy_before):
    """Measured intervals of a step sequence (``StepLog``): each recorded end closes
    one, which opens at the nearest earlier recorded start or recorded end of a step
    the engine went on from without idling."""
    first, last, from_start, meas = [], [], [], []
    n = len(end)
    for k in range(n):
        if not end_known[k]:
            continue
        j = k
        while True:
            if start_known[j]:
                t0, fs = start[j], True
                break
            if j > 0 and busy_before[j] and end_known[j - 1]:
                t0, fs = end[j - 1], False
                break
            if j == 0 or not busy_before[j]:
                t0 = None
                break
            j -= 1
        if t0 is None or end[k] - t0 <= 0:
            continue
        first.append(j)
        last.append(k)
        from_start.append(fs)
        meas.append((end[k] - t0) * 1e3)
    return (np.array(first, np.int64), np.array(last, np.int64), np.array(from_start, bool),
            np.array(meas, float))


def steps_from_log(run: RecordedRun) -> StepLog:
    """A refbench run's step log (``iterations.csv``, chunks rebuilt by
    ``runs.read_run``) as a ``StepLog``: every step's start and end recorded, each step
    its own interval, the host gaps between busy steps recorded."""
    rs = run.steps
    n = len(rs.nd)
    ones = np.ones(n, bool)
    busy = np.zeros(n, bool)
    gaps = rs.gap_s * 1e3
    busy[1:] = gaps[:-1] < 1.0
    first, last, fs, meas = intervals(rs.start_s, rs.end_s, ones, ones, busy)
    seqs = rs.nd + np.array([len(ch) for ch in rs.chunks])
    log = StepLog(name=run.name, start=rs.start_s, end=rs.end_s, start_known=ones,
                  end_known=ones, busy_before=busy, nd=rs.nd, ctx_max=rs.ctx_max,
                  ctx_sum=rs.ctx_sum, chunks=[list(ch) for ch in rs.chunks],
                  iv_first=first, iv_last=last, iv_from_start=fs, meas_ms=meas,
                  gaps_ms=gaps[:-1][busy[1:]], gap_seqs=seqs[:-1][busy[1:]])
    log.check = {"source": "step log (iterations.csv)", "steps": n,
                 "prefill_seq_mismatches": rs.check["prefill_seq_mismatches"],
                 "decode_mismatches": rs.check["decode_mismatches"],
                 "first_token_mismatches": rs.check["first_token_mismatches"]}
    return log
