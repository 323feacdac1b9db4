"""What a policy's own order key sees of a waiting request: ``Waiting`` (read-only).

A plug-in policy orders the waiting queue with a plain Python method

    def order_key(self, req: Waiting) -> float      # lower first

(see ``policy``'s module doc for the contract). ``Waiting`` carries the request's class
(index, name and, in a simulation, the class's SLO), when it reached the queue, its
prompt and output lengths and its progress, so that shortest-prompt-first,
last-in-first-out or an SLO-deadline order can be written in a line.
``ClassInfo`` is one priority class as the queue knows it; ``class_table`` builds them
from a scenario (the real engine, which sees only a request's priority, has none).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["ClassInfo", "Waiting", "class_table"]


@dataclass(frozen=True)
class ClassInfo:
    """One priority class: its name and SLO targets in seconds (None: not set)."""

    name: Optional[str] = None
    slo_ttft_s: Optional[float] = None
    slo_tpot_s: Optional[float] = None
    slo_e2el_s: Optional[float] = None


_NO_CLASS = ClassInfo()


class Waiting:
    """One waiting request as an order key sees it (read-only).

    - ``rid``: the request's id; ``priority``: its class index (0 = P0, the most urgent);
      ``class_name``, ``slo_ttft_s``, ``slo_tpot_s``, ``slo_e2el_s``: its class's name and
      SLO targets in seconds (the class's own, else the scenario's ``slo``; None where
      not known, e.g. in the real engine);
    - ``enqueued``: when it reached this replica's queue (s, the executor's clock);
    - ``prompt_tokens``, ``output_tokens``: its lengths; ``remaining_prefill``: tokens
      still to prefill (after a preemption by recompute, its prompt plus what it had
      generated); ``generated``: output tokens made before it was preempted (0 for a
      request that never ran); ``progress``: ``generated / output_tokens``;
    - ``now``: the decision's time, and ``waited`` = ``now - enqueued``: only for a
      policy with ``time_dependent = True``. Any other policy's keys are computed once,
      when a request joins the queue, and these read NaN there, so a key that reads
      them without declaring it fails with a message saying so.
    - ``ttft_deadline``: ``enqueued + slo_ttft_s`` (None without a TTFT target).
    """

    __slots__ = ("rid", "priority", "class_name", "slo_ttft_s", "slo_tpot_s", "slo_e2el_s",
                 "enqueued", "now", "prompt_tokens", "output_tokens", "remaining_prefill",
                 "generated")

    def __init__(self, seq, now: float, cls: ClassInfo = _NO_CLASS) -> None:
        set_ = object.__setattr__
        set_(self, "rid", int(seq.rid))
        set_(self, "priority", int(seq.priority))
        set_(self, "class_name", cls.name)
        set_(self, "slo_ttft_s", cls.slo_ttft_s)
        set_(self, "slo_tpot_s", cls.slo_tpot_s)
        set_(self, "slo_e2el_s", cls.slo_e2el_s)
        set_(self, "enqueued", float(seq.enqueued))
        set_(self, "now", float(now))
        set_(self, "prompt_tokens", int(seq.prompt_tokens))
        set_(self, "output_tokens", int(seq.output_tokens))
        set_(self, "remaining_prefill", int(seq.remaining_prefill))
        set_(self, "generated", int(seq.generated))

    def __setattr__(self, name, value):
        raise AttributeError("a waiting request's view is read-only")

    @property
    def waited(self) -> float:
        return self.now - self.enqueued

    @property
    def progress(self) -> float:
        return self.generated / self.output_tokens if self.output_tokens else 0.0

    @property
    def ttft_deadline(self) -> Optional[float]:
        return None if self.slo_ttft_s is None else self.enqueued + self.slo_ttft_s

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"Waiting(rid={self.rid}, priority={self.priority}, enqueued={self.enqueued}, "
                f"prompt={self.prompt_tokens}, output={self.output_tokens})")


def class_info(classes: dict, priority: int) -> ClassInfo:
    """The class of ``priority`` in a ``class_table`` (an empty one if it is not there)."""
    return classes.get(int(priority), _NO_CLASS) if classes else _NO_CLASS


def class_table(scenario) -> dict[int, ClassInfo]:
    """Each priority class of a scenario's workload (by priority index): its name and
    SLO (the class's own, else the scenario's ``slo``, in seconds). Empty for a
    workload without classes."""
    from simulator.workload.classes import class_priorities
    classes = getattr(scenario.workload, "classes", None) or []
    if not classes:
        return {}
    default = getattr(scenario, "slo", None)

    def s(slo, field) -> Optional[float]:
        v = getattr(slo, field, None) if slo is not None else None
        return None if v is None or not math.isfinite(v) else float(v) / 1e3

    out = {}
    for c, p in zip(classes, class_priorities(classes)):
        slo = c.slo or default
        out[int(p)] = ClassInfo(c.name, s(slo, "ttft_ms"), s(slo, "tpot_ms"), s(slo, "e2el_ms"))
    return out
