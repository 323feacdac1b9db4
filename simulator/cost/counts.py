"""How many step costs a model priced, and how many lay outside what it was measured
or fitted on (the run reports both). The counts live in a two-element array, ``CL``,
because the kernels that price a step count into it themselves: the Python cost models
and the compiled event loop then count by the same code."""
from __future__ import annotations

import numpy as np


class LookupCounts:
    """``lookups`` and ``extrapolations``, kept in ``self.CL`` (``new_counts``)."""

    CL: np.ndarray

    @property
    def lookups(self) -> int:
        return int(self.CL[0])

    @lookups.setter
    def lookups(self, v: int) -> None:
        self.CL[0] = v

    @property
    def extrapolations(self) -> int:
        return int(self.CL[1])

    @extrapolations.setter
    def extrapolations(self, v: int) -> None:
        self.CL[1] = v


def new_counts() -> np.ndarray:
    """A fresh ``CL``: lookups, extrapolations."""
    return np.zeros(2, dtype=np.int64)
