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
    """Pooled inter-token gaps (s) in log-spaced bins, plus their sum and count.

    The hot path appends ``(gap, weight)`` to two flat buffers (an engine step adds
    one or a few); they are binned in numpy every ``FLUSH`` entries and whenever the
    histogram is read, which costs a fraction of binning each gap in Python."""

    __slots__ = ("_counts", "_total", "_n", "_g", "_w")
    FLUSH = 1 << 16

    def __init__(self) -> None:
        self._counts = np.zeros(_ITL_BINS, dtype=np.int64)
        self._total = 0.0
        self._n = 0
        self._g = array("d")
        self._w = array("q")

    def add(self, gap: float, weight: int = 1) -> None:
        self._g.append(gap)
        self._w.append(weight)
        if len(self._g) >= self.FLUSH:
            self._flush()

    def add_many(self, gaps, weight: int = 1) -> None:
        """Add every gap in ``gaps`` (a sequence or array), each ``weight`` times."""
        k = len(gaps)
        self._g.extend(gaps if not isinstance(gaps, np.ndarray) else gaps.tolist())
        self._w.extend([weight] * k)
        if len(self._g) >= self.FLUSH:
            self._flush()

    def _flush(self) -> None:
        if not self._g:
            return
        g = np.frombuffer(self._g, dtype=np.float64)
        w = np.frombuffer(self._w, dtype=np.int64)
        idx = np.minimum((np.log(np.maximum(g, _ITL_LO) / _ITL_LO) / _ITL_STEP).astype(np.int64),
                         _ITL_BINS - 1)
        self._counts += np.bincount(idx, weights=w, minlength=_ITL_BINS).astype(np.int64)
        self._total += float(np.dot(g, w.astype(np.float64)))
        self._n += int(w.sum())
        self._g = array("d")
        self._w = array("q")

    @property
    def counts(self) -> np.ndarray:
        """Gaps per bin."""
        self._flush()
        return self._counts

    @property
    def total(self) -> float:
        """Sum of the gaps (s)."""
        self._flush()
        return self._total

    @property
    def n(self) -> int:
        """Number of gaps."""
        self._flush()
        return self._n

    def merge(self, other: "ItlHistogram") -> None:
        self._flush()
        self._counts += other.counts
        self._total += other.total
        self._n += other.n

    def quantile(self, q: float) -> float:
        """The q-quantile (0..1) of the pooled gaps, as ``np.percentile`` defines it
        (linear between the two order statistics around ``q * (n - 1)``: what ``vllm
        bench serve`` and a recorded run's ITL use), each order statistic read as its
        bin's geometric middle; NaN when empty."""
        if self.n == 0:
            return float("nan")
        cum = np.cumsum(self._counts)
        h = q * (self._n - 1)
        k = math.floor(h)
        frac = h - k
        # Order statistic k (0-based) lies in the first bin holding k + 1 gaps.
        lo = self._bin_middle(int(np.searchsorted(cum, k + 1, side="left")))
        if frac <= 0.0 or k + 1 >= self._n:
            return lo
        hi = self._bin_middle(int(np.searchsorted(cum, k + 2, side="left")))
        return lo + frac * (hi - lo)

    @staticmethod
    def _bin_middle(i: int) -> float:
        """A bin's geometric middle (s)."""
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
        # KV memory under pressure, per request (see ``loops/simpy/memory.py``).
        self.cached_tokens = np.zeros(n, dtype=np.int64)     # prefill skipped by prefix hits
        self.preemptions = np.zeros(n, dtype=np.int32)
        self.recomputed_tokens = np.zeros(n, dtype=np.int64)  # KV dropped and prefilled again
        self.swapped_bytes = np.zeros(n, dtype=np.float64)   # copied out to CPU (and back)
        self.preempted_s = np.zeros(n, dtype=np.float64)     # time spent preempted
        self.cancelled = np.zeros(n, dtype=bool)
        self.cancelled_at = np.full(n, np.nan)
        # Traffic control, per request (``cluster.gateway``; neutral without it): refused
        # by admission control (and why: ``cluster.admission.REASONS``), given up by its
        # client, attempts sent, time from the first send to the last attempt's, and the
        # queue wait the server published for the last attempt (P50, P99; s).
        self.refused = np.zeros(n, dtype=bool)
        self.reject_reason = np.full(n, -1, dtype=np.int8)
        self.timed_out = np.zeros(n, dtype=bool)
        self.failed = np.zeros(n, dtype=bool)     # lost to a replica failure (faults)
        self.attempts = np.ones(n, dtype=np.int32)
        self.timeout_retries = np.zeros(n, dtype=np.int32)   # retries that followed a timeout
        self.retry_s = np.zeros(n, dtype=np.float64)
        self.wait_estimate = np.full(n, np.nan)
        self.wait_estimate_p99 = np.full(n, np.nan)
        self.itl = ItlHistogram()
        # Time series per replica: time, waiting, running, reserved blocks, KV tokens,
        # and the extra block references prefix sharing saves (0 without caching).
        self.series = [tuple(array("d") for _ in range(6)) for _ in range(n_replicas)]
        # Speculative decoding (``track_speculative``): verify steps each request took
        # part in and the tokens they emitted; None when off.
        self.spec_steps = None
        self.spec_tokens = None
        # Disaggregated serving (``cluster.disagg``): the names of per-request arrays set
        # as attributes at the end of the run (``set_disagg``); empty otherwise.
        self.disagg_columns: tuple = ()
        # A CPU tier under the prefix cache (``track_offload``): prompt tokens each request
        # loaded from it and the step time the loads took (s); None when off.
        self.loaded_tokens = None
        self.kv_load_s = None
        self.swap_copy_s = 0.0     # step time spent copying KV to and from CPU
        self.steps = 0
        self.step_time_total = 0.0

    def track_speculative(self) -> None:
        """Record per request the speculative verify steps and their tokens."""
        self.spec_steps = np.zeros(self.n, dtype=np.int64)
        self.spec_tokens = np.zeros(self.n, dtype=np.int64)

    def track_offload(self) -> None:
        """Record per request what it loaded from the CPU tier (``model.kv.offload``)."""
        self.loaded_tokens = np.zeros(self.n, dtype=np.int64)
        self.kv_load_s = np.zeros(self.n, dtype=np.float64)

    def set_disagg(self, columns: dict) -> None:
        """Per-request columns of disaggregated serving (``Disaggregation.columns``), kept
        as arrays on the recorder so a slice of rows slices them too."""
        for name, col in columns.items():
            setattr(self, name, col)
        self.disagg_columns = tuple(columns)
