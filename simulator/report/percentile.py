"""One definition of a latency percentile, as ``vllm bench serve`` reports it:
``np.percentile`` (linear between the two order statistics around ``q (n - 1)``) of
the values in seconds, in milliseconds. Every summary, comparison and controller
that reports a P50/P99 calls ``pct_ms``, so the simulated side and the real side of a
validation read the same statistic (the pooled ITL histogram interpolates the same
way, ``recorder.ItlHistogram.quantile``)."""
from __future__ import annotations

import math

import numpy as np


def pct_ms(x, q: float, empty=math.nan):
    """The ``q``-th percentile (0-100) of ``x`` (seconds) in ms; ``empty`` when ``x``
    holds no value."""
    x = np.asarray(x, dtype=float)
    if not x.size:
        return empty
    return float(np.percentile(x, q)) * 1000.0
