"""Priority classes (P0/P1/P2 ...) with traffic shares and their own SLOs."""
from __future__ import annotations

from typing import Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class SLO(BaseModel):
    """Latency targets a request must meet to count towards goodput (ms)."""

    model_config = ConfigDict(extra="forbid")
    ttft_ms: Optional[float] = Field(None, gt=0)
    tpot_ms: Optional[float] = Field(None, gt=0)
    e2el_ms: Optional[float] = Field(None, gt=0)


class PriorityClass(BaseModel):
    """One class: its name, its share of requests, its priority (lower = more urgent)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    share: float = Field(1.0, gt=0)
    priority: Optional[int] = Field(None, ge=0, description="defaults to the list position")
    slo: Optional[SLO] = None


def class_priorities(classes: list[PriorityClass]) -> np.ndarray:
    return np.array([c.priority if c.priority is not None else i for i, c in enumerate(classes)],
                    dtype=np.int64)


def class_names(classes: list[PriorityClass]) -> tuple[str, ...]:
    """Name of each priority value (index = priority)."""
    prios = class_priorities(classes)
    names = [f"prio{p}" for p in range(int(prios.max()) + 1)]
    for c, p in zip(classes, prios):
        names[p] = c.name
    return tuple(names)


def assign_classes(classes: list[PriorityClass], n: int, rng: np.random.Generator) -> np.ndarray:
    """Priority of each of ``n`` requests, drawn with the classes' shares."""
    prios = class_priorities(classes)
    if len(classes) == 1:
        return np.full(n, prios[0], dtype=np.int64)
    shares = np.array([c.share for c in classes], dtype=float)
    return prios[rng.choice(len(classes), size=n, p=shares / shares.sum())]
