"""Readers for request-arrival trace files, with one-line errors naming file, line and column.

Each reader returns a ``RawTrace``: the rows in file order on the trace's own
clock (seconds), with the 1-based line number of every row as an editor shows
it (the header counts), so that any later check can still point at the line.
Turning a ``RawTrace`` into a ``Workload`` (sorting, windows, rescaling,
classes) is ``traces.py``'s job.

Formats:
- ``azure``: Azure LLM inference 2023 CSV (``TIMESTAMP`` wall-clock string,
  ``ContextTokens``, ``GeneratedTokens``); the clock starts at the earliest row.
- ``vidur``: Vidur's processed traces (``arrived_at`` s, ``num_prefill_tokens``,
  ``num_decode_tokens``).
- ``mooncake``: JSON lines (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids``: prefix-block hashes, one per ``hash_block_tokens`` prompt tokens).
- ``csv``: the canonical CSV (``arrival_s``, ``prompt_tokens``, ``output_tokens``,
  optional ``priority`` as an int or a class name, optional ``prefix_hashes`` as
  space-separated ints).
"""
from __future__ import annotations

import difflib
import itertools
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from simulator.errors import LatsimError, check_file

FORMATS = ("azure", "vidur", "mooncake", "csv")
HASH_BLOCK_TOKENS = 512  # Mooncake's block size: one hash id per 512 prompt tokens
MAX_TRACE_MB = 1024      # default size cap of a trace file (``workload.max_file_mb``)
MAX_TOKENS = 10**9       # a token count above this is a broken cell, not a request
MAX_TIME_S = 10**11      # ~3,000 years: a time above this is a broken cell

# format -> (time column, prompt column, output column)
COLUMNS = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "vidur": ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    "mooncake": ("timestamp", "input_length", "output_length"),
    "csv": ("arrival_s", "prompt_tokens", "output_tokens"),
}


@dataclass
class RawTrace:
    """A trace's rows in file order. ``time_s`` is on the trace's own clock."""

    path: Path
    fmt: str
    time_s: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    lines: np.ndarray                      # 1-based line of each row in the file
    priority: Optional[np.ndarray] = None  # raw priority cells (str objects), csv only
    hash_ids: Optional[list] = None        # per-row int64 arrays, or None

    def take(self, idx: np.ndarray) -> "RawTrace":
        """The rows ``idx`` (a boolean mask or an index array), in that order."""
        idx = np.asarray(idx)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        return RawTrace(
            self.path, self.fmt, self.time_s[idx], self.prompt[idx], self.output[idx],
            self.lines[idx], None if self.priority is None else self.priority[idx],
            None if self.hash_ids is None else [self.hash_ids[i] for i in idx])

    @property
    def time_column(self) -> str:
        return COLUMNS[self.fmt][0]


def cell_error(path, line, column, message: str) -> LatsimError:
    """``path:line: column 'c': message`` (line and column optional)."""
    src = f"{path}:{line}" if line is not None else str(path)
    msg = f"column '{column}': {message}" if column else message
    return LatsimError(msg, source=src)


def _check_file(path: Path, max_bytes: int = MAX_TRACE_MB * 2**20) -> None:
    """An existing regular text file within the size cap, not empty, whose first 64 KB
    are UTF-8 without NUL bytes (a binary file is refused before a parser sees it)."""
    check_file(path, max_bytes=max_bytes, what="trace file")
    if path.stat().st_size == 0:
        raise LatsimError("file is empty", source=str(path))
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    nul = head.find(b"\0")
    if nul >= 0:
        raise LatsimError(f"not a text file (a NUL byte at offset {nul:,})", source=str(path))
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        # Not merely a character cut by the 64 KB boundary:
        if len(head) < 1 << 16 or e.reason != "unexpected end of data":
            raise LatsimError(f"not a UTF-8 text file (byte 0x{head[e.start]:02x} at offset "
                              f"{e.start:,})", source=str(path)) from None


def detect_format(path: Path, max_bytes: int = MAX_TRACE_MB * 2**20) -> str:
    """Guess the format from the extension (``.jsonl``) or the CSV header."""
    _check_file(path, max_bytes)
    if path.suffix.lower() in (".jsonl", ".json"):
        return "mooncake"
    with open(path, encoding="utf-8", errors="replace") as f:
        header = [c.strip() for c in f.readline(1 << 16).strip().split(",")]
    for fmt in ("azure", "vidur", "csv"):
        if COLUMNS[fmt][0] in header:
            return fmt
    # No time column: a format whose token columns are there is meant, with the time
    # column misnamed (the reader then says which) or absent (a lengths-only file).
    for fmt in ("azure", "vidur", "csv"):
        if all(c in header for c in COLUMNS[fmt][1:]):
            if difflib.get_close_matches(COLUMNS[fmt][0], header, n=1, cutoff=0.6):
                return fmt
            if fmt == "vidur":
                raise LatsimError("has token counts but no arrival times (a lengths-only file: use "
                                  "it as a synthetic workload's lengths_file)", source=f"{path}:1")
            raise cell_error(path, 1, COLUMNS[fmt][0], f"missing from the header (found "
                             f"{', '.join(header)})")
    raise LatsimError(
        f"cannot tell the trace format from the header (columns: {', '.join(header)}); expected a "
        f"'{COLUMNS['csv'][0]}', 'arrived_at' or 'TIMESTAMP' column, or give format: "
        f"{'|'.join(FORMATS)}", source=f"{path}:1")


def _read_csv_frame(path: Path, max_bytes: int) -> pd.DataFrame:
    _check_file(path, max_bytes)
    try:
        # Everything as text: numeric checks below then find the first bad cell by line.
        # Blank lines are kept as rows so that row i stays on line i + 2.
        # A row with more cells than the header is an error (not silently an index).
        with warnings.catch_warnings():
            warnings.simplefilter("error", pd.errors.ParserWarning)
            df = pd.read_csv(path, dtype=str, skip_blank_lines=False, keep_default_na=False,
                             na_values=[""], index_col=False)
    except pd.errors.ParserWarning:
        raise _ragged(path) from None
    except pd.errors.EmptyDataError:
        raise LatsimError("file is empty", source=str(path)) from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError, OverflowError) as e:
        raise LatsimError(f"cannot read CSV: {str(e).strip().splitlines()[-1]}",
                          source=str(path)) from None
    df.columns = [str(c).strip() for c in df.columns]
    _unique_header(path)
    # Trailing blank lines are harmless; drop them (blank lines in the middle are errors).
    blank = df.isna().all(axis=1).to_numpy()
    last = len(df) - np.argmax(~blank[::-1]) if (~blank).any() else 0
    df = df.iloc[:last]
    if len(df) == 0:
        raise LatsimError("no requests (the file has only a header)", source=str(path))
    return df


def _unique_header(path: Path) -> None:
    """A column named twice in the header is an error (pandas would rename the second
    and the reader silently use the first)."""
    import csv
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        names = [h.strip() for h in next(csv.reader(f), [])]
    for n in names:
        if n and names.count(n) > 1:
            raise cell_error(path, 1, n, f"named {names.count(n)} times in the header: keep one")


def _ragged(path: Path) -> LatsimError:
    """The first line with more cells than the header, as an error."""
    import csv
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        rows = csv.reader(f)
        width = len(next(rows, []))
        for no, row in enumerate(rows, start=2):
            if len(row) > width:
                return cell_error(path, no, None, f"{len(row)} cells, the header has {width}")
    return LatsimError("a row has more cells than the header", source=str(path))


def _require(columns: list[str], needed: tuple[str, ...], path: Path, fmt: str) -> None:
    for col in needed:
        if col not in columns:
            close = difflib.get_close_matches(col, columns, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise cell_error(path, 1, col, f"missing from the header (a {fmt} trace needs "
                             f"{', '.join(needed)}; found {', '.join(columns)}){hint}")


def numeric(values, lines: np.ndarray, path: Path, column: str, *, integer: bool,
            minimum: Optional[float] = None, maximum: Optional[float] = None) -> np.ndarray:
    """Parse a column of cells as numbers; the first bad cell (empty, not a number, not
    finite, fractional where a whole number is due, out of ``[minimum, maximum]``) is an
    error with its line."""
    raw = pd.Series(values, dtype=object)
    num = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=float)
    bad = ~np.isfinite(num)
    if bad.any():
        i = int(np.argmax(bad))
        v = raw.iloc[i]
        what = "empty" if v is None or (isinstance(v, float) and np.isnan(v)) else f"not a number ({v!r})"
        raise cell_error(path, int(lines[i]), column, what)
    if integer:
        frac = num != np.floor(num)
        if frac.any():
            i = int(np.argmax(frac))
            raise cell_error(path, int(lines[i]), column, f"not a whole number ({raw.iloc[i]!r})")
    if minimum is not None:
        low = num < minimum
        if low.any():
            i = int(np.argmax(low))
            raise cell_error(path, int(lines[i]), column,
                             f"must be >= {minimum:g} (got {raw.iloc[i]!r})")
    if maximum is not None:
        high = num > maximum
        if high.any():
            i = int(np.argmax(high))
            raise cell_error(path, int(lines[i]), column,
                             f"must be <= {maximum:,.0f} (got {raw.iloc[i]!r})")
    # Checked above, so the cast below cannot overflow into garbage.
    return num.astype(np.int64) if integer else num


def _parse_hashes(cells, lines: np.ndarray, path: Path, column: str) -> Optional[list]:
    """Space-separated ints per cell (empty cell: no hashes); None if every cell is empty."""
    out, any_hash = [], False
    for cell, line in zip(cells, lines):
        if cell is None or (isinstance(cell, float) and np.isnan(cell)) or not str(cell).strip():
            out.append(np.empty(0, dtype=np.int64))
            continue
        try:
            out.append(np.array([int(x) for x in str(cell).split()], dtype=np.int64))
        except ValueError:
            raise cell_error(path, int(line), column,
                             f"expected space-separated integers (got {cell!r})") from None
        except OverflowError:   # a hash id is an int64, as the prefix cache keys it
            raise cell_error(path, int(line), column, "a hash id must fit 64 bits (got "
                             f"{cell!r})") from None
        any_hash = True
    return out if any_hash else None


def check_hash_blocks(hash_ids: list, prompt: np.ndarray, lines: np.ndarray, path: Path,
                      column: str, block: int, *, skip_empty: bool) -> None:
    """Each request needs ceil(prompt / block) hash ids; report the first violation."""
    n_hash = np.fromiter((len(h) for h in hash_ids), dtype=np.int64, count=len(hash_ids))
    need = -(-prompt // block)
    bad = n_hash != need
    if skip_empty:
        bad &= n_hash > 0
    if bad.any():
        i = int(np.argmax(bad))
        more = int(bad.sum()) - 1
        raise cell_error(
            path, int(lines[i]), column,
            f"{n_hash[i]} hash blocks but a {prompt[i]}-token prompt needs ceil({prompt[i]}/{block})"
            f" = {need[i]} ({block} tokens per block)" + (f"; {more} more rows disagree" if more else ""))


# A time of day followed by a zone: 'Z', '+05:00', '-0800' or '+01' (not a date's '-16').
_ZONED = re.compile(r"\d:\d\d(?::\d\d(?:[.,]\d+)?)?\s*(?:Z|[+-]\d\d(?::?\d\d)?)$", re.I)


def wall_clock_seconds(cells: pd.Series, lines: np.ndarray, path: Path,
                       column: str) -> np.ndarray:
    """Wall-clock time stamps (ISO 8601) as seconds from the earliest: a wall clock has
    no natural origin. Stamps with a zone (``Z``, ``+05:00``) are instants and may mix
    offsets (a log that crossed a daylight-saving change): they are compared in UTC. A
    stamp without a zone among stamps with one has no instant to compare (whose local
    time is it?): an error naming its line, as is a stamp that is no date-time, and
    a span beyond ``MAX_TIME_S``."""
    text = cells.astype(str).str.strip()
    zoned = text.str.contains(_ZONED).to_numpy()
    if zoned.any() and not zoned.all():
        i = int(np.argmax(zoned != zoned[0]))
        raise cell_error(path, int(lines[i]), column, (
            f"a time stamp {'with' if zoned[i] else 'without'} a time zone (got "
            f"{text.iloc[i]!r}) among ones {'without' if zoned[i] else 'with'} one (line "
            f"{int(lines[0])}: {text.iloc[0]!r}): give every stamp a zone, or none"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            stamps = pd.to_datetime(text, format="ISO8601", errors="coerce",
                                    utc=bool(zoned.all()))
        except (ValueError, OverflowError) as e:   # not expected after the check above
            raise cell_error(path, None, column, f"cannot read the time stamps: {e}") from None
    bad = stamps.isna().to_numpy()
    if bad.any():
        i = int(np.argmax(bad))
        raise cell_error(path, int(lines[i]), column, f"not a date-time "
                         f"'YYYY-MM-DD HH:MM:SS.fff' (got {text.iloc[i]!r})")
    # Differences in seconds at whatever unit pandas parsed the stamps at (it picks one
    # from the digits given): never cast to nanoseconds, which overflow past 2262.
    delta = stamps - stamps.min()
    time_s = delta.dt.total_seconds().to_numpy(float)
    far = time_s > MAX_TIME_S
    if far.any():
        i = int(np.argmax(far))
        raise cell_error(path, int(lines[i]), column, f"{time_s[i]:.3g} s after the "
                         f"earliest stamp, over the {MAX_TIME_S:.0e} s a trace may span "
                         f"(got {text.iloc[i]!r})")
    return time_s


def _read_tabular(path: Path, fmt: str, block: int, max_bytes: int) -> RawTrace:
    df = _read_csv_frame(path, max_bytes)
    tcol, pcol, ocol = COLUMNS[fmt]
    _require(list(df.columns), COLUMNS[fmt], path, fmt)
    lines = np.arange(len(df), dtype=np.int64) + 2  # header is line 1
    if fmt == "azure":
        time_s = wall_clock_seconds(df[tcol], lines, path, tcol)
    else:
        time_s = numeric(df[tcol].to_numpy(object), lines, path, tcol, integer=False, minimum=0,
                         maximum=MAX_TIME_S)
    prompt = numeric(df[pcol].to_numpy(object), lines, path, pcol, integer=True, minimum=1,
                     maximum=MAX_TOKENS)
    output = numeric(df[ocol].to_numpy(object), lines, path, ocol, integer=True, minimum=1,
                     maximum=MAX_TOKENS)
    prio = hashes = None
    if fmt == "csv":
        if "priority" in df.columns:
            cells = df["priority"]
            if cells.isna().any():
                i = int(np.argmax(cells.isna().to_numpy()))
                raise cell_error(path, int(lines[i]), "priority", "empty")
            prio = cells.str.strip().to_numpy(object)
        if "prefix_hashes" in df.columns:
            hashes = _parse_hashes(df["prefix_hashes"].to_numpy(object), lines, path,
                                   "prefix_hashes")
            if hashes is not None:
                check_hash_blocks(hashes, prompt, lines, path, "prefix_hashes", block,
                                  skip_empty=True)
    return RawTrace(path, fmt, time_s, prompt, output, lines, prio, hashes)


def _read_mooncake(path: Path, block: int, max_bytes: int) -> RawTrace:
    _check_file(path, max_bytes)
    recs, lines = [], []
    with open(path, encoding="utf-8") as f:
        no = 0
        while True:
            try:
                text = f.readline()
            except UnicodeDecodeError as e:
                raise cell_error(path, no + 1, None, f"not UTF-8 text ({e.reason})") from None
            if not text:
                break
            no += 1
            if not text.strip():
                continue  # blank lines carry nothing in JSON lines
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                raise cell_error(path, no, None, f"invalid JSON: {e.msg} at character {e.pos + 1}") from None
            except RecursionError:
                raise cell_error(path, no, None, "invalid JSON: nested too deeply") from None
            if not isinstance(rec, dict):
                raise cell_error(path, no, None, "each line must be a JSON object")
            recs.append(rec)
            lines.append(no)
    if not recs:
        raise LatsimError("file is empty (no JSON lines)", source=str(path))
    lines = np.array(lines, dtype=np.int64)
    tcol, pcol, ocol = COLUMNS["mooncake"]
    cols = {}
    for col in (tcol, pcol, ocol):
        vals = [r.get(col) for r in recs]
        missing = [i for i, v in enumerate(vals) if v is None]
        if missing:
            i = missing[0]
            close = difflib.get_close_matches(col, list(recs[i]), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise cell_error(path, int(lines[i]), col, f"missing key (found: {', '.join(recs[i])}){hint}")
        def bad(v) -> bool:   # JSON's true, a list, an object, NaN or Infinity
            return isinstance(v, (bool, list, dict)) or (
                isinstance(v, float) and not np.isfinite(v))
        if any(bad(v) for v in vals):
            i = next(i for i, v in enumerate(vals) if bad(v))
            raise cell_error(path, int(lines[i]), col, f"not a number ({vals[i]!r})")
        cols[col] = np.array(vals, dtype=object)
    time_ms = numeric(cols[tcol], lines, path, tcol, integer=False, minimum=0,
                      maximum=MAX_TIME_S * 1000)
    prompt = numeric(cols[pcol], lines, path, pcol, integer=True, minimum=1, maximum=MAX_TOKENS)
    output = numeric(cols[ocol], lines, path, ocol, integer=True, minimum=1, maximum=MAX_TOKENS)
    has = np.array(["hash_ids" in r for r in recs])
    hashes = None
    if has.any():
        if not has.all():
            i = int(np.argmax(~has))
            raise cell_error(path, int(lines[i]), "hash_ids", "missing key (other lines have it)")
        hashes = _mooncake_hashes([r["hash_ids"] for r in recs], lines, path)
        check_hash_blocks(hashes, prompt, lines, path, "hash_ids", block, skip_empty=False)
    return RawTrace(path, "mooncake", time_ms / 1000.0, prompt, output, lines, None, hashes)


def _mooncake_hashes(lists: list, lines: np.ndarray, path: Path) -> list:
    """Per-request int64 arrays from the ``hash_ids`` lists, built from one flat array."""
    ok = all(isinstance(h, list) for h in lists)
    if ok:
        lens = np.fromiter((len(h) for h in lists), dtype=np.int64, count=len(lists))
        flat = np.array(list(itertools.chain.from_iterable(lists)))
        ok = flat.dtype.kind in "iu" or (flat.size == 0)
    if not ok:  # the slow path only finds the line to report
        for h, line in zip(lists, lines):
            if not isinstance(h, list) or not all(type(x) is int for x in h):
                raise cell_error(path, int(line), "hash_ids", f"expected a list of integers (got {h!r:.60})")
        raise LatsimError("hash_ids: integers out of the 64-bit range", source=str(path))
    return np.split(flat.astype(np.int64), np.cumsum(lens)[:-1])


def read_trace(path: Path, fmt: Optional[str] = None, hash_block_tokens: int = HASH_BLOCK_TOKENS,
               max_bytes: int = MAX_TRACE_MB * 2**20) -> RawTrace:
    """Read a trace file in ``fmt`` (auto-detected if None), in file order; a file over
    ``max_bytes`` is refused before it is read."""
    path = Path(path)
    fmt = fmt or detect_format(path, max_bytes)
    if fmt not in FORMATS:
        raise LatsimError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}", source=str(path))
    if fmt == "mooncake":
        return _read_mooncake(path, hash_block_tokens, max_bytes)
    return _read_tabular(path, fmt, hash_block_tokens, max_bytes)


def ordered(raw: RawTrace, sort: bool) -> RawTrace:
    """The trace in time order: out-of-order rows are an error unless ``sort``, then a warning."""
    t = raw.time_s
    back = np.flatnonzero(t[1:] < t[:-1]) + 1
    if len(back) == 0:
        return raw
    i = int(back[0])
    if not sort:
        raise cell_error(raw.path, int(raw.lines[i]), raw.time_column,
                         f"timestamps go backwards ({_fmt_time(raw, i)} after {_fmt_time(raw, i - 1)}"
                         f" on line {raw.lines[i - 1]}; {len(back)} such rows); set sort: true (on the "
                         f"command line: --sort) to sort them")
    warnings.warn(f"{raw.path}: {len(back)} rows out of time order (first on line {raw.lines[i]});"
                  f" sorted as asked (sort: true)", UserWarning, stacklevel=3)
    return raw.take(np.argsort(t, kind="stable"))  # stable: ties keep file order


def _fmt_time(raw: RawTrace, i: int) -> str:
    return f"{raw.time_s[i]:.6g} s"
