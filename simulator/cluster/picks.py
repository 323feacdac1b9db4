"""The routers' picks, written once for every event loop (``routers`` for the SimPy
model, the compiled loop on its arrays)."""
from __future__ import annotations

from simulator.kernel import kernel


@kernel(inline=True)
def next_in_turn(last, n):
    """Round robin: the replica after ``last`` (``-1`` before the first pick) of ``n``."""
    return (last + 1) % n


@kernel
def first_least(values, n):
    """The index of the smallest of ``values[:n]``, ties to the lowest index (the least
    loaded replica: fewest outstanding tokens)."""
    best = 0
    for i in range(1, n):
        if values[i] < values[best]:
            best = i
    return best
