"""Trace replay: a ``kind: trace`` workload that replays a real request trace.

The trace's arrival times and token counts are replayed as recorded, optionally:
token counts clipped (or rows dropped) above ``max_prompt_tokens`` /
``max_output_tokens``; a ``window`` of the trace's own clock selected; the first
``limit`` requests kept; tied timestamps spread (``spread_ties_s``, for
Mooncake's 3-second buckets); and time compressed by ``speedup`` (or
``rate_scale``, the same thing) or rescaled to a target mean ``rate``. Rescaling
multiplies every time by one factor, so the burst structure (IAT CV, dispersion)
is kept. Arrivals start at 0 at the first kept request.

Priority classes come from the trace's ``priority`` column when it has one (canonical
CSV), else are drawn i.i.d. by share from ``classes`` with the scenario's rng.

``summarize_workload`` computes the statistics the data README tabulates
(rate, IAT CV, dispersion of counts per bin, token percentiles, prefix reuse).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Optional

import numpy as np
from pydantic import Field, model_validator

from simulator.config.strict import StrictModel

from simulator.errors import LatsimError
from simulator.config.registry import WORKLOADS
from simulator.workload.base import Workload
from simulator.workload.classes import (ClassList, PriorityClass, add_system_prompts,
                                        assign_classes, class_names, class_priorities)
from simulator.workload.classes import MAX_PRIORITY
from simulator.workload.synthetic import MAX_SPAN_S
from simulator.workload.tracereaders import (HASH_BLOCK_TOKENS, MAX_TRACE_MB, RawTrace, cell_error,
                                             ordered, read_trace)


class TraceWorkload(StrictModel):
    """Replay of a trace file; see the module docstring."""

    kind: Literal["trace"] = "trace"
    path: str = Field(description="trace file; relative to the scenario file's folder")
    format: Optional[Literal["azure", "mooncake", "vidur", "csv"]] = Field(
        None, description="default: from the extension (.jsonl) or the CSV header")
    speedup: Optional[float] = Field(None, gt=0, description="divide every time by this")
    rate_scale: Optional[float] = Field(None, gt=0, description="multiply the rate (= speedup)")
    rate: Optional[float] = Field(None, gt=0, description="rescale to this mean rate, req/s")
    window: Optional[tuple[float, float]] = Field(
        None, description="[start_s, end_s) on the trace's own clock, before rescaling")
    limit: Optional[int] = Field(None, gt=0, description="keep the first N requests")
    sort: bool = Field(False, description="sort out-of-order timestamps (with a warning)")
    spread_ties_s: Optional[float] = Field(
        None, gt=0, description="spread requests sharing a timestamp over this many seconds")
    classes: ClassList = Field(default_factory=lambda: [PriorityClass(name="default")])
    max_prompt_tokens: Optional[int] = Field(None, ge=1)
    max_output_tokens: Optional[int] = Field(None, ge=1)
    over_limit: Literal["clip", "drop"] = Field(
        "clip", description="requests above max_*_tokens: clip their counts, or drop them")
    hash_block_tokens: int = Field(HASH_BLOCK_TOKENS, ge=1, description="prompt tokens per hash id")
    max_file_mb: float = Field(MAX_TRACE_MB, gt=0, description="refuse a trace file larger "
                               "than this (MiB) before reading it")

    @model_validator(mode="after")
    def _check(self):
        if self.window is not None and not self.window[0] < self.window[1]:
            raise ValueError(f"window start must be below its end (got {list(self.window)})")
        given = [k for k in ("speedup", "rate_scale", "rate") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of speedup, rate_scale, rate (got {', '.join(given)})")
        return self


def _resolve(path: str, base_dir: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


def _priorities(raw: RawTrace, classes: list[PriorityClass], explicit: bool):
    """Priority values and class names from the trace's priority column."""
    cells = raw.priority
    # At most 4 digits: a priority beyond MAX_PRIORITY is refused below, never cast.
    ints = np.array([re.fullmatch(r"[+-]?\d{1,4}", c) is not None for c in cells])
    by_name = {c.name: int(p) for c, p in zip(classes, class_priorities(classes))} if explicit else {}
    prio = np.empty(len(cells), dtype=np.int64)
    if ints.any():
        prio[ints] = cells[ints].astype(np.int64)
    for i in np.flatnonzero(~ints):
        name = cells[i]
        if name in by_name:
            prio[i] = by_name[name]
        elif (m := re.fullmatch(r"(?:P|prio)(\d{1,4})", name)):
            prio[i] = int(m.group(1))  # "P1" / "prio1" mean priority 1 without a classes list
        else:
            known = f"; known classes: {', '.join(by_name)}" if by_name else \
                "; list the class names under workload.classes"
            raise cell_error(raw.path, int(raw.lines[i]), "priority",
                             f"unknown class {name!r}{known}")
    if (prio < 0).any():
        i = int(np.argmax(prio < 0))
        raise cell_error(raw.path, int(raw.lines[i]), "priority", f"must be >= 0 (got {cells[i]!r})")
    if (prio > MAX_PRIORITY).any():
        i = int(np.argmax(prio > MAX_PRIORITY))
        raise cell_error(raw.path, int(raw.lines[i]), "priority",
                         f"must be <= {MAX_PRIORITY} (got {cells[i]!r})")
    names = list(class_names(classes)) if explicit else []
    for p in range(len(names), int(prio.max()) + 1):
        names.append(f"P{p}")
    return prio, tuple(names)


def _apply_limits(raw: RawTrace, cfg: TraceWorkload) -> RawTrace:
    mp, mo = cfg.max_prompt_tokens, cfg.max_output_tokens
    if mp is None and mo is None:
        return raw
    over_p = raw.prompt > mp if mp else np.zeros(len(raw.prompt), bool)
    over_o = raw.output > mo if mo else np.zeros(len(raw.output), bool)
    if cfg.over_limit == "drop":
        return raw.take(~(over_p | over_o))
    raw = raw.take(np.arange(len(raw.prompt)))  # a copy, so the clipping below is local
    if mp:
        raw.prompt = np.minimum(raw.prompt, mp)
        if raw.hash_ids is not None:
            # A clipped prompt keeps its leading blocks, so its prefix hashes stay valid.
            keep = -(-mp // cfg.hash_block_tokens)
            raw.hash_ids = [h[:keep] if o else h for h, o in zip(raw.hash_ids, over_p)]
    if mo:
        raw.output = np.minimum(raw.output, mo)
    return raw


def _spread_ties(t: np.ndarray, spread: float, rng: np.random.Generator) -> np.ndarray:
    """Requests sharing a timestamp spread over ``spread`` s, keeping their order."""
    _, start, counts = np.unique(t, return_index=True, return_counts=True)
    k = np.repeat(counts, counts)
    rank = np.arange(len(t)) - np.repeat(start, counts)
    # Slot j of k gets a uniform point inside [j/k, (j+1)/k): order within a tie is kept.
    return t + spread * (rank + rng.uniform(size=len(t))) / k


def replay(raw: RawTrace, cfg: TraceWorkload, rng: np.random.Generator) -> Workload:
    """Turn a trace's rows into a ``Workload`` as ``cfg`` asks (see module docstring)."""
    raw = ordered(raw, cfg.sort)
    explicit = "classes" in cfg.model_fields_set
    prio_names = _priorities(raw, cfg.classes, explicit) if raw.priority is not None else None
    if prio_names is not None:
        raw.priority = prio_names[0]  # resolved ints now travel with the rows
    raw = _apply_limits(raw, cfg)
    if len(raw.time_s) == 0:
        raise LatsimError("no requests left under max_prompt_tokens/max_output_tokens with "
                          "over_limit: drop", source=str(raw.path))
    if cfg.window is not None:
        a, b = cfg.window
        first, last = raw.time_s[0], raw.time_s[-1]
        raw = raw.take((raw.time_s >= a) & (raw.time_s < b))
        if len(raw.time_s) == 0:
            raise LatsimError(f"window [{a:g}, {b:g}) selects no requests (the trace spans "
                              f"{first:g} to {last:g} s)", source=str(raw.path), field="window")
    if cfg.limit is not None:
        raw = raw.take(np.arange(min(cfg.limit, len(raw.time_s))))
    t = raw.time_s - raw.time_s[0]
    if cfg.spread_ties_s:
        t = _spread_ties(t, cfg.spread_ties_s, rng)
    factor = 1.0  # new time = old time * factor
    if cfg.speedup or cfg.rate_scale:
        factor = 1.0 / (cfg.speedup or cfg.rate_scale)
    elif cfg.rate:
        span = t[-1] - t[0]
        if span <= 0:
            raise LatsimError("cannot rescale to a rate: the selected requests all arrive at "
                              "once", source=str(raw.path), field="rate")
        # Mean rate is n / span (as summarize_workload); one factor for every time.
        factor = len(t) / span / cfg.rate
    t = t * factor
    if t[-1] > MAX_SPAN_S:
        raise LatsimError(f"the replayed trace would span {t[-1]:.3g} s, over the "
                          f"{MAX_SPAN_S:.0e} s simulated time keeps microseconds apart at",
                          source=str(raw.path),
                          field="rate" if cfg.rate else "speedup" if factor != 1.0 else None)
    if prio_names is not None:
        prio, names = raw.priority, prio_names[1]
    else:
        prio, names = assign_classes(cfg.classes, len(t), rng), class_names(cfg.classes)
    meta = {"source": str(raw.path), "format": raw.fmt, "time_factor": factor,
            "first_line": int(raw.lines[0]), "last_line": int(raw.lines[-1]),
            "hash_block_tokens": cfg.hash_block_tokens}
    prompt, shared = add_system_prompts(cfg.classes, raw.prompt, prio)
    if shared is not None and raw.hash_ids is not None:
        raise LatsimError("system_prompt_tokens cannot be added to a trace that has its own "
                          "prefix hashes", source=str(raw.path), field="classes")
    return Workload(arrival_s=t, prompt_tokens=prompt, output_tokens=raw.output,
                    priority=prio, class_names=names, hash_ids=raw.hash_ids, meta=meta,
                    shared_prefix_tokens=shared)


def build_trace(cfg: TraceWorkload, rng: np.random.Generator, base_dir: Path) -> Workload:
    """Workload factory: read ``cfg.path`` (relative to ``base_dir``) and replay it."""
    path = _resolve(cfg.path, base_dir)
    raw = read_trace(path, cfg.format, cfg.hash_block_tokens,
                     max_bytes=int(cfg.max_file_mb * 2**20))
    return replay(raw, cfg, rng)


def _count_stats(t: np.ndarray, width: float) -> tuple[float, float]:
    """Index of dispersion and peak/mean of arrival counts in ``width``-second bins.

    Bins start at the first arrival; the last, partial bin counts (as the data README).
    """
    rel = t - t[0]
    nbins = int(rel[-1] // width) + 1
    counts = np.bincount((rel // width).astype(np.int64), minlength=nbins)
    mean = counts.mean()
    return float(counts.var() / mean), float(counts.max() / mean)


def summarize_workload(wl: Workload) -> dict:
    """Statistics of a workload: count, span, mean rate (n / span), IAT CV, dispersion and
    peak/mean of counts per 1 s and 60 s, token mean/P50/P90/P99/max, and, when hash ids
    are present, the blocks and the share reused (hash seen before: an infinite cache)."""
    t = np.asarray(wl.arrival_s, dtype=float)
    n = len(t)
    out: dict = {"requests": n}
    span = float(t[-1] - t[0]) if n else 0.0
    out["span_s"] = span
    out["mean_rate"] = n / span if span > 0 else float("nan")
    gaps = np.diff(t)
    out["iat_cv"] = float(gaps.std() / gaps.mean()) if n > 2 and gaps.mean() > 0 else float("nan")
    for w in (1, 60):
        d, pm = _count_stats(t, w) if span > 0 else (float("nan"), float("nan"))
        out[f"disp_{w}s"], out[f"peak_mean_{w}s"] = d, pm
    for name, col in (("prompt", wl.prompt_tokens), ("output", wl.output_tokens)):
        if n:
            p50, p90, p99 = np.percentile(col, [50, 90, 99])
            out.update({f"{name}_mean": float(col.mean()), f"{name}_p50": float(p50),
                        f"{name}_p90": float(p90), f"{name}_p99": float(p99),
                        f"{name}_max": int(col.max())})
    if wl.hash_ids is not None and n:
        allh = np.concatenate([np.asarray(h, dtype=np.int64) for h in wl.hash_ids])
        # A block is reused if its id appeared earlier: total minus first occurrences.
        out["blocks"] = int(len(allh))
        out["block_reuse"] = float(1 - len(np.unique(allh)) / len(allh)) if len(allh) else 0.0
    return out


WORKLOADS.register("trace", TraceWorkload, build_trace)
