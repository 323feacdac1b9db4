"""Service-level objectives a plan must meet (``SLOSpec``): parsed from
``[class:]metric<op>bound[ms]`` (``parse_slo``) or taken from the workload classes' own
SLOs (``default_slos``).

``metric`` is a summary column (``p99_ttft_ms``, ``mean_t_queue_ms``,
``request_goodput`` ...), ``class`` a priority class of the workload (case-insensitive);
``op`` is ``<=``, ``<``, ``>=`` or ``>``. ITL is pooled over all requests, so it takes no
class.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from simulator.errors import LatsimError
from simulator.report.metrics import BREAKDOWN, PCTS

_OPS = {"<=": lambda v, b: v <= b, "<": lambda v, b: v < b,
        ">=": lambda v, b: v >= b, ">": lambda v, b: v > b}
_METRICS = ({f"{p}_{m}_ms" for p, _ in PCTS for m in ("ttft", "tpot", "itl", "e2el")}
            | {f"{p}_{b}_ms" for p in ("mean", "p99") for b in BREAKDOWN}
            | {"request_throughput", "output_throughput", "total_token_throughput",
               "request_goodput", "good_requests"})


@dataclass(frozen=True)
class SLOSpec:
    """One service-level objective on a summary column (overall or of one class)."""

    text: str
    cls: Optional[str]
    metric: str
    op: str
    bound: float
    column: str

    @property
    def unit(self) -> str:
        """The unit of the metric's values, as a report prints them."""
        return unit_of(self.metric)

    def ok(self, v: float) -> bool:
        """True when ``v`` meets the objective (NaN never does)."""
        return v == v and _OPS[self.op](v, self.bound)

    def ratio(self, v: float) -> float:
        """How far ``v`` is along the way to the bound: > 1 violates (``<=``-type), inf for NaN."""
        if v != v:
            return math.inf
        if self.op[0] == "<":
            return v / self.bound if self.bound else math.inf
        return self.bound / v if v > 0 else math.inf


def unit_of(metric: str) -> str:
    """``ms`` for a latency, ``req/s`` or ``tok/s`` for a rate, ``requests`` for a count."""
    if metric.endswith("_ms"):
        return "ms"
    if metric in ("request_throughput", "request_goodput"):
        return "req/s"
    if metric.endswith("_throughput"):
        return "tok/s"
    return "requests" if metric == "good_requests" else ""


def class_names_of(scenario) -> list[str]:
    """The workload's priority class names (as the scenario lists them)."""
    return [c.name for c in getattr(scenario.workload, "classes", None) or []]


def parse_slo(text: str, classes: list[str]) -> SLOSpec:
    """``[class:]metric<op>bound[ms]`` -> ``SLOSpec``; one-line errors naming the problem."""
    m = re.fullmatch(r"\s*(?:([^:<>=\s]+)\s*:\s*)?([A-Za-z0-9_]+)\s*(<=|>=|<|>)\s*"
                     r"([-+0-9.eE]+)\s*(?:ms)?\s*", text)
    if not m:
        raise LatsimError("an SLO looks like [class:]metric<=bound, e.g. p0:p99_ttft_ms<=500",
                          source="--slo", value=text, has_value=True)
    cls, metric, op, bound = m.groups()
    if metric not in _METRICS:
        raise LatsimError(f"unknown metric {metric!r}; e.g. p99_ttft_ms, median_tpot_ms, "
                          "mean_t_queue_ms, p99_e2el_ms, request_goodput", source="--slo")
    try:
        b = float(bound)
    except ValueError:
        raise LatsimError("bound is not a number", source="--slo", value=text,
                          has_value=True) from None
    # Every metric is a latency or a rate, never negative: a bound below zero (or an
    # upper bound of zero) no configuration can meet is a typo, not a search.
    if not math.isfinite(b) or b < 0 or (b == 0 and op in ("<", "<=")):
        raise LatsimError("the bound must be a positive number" if op in ("<", "<=") else
                          "the bound must be a number >= 0", source="--slo", value=text,
                          has_value=True)
    if cls is not None:
        found = [c for c in classes if c.lower() == cls.lower()]
        if not found:
            raise LatsimError(f"unknown class {cls!r}; the workload's classes: "
                              f"{', '.join(classes) or '(none)'}", source="--slo")
        cls = found[0]
        if metric.endswith("_itl_ms"):
            raise LatsimError("ITL is pooled over all requests: give it without a class",
                              source="--slo", value=text, has_value=True)
    column = f"{cls}:{metric}" if cls is not None and len(classes) > 1 else metric
    return SLOSpec(text.strip(), cls, metric, op, b, column)


def default_slos(scenario) -> list[SLOSpec]:
    """P99 TTFT/TPOT/E2EL bounds from the workload classes' own SLOs (when no --slo)."""
    classes = class_names_of(scenario)
    out = []
    for c in getattr(scenario.workload, "classes", None) or []:
        slo = c.slo or scenario.slo
        for m in ("ttft", "tpot", "e2el"):
            b = getattr(slo, f"{m}_ms", None)
            if b is not None:
                out.append(parse_slo(f"{c.name}:p99_{m}_ms<={b:g}", classes))
    return out
