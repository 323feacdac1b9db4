"""Reading a results folder back (``latsim report``): its tables and ``summary.json``,
checked as what latsim writes, so that a file that is not what it claims (a pipe, a
looping link, a folder, binary bytes, JSON of the wrong shape) or a cell no run can
produce (a latency of 1e300 s, a negative one) is a one-line ``LatsimError`` naming the
file, the column or field, the row and the value, never a hang, a crash or a plot
whose axis silently spans 10^300.

The bounds are what a simulated run can hold: every time and latency is in seconds on
the run's clock, and no run spans more than ``MAX_TIME_S`` (the limit a trace's own
times are held to: a time beyond it is a broken cell); a latency (TTFT, TPOT, E2E, a
stage of the breakdown) is never negative; a time series counts blocks, tokens and
requests (int64 counters, so below 2^63) and shares of the cache (non-negative).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from simulator.errors import LatsimError, read_csv, read_json
from simulator.workload.tracereaders import MAX_TIME_S

MAX_TABLE_BYTES = 4 * 2**30     # a per-request or sweep table a plot can still read
MAX_SUMMARY_BYTES = 64 * 2**20  # summary.json is KBs; this only stops a wrong file
COUNT_LIMIT = 2.0**63           # a time-series counter is an int64

# Columns of a per-request table: times on the run's clock (s) and the latencies
# derived from them (s, never negative).
TIMES = ("arrival", "enqueued", "scheduled", "first_token", "last_token",
         "first_delivered", "last_delivered")
LATENCIES = ("t_net", "t_queue", "t_prefill", "t_decode", "t_stream", "ttft", "tpot",
             "e2el")
# A time series' plotted columns: counts of requests, blocks and tokens, and shares.
SERIES = ("waiting", "running", "kv_blocks_reserved", "kv_tokens", "kv_blocks_shared",
          "kv_reserved_frac", "kv_utilization")
_TIME = "a time in seconds on the run's clock"
_LATENCY = "a latency in seconds"
_LATENCY_MS = "a latency in ms"
# summary.json sections (per policy): each an object when present.
SUMMARY_SECTIONS = ("overall", "per_class", "run", "kv", "cluster")


def read_table(path, what: str = "table") -> pd.DataFrame:
    """A CSV a results folder holds (``errors.read_csv``'s checks: a regular UTF-8 text
    file, not a pipe, a loop of links or a folder)."""
    return read_csv(path, max_bytes=MAX_TABLE_BYTES, what=what)


def _bad_cell(path, df: pd.DataFrame, col: str, mask: np.ndarray, why: str) -> LatsimError:
    i = int(np.flatnonzero(mask)[0])
    more = int(mask.sum()) - 1
    v = df[col].iloc[i]
    return LatsimError(why + (f" ({more:,} more rows like it)" if more else ""),
                       source=str(path), field=f"{col} (row {i + 1})",
                       value=v.item() if isinstance(v, np.generic) else v, has_value=True)


def check_column(path, df: pd.DataFrame, col: str, *, lo: float | None = None,
                 hi: float | None = None, empty: bool = True, what: str = "",
                 integer: bool = False) -> np.ndarray:
    """Column ``col`` of ``df`` (read from ``path``) as floats: every cell a number
    (text, inf and, unless ``empty``, an empty cell are errors) within ``[lo, hi]``;
    the first bad cell is a one-line ``LatsimError`` naming file, column, row and
    value. Returns the numbers (NaN for empty cells)."""
    raw = df[col]
    v = pd.to_numeric(raw, errors="coerce").to_numpy(float)
    nan = np.isnan(v)
    text = nan & raw.notna().to_numpy()
    if text.any():
        raise _bad_cell(path, df, col, text, "not a number")
    if not empty and nan.any():
        raise _bad_cell(path, df, col, nan, "empty")
    if np.isinf(v).any():
        raise _bad_cell(path, df, col, np.isinf(v), "must be finite (latsim writes an "
                        "empty cell for what a run did not reach)")
    if integer and (v != np.floor(v))[~nan].any():
        raise _bad_cell(path, df, col, ~nan & (v != np.floor(v)), "must be a whole number")
    with np.errstate(invalid="ignore"):
        out = ((v < lo) if lo is not None else False) | ((v > hi) if hi is not None else False)
    if np.any(out):
        rng = (f"in [{lo:g}, {hi:g}]" if lo is not None and hi is not None else
               f">= {lo:g}" if lo is not None else f"<= {hi:g}")
        why = ("; no run spans more than 1e11 s" if hi is not None and np.nanmax(v) > hi
               and what in (_TIME, _LATENCY, _LATENCY_MS) else "")
        raise _bad_cell(path, df, col, np.asarray(out),
                        f"must be {what or 'a number'} {rng}{why}")
    return v


def check_requests(path, df: pd.DataFrame) -> pd.DataFrame:
    """A per-request table's times and latencies as numbers a run can hold (module
    doc): times within ``MAX_TIME_S`` of the run's start in magnitude, latencies in
    ``[0, MAX_TIME_S]``; empty cells (what a request did not reach) stay NaN."""
    for c in TIMES:
        if c in df.columns:
            df[c] = check_column(path, df, c, lo=-MAX_TIME_S, hi=MAX_TIME_S, what=_TIME)
    for c in LATENCIES:
        if c in df.columns:
            df[c] = check_column(path, df, c, lo=0.0, hi=MAX_TIME_S, what=_LATENCY)
    return df


def check_timeseries(path, df: pd.DataFrame) -> pd.DataFrame:
    """A time series (``timeseries.csv``): ``time`` a time a run can hold, in every row;
    the plotted counts and shares (``SERIES``) empty or non-negative and below 2^63."""
    if "time" in df.columns:
        df["time"] = check_column(path, df, "time", lo=-MAX_TIME_S, hi=MAX_TIME_S,
                                  empty=False, what=_TIME)
    if "replica" in df.columns:   # a replica's index, or -1: the cluster's own rows
        df["replica"] = check_column(path, df, "replica", lo=-1, hi=COUNT_LIMIT, empty=False,
                                     integer=True, what="a replica index").astype(np.int64)
    for c in SERIES:
        if c in df.columns:
            df[c] = check_column(path, df, c, lo=0.0, hi=COUNT_LIMIT,
                                 what="a count or share (an int64 counter)")
    return df


def check_sweep(path, df: pd.DataFrame, x: str, metrics) -> None:
    """A sweep table's plotted columns: the load ``x`` a finite number, each latency
    metric (ms) empty or in ``[0, MAX_TIME_S]`` seconds."""
    check_column(path, df, x, empty=False)
    for c in metrics:
        if c in df.columns:
            check_column(path, df, c, lo=0.0, hi=MAX_TIME_S * 1e3,
                         what=_LATENCY_MS)


def read_summary(path) -> dict:
    """``summary.json`` as ``latsim run --out`` writes it: an object, either one run's
    (``policy`` a string, its sections objects) or one per policy (each an object of
    that shape). A section of another JSON type is an error naming it."""
    data = read_json(path, max_bytes=MAX_SUMMARY_BYTES, what="run summary")
    runs = [("", data)] if ("policy" in data or "overall" in data) else [
        (f"{k}.", v) for k, v in data.items()]
    for prefix, run in runs:
        if not isinstance(run, dict):
            raise LatsimError("must be a JSON object (one policy's summary)", source=str(path),
                              field=prefix[:-1], value=run, has_value=True)
        if "policy" in run and not isinstance(run["policy"], str):
            raise LatsimError("must be a string (the policy's name)", source=str(path),
                              field=f"{prefix}policy", value=run["policy"], has_value=True)
        for s in SUMMARY_SECTIONS:
            if s in run and not isinstance(run[s], dict):
                raise LatsimError("must be a JSON object", source=str(path),
                                  field=f"{prefix}{s}", value=run[s], has_value=True)
    return data


def is_there(path: Path) -> bool:
    """Whether a results file is there to read, a link that cannot be followed too (it
    is then refused when read, not skipped as missing)."""
    from simulator.errors import present
    return present(path)
