"""Priority classes (P0/P1/P2 ...) with traffic shares and their own SLOs."""
from __future__ import annotations

from typing import Annotated, Optional

import numpy as np
from pydantic import AfterValidator, Field

from simulator.config.strict import StrictModel

# Priority values run 0..MAX_PRIORITY: each names a class (and a queue in the compiled
# loop), so a stray 10**9 must be an error, not a billion class names.
MAX_PRIORITY = 1023


class SLO(StrictModel):
    """Latency targets a request must meet to count towards goodput (ms)."""

    ttft_ms: Optional[float] = Field(None, gt=0, description="time to first token target")
    tpot_ms: Optional[float] = Field(None, gt=0, description="time per output token target")
    e2el_ms: Optional[float] = Field(None, gt=0, description="end-to-end latency target")


class PriorityClass(StrictModel):
    """One class: its name, its share of requests, its priority (lower = more urgent)."""

    name: str
    share: float = Field(1.0, gt=0, description="relative weight of the class's requests: "
                         "shares are normalised by their sum (0.5 and 1.5: a quarter and "
                         "three quarters)")
    priority: Optional[int] = Field(None, ge=0, le=MAX_PRIORITY,
                                    description="defaults to the list position")
    slo: Optional[SLO] = None
    system_prompt_tokens: int = Field(0, ge=0, le=10**9, description="a system prompt shared by the "
                                      "class, prepended to each of its prompts (prefix caching)")


def _distinct(classes: list[PriorityClass]) -> list[PriorityClass]:
    """A workload's classes name distinct classes: at least one, no name or priority
    twice (two entries of one name, or of one priority, would be merged in every
    per-class result)."""
    if not classes:
        raise ValueError("give at least one class")
    names: dict = {}
    prios: dict = {}
    for i, (c, p) in enumerate(zip(classes, class_priorities(classes))):
        if c.name in names:
            raise ValueError(f"class name {c.name!r} repeats entry {names[c.name]} (entry {i}): "
                             "each class needs its own name")
        if int(p) in prios:
            raise ValueError(f"class {c.name!r} has priority {int(p)}, as {prios[int(p)]!r}: "
                             "each class needs its own priority")
        names[c.name] = i
        prios[int(p)] = c.name
    return classes


# The ``classes`` list every workload kind takes (``_distinct``'s checks).
ClassList = Annotated[list[PriorityClass], AfterValidator(_distinct)]


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
    with np.errstate(over="ignore"):
        total = shares.sum()
    if not np.isfinite(total):   # relative weights of 1e308 each: their sum overflows
        shares = shares / shares.max()
    return prios[rng.choice(len(classes), size=n, p=shares / shares.sum())]


def add_system_prompts(classes: list[PriorityClass], prompt: np.ndarray,
                       prio: np.ndarray) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Prepend each class's shared system prompt: returns the new prompt lengths and
    the shared-prefix length of every request (None when no class has one)."""
    if not any(c.system_prompt_tokens for c in classes):
        return prompt, None
    by_prio = np.zeros(int(class_priorities(classes).max()) + 1, dtype=np.int64)
    for c, p in zip(classes, class_priorities(classes)):
        by_prio[p] = c.system_prompt_tokens
    shared = by_prio[prio] if len(prio) else np.zeros(0, dtype=np.int64)
    return prompt + shared, shared
