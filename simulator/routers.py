"""Routers: which replica a request goes to when it reaches the serving region.

- ``round_robin``: replicas in turn.
- ``random``: uniformly at random (seeded).
- ``least_outstanding``: the replica with the fewest outstanding tokens (prompt
  tokens not yet prefilled plus output tokens not yet generated), ties to the
  lowest index.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from .registry import ROUTERS


class RouterName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["round_robin", "random", "least_outstanding"]


class RoundRobin:
    """Replicas in turn."""

    def __init__(self, n: int, rng) -> None:
        self.n, self.i = n, -1

    def pick(self, replicas, seq) -> int:
        self.i = (self.i + 1) % self.n
        return self.i


class RandomRouter:
    """A uniformly random replica."""

    def __init__(self, n: int, rng) -> None:
        self.n, self.rng = n, rng

    def pick(self, replicas, seq) -> int:
        return int(self.rng.integers(self.n))


class LeastOutstanding:
    """The replica with the fewest outstanding tokens."""

    def __init__(self, n: int, rng) -> None:
        self.n = n

    def pick(self, replicas, seq) -> int:
        best, best_v = 0, None
        for i, r in enumerate(replicas):
            v = r.outstanding_tokens
            if best_v is None or v < best_v:
                best, best_v = i, v
        return best


for _name, _cls in (("round_robin", RoundRobin), ("random", RandomRouter),
                    ("least_outstanding", LeastOutstanding)):
    ROUTERS.register(_name, RouterName, (lambda c: (lambda cfg, n, rng: c(n, rng)))(_cls))


def make_router(name: str, n: int, rng):
    """Router by registered name."""
    return ROUTERS.build(RouterName(kind=name), n, rng)
