"""A step's prefill chunks packed into the arrays the step-cost kernels read.

Every cost model prices a step from ``(n_decode, ctx_max, ctx_sum)`` and its chunks;
the kernels (``table.step_ms``, ``physics.step_ms``) take the chunks as three arrays
and a count. ``ChunkArrays`` keeps those arrays between calls (a step holds a handful of
chunks; allocating per step would cost more than the lookup) and packs a step into them.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class ChunkArrays:
    """Reusable chunk arrays: ``n`` (tokens of each chunk), ``p`` (its prompt's tokens
    before it) and ``f`` (whether it completes its prompt), grown as needed."""

    def __init__(self, size: int = 8):
        self.n = np.zeros(size, dtype=np.int64)
        self.p = np.zeros(size, dtype=np.int64)
        self.f = np.zeros(size, dtype=np.bool_)

    def pack(self, chunks: Sequence[tuple]) -> int:
        """Write ``chunks`` (each ``(n, prior)`` or ``(n, prior, completes_prompt)``; one
        given without the flag completes its prompt, as a profile's prefill rows do) into
        the arrays; returns how many there are."""
        k = len(chunks)
        if k > len(self.n):
            self.__init__(2 * k)
        n, p, f = self.n, self.p, self.f
        for i, c in enumerate(chunks):
            n[i] = c[0]
            p[i] = c[1]
            f[i] = bool(c[2]) if len(c) > 2 else True
        return k
