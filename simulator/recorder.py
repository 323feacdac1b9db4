"""What a run records: one row of timestamps per request, the pooled
inter-token latencies, and per-replica time series.

Timestamps live in preallocated numpy arrays indexed by request id, so memory is
linear in requests and the hot path writes floats, not objects. Inter-token
latencies are pooled into a fine log-spaced histogram (bins 0.05% wide, so a
percentile read from it is within 0.05% of the exact one) instead of a list of
every gap, which would cost gigabytes at a million requests.
"""
from __future__ import annotations

import math
from array import array

import numpy as np

TIMESTAMPS = ("arrival", "enqueued", "scheduled", "first_token", "last_token",
              "first_delivered", "last_delivered")

_ITL_LO = 1e-7          # 0.1 us: below any real gap
_ITL_STEP = 5e-4        # relative bin width (log space)
_ITL_BINS = int(math.log(1e4 / _ITL_LO) / _ITL_STEP) + 2


class ItlHistogram:
    """Pooled inter-token gaps (s) in log-spaced bins, plus exact sum and count."""

    __slots__ = ("counts", "total", "n")

    def __init__(self) -> None:
        # A plain int array: scalar increments on it are several times cheaper than on
        # a numpy array, and the hot path does one per engine step.
        self.counts = array("q", bytes(8 * _ITL_BINS))
        self.total = 0.0
        self.n = 0

    def add(self, gap: float, weight: int = 1) -> None:
        i = int(math.log((gap if gap > _ITL_LO else _ITL_LO) / _ITL_LO) / _ITL_STEP)
        self.counts[i if i < _ITL_BINS else _ITL_BINS - 1] += weight
        self.total += gap * weight
        self.n += weight

    def add_many(self, gaps, weight: int = 1) -> None:
        """Add every gap in ``gaps`` (a sequence or array), each ``weight`` times."""
        if len(gaps) <= 16:
            for g in gaps:
                self.add(float(g), weight)
            return
        gaps = np.asarray(gaps, dtype=np.float64)
        g = np.maximum(gaps, _ITL_LO)
        idx = np.minimum((np.log(g / _ITL_LO) / _ITL_STEP).astype(np.int64), _ITL_BINS - 1)
        counts = self.counts
        for i in idx.tolist():   # a few to a few hundred: cheaper than np.add.at
            counts[i] += weight
        self.total += float(gaps.sum()) * weight
        self.n += len(gaps) * weight

    def merge(self, other: "ItlHistogram") -> None:
        for i, c in enumerate(other.counts):
            if c:
                self.counts[i] += c
        self.total += other.total
        self.n += other.n

    def quantile(self, q: float) -> float:
        """The q-quantile (0..1) of the pooled gaps; NaN when empty."""
        if self.n == 0:
            return float("nan")
        cum = np.cumsum(np.frombuffer(self.counts, dtype=np.int64))
        i = int(np.searchsorted(cum, q * (self.n - 1) + 1e-9 if q > 0 else 1, side="left"))
        # Geometric middle of the bin.
        return _ITL_LO * math.exp((i + 0.5) * _ITL_STEP)

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else float("nan")


class Recorder:
    """Per-request timestamps and flags for ``n`` requests, plus run-wide tallies."""

    def __init__(self, n: int, n_replicas: int) -> None:
        self.n = n
        for name in TIMESTAMPS:
            setattr(self, name, np.full(n, np.nan))
        self.replica = np.full(n, -1, dtype=np.int32)
        self.new_connection = np.zeros(n, dtype=bool)
        self.rejected = np.zeros(n, dtype=bool)
        self.generated = np.zeros(n, dtype=np.int64)
        # KV memory under pressure, per request (see ``replica_memory``).
        self.cached_tokens = np.zeros(n, dtype=np.int64)     # prefill skipped by prefix hits
        self.preemptions = np.zeros(n, dtype=np.int32)
        self.recomputed_tokens = np.zeros(n, dtype=np.int64)  # KV dropped and prefilled again
        self.swapped_bytes = np.zeros(n, dtype=np.float64)   # copied out to CPU (and back)
        self.preempted_s = np.zeros(n, dtype=np.float64)     # time spent preempted
        self.cancelled = np.zeros(n, dtype=bool)
        self.cancelled_at = np.full(n, np.nan)
        self.itl = ItlHistogram()
        # Time series per replica: time, waiting, running, reserved blocks, KV tokens,
        # and the extra block references prefix sharing saves (0 without caching).
        self.series = [tuple(array("d") for _ in range(6)) for _ in range(n_replicas)]
        self.swap_copy_s = 0.0     # step time spent copying KV to and from CPU
        self.steps = 0
        self.step_time_total = 0.0
