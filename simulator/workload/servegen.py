"""ServeGen synthesis: a ``kind: servegen`` workload built from ServeGen's per-client descriptions.

ServeGen (Alibaba, arXiv:2505.09999) publishes no request trace; for each client it
gives, per 600 s window, a mean rate and a Gamma or Weibull fit of the
inter-arrival gaps (``chunk-<id>-trace.csv``), and per 6-hour period the pmfs of
input and output token counts (``chunk-<id>-dataset.json``, pmfs stored as Python
dict literals). This module turns them into requests:

- Arrivals: each client in each window with ``rate > 0`` is a stationary renewal
  process whose gaps follow the fitted family and shape, with the scale rescaled
  so the mean gap is ``1 / (rate * rate_scale)``, as ServeGen does. The shape
  fixes the gap CV (Gamma: ``1/sqrt(shape)``). The first arrival of a window is
  drawn from the renewal process's stationary start (a uniform fraction of a
  length-biased gap), so every window's expected count is exactly
  ``rate * 600``. Windows are independent; clients are independent; all are merged
  and sorted.
- Lengths: input and output tokens are drawn independently from the client's pmfs
  of the 6-hour period containing the arrival (a period whose pmf is empty uses
  the client's nearest non-empty period). ``reason_ratio`` is ignored.
- Clients without a ``dataset.json`` (most of them: the data folder keeps only the
  largest few) borrow the pmfs of ``fallback_client``; by default that is the
  client with a dataset.json that sends the most requests in the selected window
  (for language/m-large: client 61 in 44% of the 600 s windows, 143 in 32%, 34 in
  16%, 104 in 8%). ``meta["fallback_client"]`` records the choice.

Times are seconds from ``window[0]`` (the window start is 0, not the first request);
``Workload.client`` is the index of the client in ``meta["client_ids"]``.
"""
from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path
from typing import Literal, Optional

import numpy as np
from pydantic import Field, model_validator

from simulator.config.strict import StrictModel

from simulator.errors import LatsimError, check_memory, read_text
from simulator.config.registry import WORKLOADS
from simulator.workload.base import Workload
from simulator.workload.arrivals import GAMMA_MIN_SHAPE
from simulator.workload.classes import (ClassList, PriorityClass, add_system_prompts,
                                        assign_classes, class_names)

WINDOW_S = 600.0  # ServeGen's arrival windows
MAX_FILE_BYTES = 256 * 2**20   # a client's trace CSV or dataset JSON (the real ones: KBs)
MAX_TOKENS = 10**9
_TRACE_RE = re.compile(r"chunk-(\d+)-trace\.csv$")
# The smallest gap shapes whose draws floating point holds. Weibull gaps are
# scale * (-ln U)^(1/c), rescaled by 1/Gamma(1 + 1/c): below c = 0.02, Gamma(1 + 1/c) and
# Gamma(1 + 2/c) (the gap CV) overflow past c = 2/171, and (-ln U)^(1/c) overflows for the
# largest draws. Gamma gaps are drawn as Y * U^(1/k), which underflows to exactly 0 with
# probability e^(-745 k): 0.06% at k = 0.01, half the gaps at k = 0.001.
MIN_SHAPE = {"Gamma": GAMMA_MIN_SHAPE, "Weibull": 0.02}
SHAPE_WHY = {"Gamma": "its gaps underflow to 0: e^(-745 k) of them",
             "Weibull": "Gamma(1 + 1/shape) overflows"}


class ServeGenWorkload(StrictModel):
    """Requests synthesised from a ServeGen folder; see the module docstring."""

    kind: Literal["servegen"] = "servegen"
    path: str = Field(description="ServeGen folder (chunk-*-trace.csv); relative to the scenario")
    window: tuple[float, float] = Field(description="[start_s, end_s) on ServeGen's clock")
    clients: Optional[list[int]] = Field(None, description="client ids; default: all")
    rate_scale: float = Field(1.0, gt=0, description="multiply every client's rate")
    fallback_client: Optional[int] = Field(None, description="pmfs for clients without a dataset")
    classes: ClassList = Field(default_factory=lambda: [PriorityClass(name="default")])

    @model_validator(mode="after")
    def _check(self):
        if not 0 <= self.window[0] < self.window[1]:
            raise ValueError(f"window must be [start, end) with 0 <= start < end (got {list(self.window)})")
        return self


def client_ids(folder: Path) -> list[int]:
    """Ids of the clients that have a ``chunk-<id>-trace.csv`` in ``folder``."""
    if not folder.is_dir():
        raise LatsimError("ServeGen folder not found", source=str(folder))
    ids = sorted(int(m.group(1)) for p in folder.iterdir() if (m := _TRACE_RE.match(p.name)))
    if not ids:
        raise LatsimError("no chunk-<client>-trace.csv files in this folder", source=str(folder))
    return ids


def read_windows(folder: Path, client: int, first: int, count: int) -> list[tuple]:
    """Rows ``first .. first+count-1`` of a client's trace CSV as (rate, cv, pattern, shape, scale)."""
    path = folder / f"chunk-{client}-trace.csv"
    lines = read_text(path, max_bytes=MAX_FILE_BYTES, what="ServeGen trace").splitlines()
    if first + count > len(lines):
        span = len(lines) * WINDOW_S
        raise LatsimError(f"window ends after the data ({span:g} s of {WINDOW_S:g} s windows)",
                          source=str(path), field="window")
    out = []
    for k in range(first, first + count):
        cells = lines[k].split(",")
        # Rows are windows 0, 600, 1200, ...; row k must start at k * 600.
        try:
            if len(cells) != 6 or float(cells[0]) != k * WINDOW_S:
                raise ValueError
            rate, cv = float(cells[1]), float(cells[2])
            shape = float(cells[4]) if cells[3] else 0.0
            if not (math.isfinite(rate) and math.isfinite(cv) and math.isfinite(shape)
                    and rate >= 0):
                raise ValueError
        except ValueError:
            raise LatsimError(f"expected window_start_s={k * WINDOW_S:g},rate_rps,cv,pattern,shape,"
                              f"scale (got {lines[k]!r})", source=f"{path}:{k + 1}") from None
        if rate > 0 and (cells[3] not in ("Gamma", "Weibull") or not shape > 0):
            raise LatsimError(f"column 'pattern': expected Gamma or Weibull with shape > 0 "
                              f"(got {cells[3]!r}, {cells[4]!r})", source=f"{path}:{k + 1}")
        low = MIN_SHAPE.get(cells[3], 0.0)
        if rate > 0 and shape < low:
            raise LatsimError(f"column 'shape': a {cells[3]} shape below {low:g} cannot be "
                              f"sampled in floating point ({SHAPE_WHY[cells[3]]}; the published "
                              f"fits' smallest: Gamma 0.012, Weibull 0.19) (got {cells[4]!r})",
                              source=f"{path}:{k + 1}")
        try:
            scale = float(cells[5] or 0)
        except ValueError:
            raise LatsimError(f"column 'scale': not a number (got {cells[5]!r})",
                              source=f"{path}:{k + 1}") from None
        out.append((rate, cv, cells[3], shape, scale))
    return out


def implied_cv(pattern: str, shape: float) -> float:
    """Gap CV implied by a fitted family and shape (scale-free)."""
    if pattern == "Gamma":
        return 1.0 / math.sqrt(shape)
    g1, g2 = math.gamma(1 + 1 / shape), math.gamma(1 + 2 / shape)
    return math.sqrt(max(g2 / g1 ** 2 - 1, 0.0))


def _gaps(pattern: str, shape: float, mean: float, n: int, rng: np.random.Generator) -> np.ndarray:
    if pattern == "Gamma":
        return rng.gamma(shape, mean / shape, size=n)
    return rng.weibull(shape, size=n) * (mean / math.gamma(1 + 1 / shape))


def _first_gap(pattern: str, shape: float, mean: float, rng: np.random.Generator) -> float:
    # Stationary start: a uniform fraction of a length-biased gap. Length-biased
    # Gamma(k, s) is Gamma(k+1, s); for Weibull(c, l) it is l * Gamma(1 + 1/c)^(1/c).
    if pattern == "Gamma":
        biased = rng.gamma(shape + 1, mean / shape)
    else:
        biased = (mean / math.gamma(1 + 1 / shape)) * rng.gamma(1 + 1 / shape) ** (1 / shape)
    return rng.uniform() * biased


def window_arrivals(pattern: str, shape: float, rate: float, start: float, length: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Arrival times of one stationary renewal process in ``[start, start + length)``."""
    mean = 1.0 / rate
    t0 = _first_gap(pattern, shape, mean, rng)
    if t0 >= length:
        return np.empty(0)
    parts, t = [np.array([t0])], t0
    while t < length:
        # Enough gaps for the rest of the window most of the time; loop for bursts.
        n = int((length - t) * rate * 1.2) + 16
        a = t + np.cumsum(_gaps(pattern, shape, mean, n, rng))
        parts.append(a)
        t = a[-1]
    arr = np.concatenate(parts)
    return start + arr[arr < length]


class _Pmfs:
    """A client's token pmfs per 6-hour period, parsed on first use."""

    def __init__(self, path: Path) -> None:
        self.path = path
        text = read_text(path, max_bytes=MAX_FILE_BYTES, what="ServeGen dataset")
        try:
            self.raw = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise LatsimError(f"cannot read dataset JSON: {getattr(e, 'msg', 'nested too deeply')}",
                              source=str(path)) from None
        try:
            if not isinstance(self.raw, dict) or not self.raw:
                raise ValueError
            self.starts = np.array(sorted(int(k) for k in self.raw), dtype=float)
        except (ValueError, OverflowError):
            raise LatsimError("expected a JSON object keyed by period start (s)",
                              source=str(path)) from None
        self.cache: dict = {}

    def _parse(self, key: int, column: str):
        if (key, column) not in self.cache:
            try:
                text = self.raw[str(key)][column]
                if not isinstance(text, str) or len(text) > 10**7:
                    raise ValueError
                pmf = ast.literal_eval(text)
                vals = np.array(list(pmf.keys()), dtype=float)
                p = np.array(list(pmf.values()), dtype=float)
                # A pmf: finite token counts within range, finite non-negative weights.
                if (vals.ndim != 1 or p.ndim != 1 or not np.all(np.isfinite(vals))
                        or not np.all(np.isfinite(p)) or (p < 0).any()
                        or (np.abs(vals) > MAX_TOKENS).any()):
                    raise ValueError
            except (KeyError, ValueError, SyntaxError, TypeError, AttributeError,
                    MemoryError, RecursionError):
                raise LatsimError(f"expected a dict-literal pmf string under {column!r} "
                                  f"(token count -> probability)", source=str(self.path),
                                  field=f"{key}.{column}") from None
            # A token count is a whole number of at least 1 (it was clipped to 1 before:
            # a pmf of -100 tokens silently became one of 1-token requests).
            bad = (vals < 1) | (vals != np.floor(vals))
            if bad.any() and (p[bad] > 0).any():
                v = vals[bad & (p > 0)][0]
                raise LatsimError("a token count must be a whole number >= 1",
                                  source=str(self.path), field=f"{key}.{column}",
                                  value=int(v) if float(v).is_integer() else float(v),
                                  has_value=True)
            self.cache[(key, column)] = (vals, p / p.sum()) if len(p) and p.sum() > 0 else None
        return self.cache[(key, column)]

    def sample(self, period: int, column: str, n: int, rng: np.random.Generator) -> np.ndarray:
        # An empty pmf (an idle period) borrows the nearest period that has one.
        for j in sorted(range(len(self.starts)), key=lambda j: (abs(j - period), j)):
            pmf = self._parse(int(self.starts[j]), column)
            if pmf is not None:
                vals, p = pmf
                return vals[rng.choice(len(vals), size=n, p=p)].astype(np.int64)
        raise LatsimError(f"every {column} pmf is empty", source=str(self.path))


def build_servegen(cfg: ServeGenWorkload, rng: np.random.Generator, base_dir: Path) -> Workload:
    """Workload factory: synthesise the window's requests from the ServeGen folder."""
    folder = Path(cfg.path).expanduser()
    folder = folder if folder.is_absolute() else Path(base_dir) / folder
    known = client_ids(folder)
    chosen = known if cfg.clients is None else list(dict.fromkeys(cfg.clients))
    unknown = [c for c in chosen if c not in known]
    if unknown:
        raise LatsimError(f"no chunk-<client>-trace.csv for client(s) {unknown}", source=str(folder),
                          field="clients")
    with_data = [c for c in known if (folder / f"chunk-{c}-dataset.json").exists()]
    if not with_data:
        raise LatsimError("no chunk-<client>-dataset.json for token lengths", source=str(folder))
    start, end = cfg.window
    first = int(start // WINDOW_S)
    count = int(math.ceil(end / WINDOW_S)) - first
    rows = {c: read_windows(folder, c, first, count) for c in dict.fromkeys(chosen + with_data)}
    expected = sum(r[0] * cfg.rate_scale * WINDOW_S for c in chosen for r in rows[c])
    check_memory(expected * 64, f"synthesising ~{expected:,.0f} requests", source=str(folder),
                 field="rate_scale", hint="select fewer clients, a shorter window or a "
                 "lower rate_scale")

    fallback = cfg.fallback_client
    if fallback is None:
        # The dataset client sending the most requests in the window stands in for the rest.
        fallback = max(with_data, key=lambda c: sum(r[0] for r in rows[c]))
    elif fallback not in with_data:
        raise LatsimError(f"client {fallback} has no dataset.json (those with one: {with_data})",
                          source=str(folder), field="fallback_client")
    pmfs = {c: _Pmfs(folder / f"chunk-{c}-dataset.json") for c in dict.fromkeys(
        [c for c in chosen if c in with_data] + [fallback])}

    times, who = [], []
    for i, c in enumerate(chosen):
        for k, (rate, _cv, pattern, shape, _scale) in enumerate(rows[c]):
            if rate <= 0:
                continue
            w0 = (first + k) * WINDOW_S
            a = window_arrivals(pattern, shape, rate * cfg.rate_scale, w0, WINDOW_S, rng)
            a = a[(a >= start) & (a < end)]  # partial first/last windows
            times.append(a)
            who.append(np.full(len(a), i, dtype=np.int64))
    t = np.concatenate(times) if times else np.empty(0)
    client = np.concatenate(who) if who else np.empty(0, dtype=np.int64)
    if len(t) == 0:
        raise LatsimError(f"the chosen clients send no requests in window [{start:g}, {end:g})",
                          source=str(folder), field="window")
    order = np.argsort(t, kind="stable")
    t, client = t[order], client[order]

    prompt = np.empty(len(t), dtype=np.int64)
    output = np.empty(len(t), dtype=np.int64)
    for i, c in enumerate(chosen):
        src = pmfs[c if c in pmfs else fallback]
        idx = np.flatnonzero(client == i)
        periods = np.searchsorted(src.starts, t[idx], side="right") - 1
        for per in np.unique(periods):
            sel = idx[periods == per]
            prompt[sel] = src.sample(max(int(per), 0), "input_tokens", len(sel), rng)
            output[sel] = src.sample(max(int(per), 0), "output_tokens", len(sel), rng)

    meta = {"source": str(folder), "window": [start, end], "client_ids": chosen,
            "fallback_client": fallback, "expected_requests": float(sum(
                r[0] * cfg.rate_scale * (min(end, (first + k + 1) * WINDOW_S) - max(start, (first + k) * WINDOW_S))
                for c in chosen for k, r in enumerate(rows[c])))}
    prio = assign_classes(cfg.classes, len(t), rng)
    prompt, shared = add_system_prompts(cfg.classes, prompt, prio)
    return Workload(arrival_s=t - start, prompt_tokens=prompt, output_tokens=output,
                    priority=prio, class_names=class_names(cfg.classes), client=client,
                    meta=meta, shared_prefix_tokens=shared)


WORKLOADS.register("servegen", ServeGenWorkload, build_servegen)
