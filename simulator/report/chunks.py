"""A run's per-request table in chunks of rows: ``requests_table`` of each slice of the
run's per-request arrays, so that neither a summary nor a result file ever needs the
whole table of a run of millions of requests at once."""
from __future__ import annotations

import numpy as np

from simulator.report.metrics import requests_table

CHUNK_ROWS = 100_000         # rows formatted (or converted to Arrow) at a time


class _RowSlice:
    """Rows ``[a, b)`` of an object whose per-request arrays have ``n`` rows: each such
    array attribute reads as its slice (``n`` reads as ``b - a``), the rest as is."""

    def __init__(self, obj, a: int, b: int, n: int) -> None:
        self._obj, self._a, self._b, self._n = obj, a, b, n

    def __getattr__(self, name: str):
        if name == "n":
            return self._b - self._a
        v = getattr(self._obj, name)
        if isinstance(v, np.ndarray) and v.ndim >= 1 and len(v) == self._n:
            return v[self._a:self._b]
        return v


class _ResultsSlice:
    """A run's ``Results`` restricted to rows ``[a, b)``, for ``requests_table``."""

    def __init__(self, res, a: int, b: int) -> None:
        n = len(res.workload)
        self._res = res
        self.rec = _RowSlice(res.rec, a, b, n)
        self.workload = _RowSlice(res.workload, a, b, n)

    def __getattr__(self, name: str):
        return getattr(self._res, name)


def requests_chunks(res, rows: int = CHUNK_ROWS):
    """``requests_table(res)`` as consecutive frames of at most ``rows`` rows."""
    n = len(res.workload)
    for a in range(0, max(n, 1), rows):
        b = min(a + rows, n)
        df = requests_table(_ResultsSlice(res, a, b))
        df["rid"] += a
        yield df
