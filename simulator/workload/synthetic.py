"""Synthetic workloads: an arrival process, token lengths, and priority classes.

Lengths come either from two independent distributions or, jointly, from a
lengths file (rows of prompt/output token counts, e.g. ShareGPT stats), sampled
with replacement. Priority classes (P0/P1/P2 with shares) are drawn i.i.d. per
request.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import numpy as np
import pandas as pd
from pydantic import Field, model_validator

from simulator.config.strict import StrictModel

from simulator.errors import LatsimError, check_file, check_memory
from simulator.config.registry import ARRIVALS, LENGTHS, WORKLOADS
from simulator.config.pluginfield import plugin
from simulator.workload.arrivals import arrival_times
from simulator.workload.rates import continue_arrivals
from simulator.workload.base import Workload
from simulator.workload.classes import (ClassList, PriorityClass, add_system_prompts,
                                        assign_classes, class_names)
from simulator.workload.lengths import MAX_TOKENS, sample_lengths


# Bytes the arrays of one synthetic request take while it is drawn (arrival, lengths,
# class, and numpy's temporaries): what a size is checked against before drawing.
WORKLOAD_BYTES_PER_REQUEST = 64
MAX_LENGTHS_FILE_MB = 1024


class LengthsFile(StrictModel):
    """A CSV of (prompt, output) token counts sampled jointly, with replacement."""

    path: str
    prompt_column: str = "num_prefill_tokens"
    output_column: str = "num_decode_tokens"
    max_prompt_tokens: Optional[int] = Field(None, ge=1)
    max_output_tokens: Optional[int] = Field(None, ge=1)


MAX_SPAN_S = 1e8      # ~3 years of simulated arrivals


class SyntheticWorkload(StrictModel):
    """Synthetic traffic: ``num_requests`` (or ``duration_s`` of) arrivals."""

    kind: Literal["synthetic"] = "synthetic"
    num_requests: Optional[int] = Field(None, gt=0)
    duration_s: Optional[float] = Field(None, gt=0)
    arrival: plugin(ARRIVALS) = Field(default_factory=lambda: ARRIVALS.validate({"rate": 1.0}))
    prompt_tokens: plugin(LENGTHS) = Field(
        default_factory=lambda: LENGTHS.validate({"kind": "constant", "value": 512}))
    output_tokens: plugin(LENGTHS) = Field(
        default_factory=lambda: LENGTHS.validate({"kind": "constant", "value": 128}))
    lengths_file: Optional[LengthsFile] = None
    classes: ClassList = Field(default_factory=lambda: [PriorityClass(name="default")])

    @model_validator(mode="after")
    def _size(self):
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give num_requests or duration_s")
        # Simulated time is a float of seconds: past ~1e8 s its resolution (tens of ns)
        # starts to eat the microseconds a step's latency is made of.
        span = self.duration_s if self.duration_s is not None else \
            self.num_requests / self.arrival.rate
        if span > MAX_SPAN_S:
            raise ValueError(f"the traffic would span {span:.3g} s (num_requests / rate, or "
                             f"duration_s), over the {MAX_SPAN_S:.0e} s simulated time keeps "
                             "microseconds apart at: raise the rate or shorten it")
        return self

    def expected_requests(self) -> float:
        """How many requests this draws: ``num_requests``, or the mean rate times
        ``duration_s`` (the smaller when both are given)."""
        by_time = (self.arrival.rate * self.duration_s if self.duration_s is not None
                   else float("inf"))
        return float(min(self.num_requests or float("inf"), by_time))


def _load_lengths(lf: LengthsFile, base_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    path = Path(lf.path)
    if not path.is_absolute():
        path = base_dir / path
    check_file(path, max_bytes=MAX_LENGTHS_FILE_MB * 2**20, what="lengths file",
               field="workload.lengths_file.path")
    try:
        df = pd.read_csv(path)
    except Exception as e:  # pandas raises many kinds; the user needs the file and the cause
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise LatsimError(f"cannot read CSV: {msg}", source=str(path)) from None
    for col in (lf.prompt_column, lf.output_column):
        if col not in df.columns:
            raise LatsimError(f"missing column {col!r} (columns: {', '.join(map(str, df.columns))})",
                              source=str(path))
        if not pd.api.types.is_numeric_dtype(df[col]):
            raise LatsimError(f"column {col!r} is not numeric", source=str(path))
    p = df[lf.prompt_column].to_numpy(dtype=float)
    o = df[lf.output_column].to_numpy(dtype=float)
    # Rows with a missing, infinite or absurd count are skipped like those under 1.
    keep = (p >= 1) & (o >= 1) & (p <= MAX_TOKENS) & (o <= MAX_TOKENS)
    if lf.max_prompt_tokens:
        keep &= p <= lf.max_prompt_tokens
    if lf.max_output_tokens:
        keep &= o <= lf.max_output_tokens
    if not keep.any():
        raise LatsimError("no usable rows (token counts >= 1 within the limits)", source=str(path))
    return p[keep].astype(np.int64), o[keep].astype(np.int64)


def build_synthetic(cfg: SyntheticWorkload, rng: np.random.Generator, base_dir: Path) -> Workload:
    """Draw arrivals, lengths and classes from ``rng`` (one stream, fixed order). A size
    the machine's memory cannot hold is refused before anything is drawn."""
    check_memory(cfg.expected_requests() * WORKLOAD_BYTES_PER_REQUEST,
                 f"drawing {cfg.expected_requests():,.0f} requests", field="workload",
                 hint="lower num_requests (or rate x duration_s)")
    if cfg.num_requests is not None:
        arr = arrival_times(cfg.arrival, cfg.num_requests, rng)
        if cfg.duration_s is not None:
            arr = arr[arr <= cfg.duration_s]
    else:
        # Draw in blocks until the horizon is passed; the mean rate sizes the first block.
        rate = cfg.arrival.rate
        parts, t = [], 0.0
        while t <= cfg.duration_s:
            gaps_n = max(16, int(rate * (cfg.duration_s - t) * 1.2) + 16)
            # A time-varying rate (``rates``) continues its own clock from ``t``.
            a = continue_arrivals(cfg.arrival, t, gaps_n, rng)
            parts.append(a)
            t = a[-1]
        arr = np.concatenate(parts)
        arr = arr[arr <= cfg.duration_s]
    n = len(arr)
    if n == 0:
        # Nothing to simulate is not a result (a run of it would report 'no requests
        # completed' and exit 0).
        raise LatsimError(f"no request arrives within it at {cfg.arrival.rate:g} req/s: "
                          "lengthen it or raise the rate", field="workload.duration_s",
                          value=cfg.duration_s, has_value=True)
    if cfg.lengths_file is not None:
        p_all, o_all = _load_lengths(cfg.lengths_file, base_dir)
        idx = rng.integers(0, len(p_all), size=n)
        prompt, output = p_all[idx], o_all[idx]
    else:
        prompt = sample_lengths(cfg.prompt_tokens, n, rng)
        output = sample_lengths(cfg.output_tokens, n, rng)
    prio = assign_classes(cfg.classes, n, rng)
    prompt, shared = add_system_prompts(cfg.classes, prompt, prio)
    return Workload(arrival_s=arr, prompt_tokens=prompt, output_tokens=output, priority=prio,
                    class_names=class_names(cfg.classes), shared_prefix_tokens=shared)


WORKLOADS.register("synthetic", SyntheticWorkload, build_synthetic)
