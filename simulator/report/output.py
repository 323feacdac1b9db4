"""Turning runs into what a person reads: console tables and result files.

This is the only module of the simulator (with the CLI) that does I/O.

Result files are written so that nothing is lost and nothing half-written looks whole:
``check_out_dir`` vets an output folder before any work, ``StagedDir`` collects a run's
files in a hidden temporary folder next to it and moves them into place only when all
are written (an interrupted run leaves just that hidden folder), and the per-request
table is streamed in chunks of rows (``write_requests``: CSV, byte for byte what
``DataFrame.to_csv`` writes, or Parquet), so a run of millions of requests never holds
its whole table, nor its text, in memory.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from simulator.errors import LatsimError
from simulator.report.kv import kv_summary, kv_table
from simulator.report.metrics import (BREAKDOWN, good_mask, per_class,
                                      requests_table, summarize)


def run_outputs(res) -> tuple[pd.DataFrame, dict]:
    """The per-request table and the summary (overall, per class, run facts) of a run."""
    df = requests_table(res)
    return df, _outputs(res, df)


def run_summary(res) -> dict:
    """``run_outputs``'s summary without building the per-request table: the same numbers
    from only the columns they need (what a large run can afford)."""
    return _outputs(res, summary_frame(res))


# Columns of ``requests_table`` no summary reads (only the derived ones made from them):
# left out of ``summary_frame``. Any other column, including one added later, is kept, so
# the two summaries stay the same.
_NOT_SUMMARISED = ("rid", "replica", "new_connection", "enqueued", "scheduled", "first_token",
                   "last_token", "first_delivered", "cached_tokens")


def summary_frame(res, rows: int | None = None) -> pd.DataFrame:
    """``requests_table(res)`` less the columns no summary reads, built chunk by chunk
    into preallocated columns (never the whole table at once, nor a copy of it)."""
    n = len(res.workload)
    rows = rows or CHUNK_ROWS
    cols: dict = {}
    for a, df in zip(range(0, max(n, 1), rows), requests_chunks(res, rows)):
        df = df.drop(columns=[c for c in _NOT_SUMMARISED if c in df])
        for c in df.columns:
            v = df[c].to_numpy()
            if c not in cols:
                cols[c] = np.empty(n, dtype=v.dtype)
            cols[c][a:a + len(v)] = v
    return pd.DataFrame(cols, copy=False)


def _outputs(res, df: pd.DataFrame) -> dict:
    """The summary of a run from a table holding (at least) ``summary_frame``'s columns."""
    summary = summarize(df, res.rec.itl, res.scenario)
    out = {
        "policy": res.policy,
        "seed": res.seed,
        "overall": summary,
        "per_class": per_class(df, res.scenario),
        "run": {
            "replicas": res.scenario.cluster.replicas,
            "kv_capacity_blocks": res.kv_capacity_blocks,
            "kv_capacity_tokens": res.kv_capacity_tokens,
            "engine_steps": res.rec.steps,
            "cost_model": res.cost_info,
            "cost_extrapolations": res.extrapolations,
            "cost_lookups": res.cost_lookups,
            "connections": res.connections,
            "sim_end_s": res.sim_end,
            # ``compiled`` or ``simpy``, with why the compiled loop did not run.
            "event_loop": res.meta.get("loop", "simpy"),
            "policy_params": res.meta.get("policy_params", {}),
        },
        "kv": kv_summary(res, df),
    }
    from simulator.report.traffic import cluster_summary
    out["cluster"] = cluster_summary(res, df, good_mask(df, res.scenario))
    # The rich stream/network model's totals (see simulate._Wire), when it was on; the
    # gateway's attempt tallies (``loops.traffic``), when traffic control was on.
    for key in ("stream", "network", "traffic", "speculative"):
        if key in res.meta:
            out[key] = res.meta[key]
    return out


def fmt(v, digits: str = ".2f") -> str:
    """A number for a table cell: thousands separators, '-' for missing."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:,{digits}}"
    return str(v)


def latency_table(title: str, columns: dict[str, dict], side_by_side: bool | None = None) -> Table:
    """P50/P90/P99 of TTFT, TPOT, ITL, E2EL (ms): one column per percentile for a single
    run, one column per run (rows metric x percentile) when comparing several
    (``side_by_side``; default: when there are several)."""
    metrics = ("ttft", "tpot", "itl", "e2el")
    if not any(s.get("p99_itl_ms") is not None and not math.isnan(s.get("p99_itl_ms"))
               for s in columns.values()):
        metrics = ("ttft", "tpot", "e2el")  # per-class tables: ITL is pooled run-wide only
    t = Table(title=title, title_justify="left")
    t.add_column("metric (ms)")
    if not (len(columns) > 1 if side_by_side is None else side_by_side):
        s = next(iter(columns.values()))
        for q in ("P50", "P90", "P99"):
            t.add_column(q, justify="right")
        for m in metrics:
            t.add_row(m.upper(), fmt(s.get(f"median_{m}_ms")), fmt(s.get(f"p90_{m}_ms")),
                      fmt(s.get(f"p99_{m}_ms")))
        return t
    for name in columns:
        t.add_column(name, justify="right")
    for m in metrics:
        for q, key in (("P50", "median"), ("P90", "p90"), ("P99", "p99")):
            t.add_row(f"{m.upper()} {q}", *[fmt(s.get(f"{key}_{m}_ms")) for s in columns.values()])
    return t


def breakdown_table(columns: dict[str, dict], side_by_side: bool | None = None) -> Table:
    """Mean and P99 of each additive stage (ms); one column per run when comparing
    (``side_by_side``; default: when there are several)."""
    t = Table(title="E2E breakdown (ms)", title_justify="left")
    t.add_column("stage")
    single = not (len(columns) > 1 if side_by_side is None else side_by_side)
    if single:
        t.add_column("mean", justify="right")
        t.add_column("P99", justify="right")
    else:
        for name in columns:
            t.add_column(name, justify="right")
    for b in (*BREAKDOWN, "e2el"):
        if single:
            s = next(iter(columns.values()))
            t.add_row(b.upper(), fmt(s.get(f"mean_{b}_ms")), fmt(s.get(f"p99_{b}_ms")))
        else:
            for key in ("mean", "p99"):
                t.add_row(f"{b.upper()} {key}", *[fmt(s.get(f"{key}_{b}_ms"))
                                                   for s in columns.values()])
    return t


def throughput_table(columns: dict[str, dict]) -> Table:
    """Completed, not finished, throughputs, goodput and the diagnosis; a column per run."""
    t = Table(title="Throughput", title_justify="left")
    t.add_column("")
    for name in columns:
        t.add_column(name, justify="right")
    for key, label in (("completed", "completed"), ("not_finished", "not finished"),
                       ("request_throughput", "requests/s"),
                       ("output_throughput", "output tokens/s"),
                       ("request_goodput", "goodput requests/s"), ("diagnosis", "diagnosis")):
        t.add_row(label, *[fmt(s.get(key)) for s in columns.values()])
    return t


def print_fitting(console: Console, build, columns: dict) -> None:
    """Print ``build(columns)`` (a table with one column per entry), split into several
    tables of fewer entries when it is wider than the console, so that no cell (a number)
    is ever wrapped or cut: each part keeps the row labels."""
    # Labels come from the scenario: print them as text, never as rich markup.
    columns = {escape(str(k)): v for k, v in columns.items()}
    keys = list(columns)
    width = console.width
    start = 0
    while start < len(keys):
        end = len(keys)
        # The most entries from ``start`` whose table fits (at least one).
        while end - start > 1:
            t = build({k: columns[k] for k in keys[start:end]})
            if console.measure(t).maximum <= width:
                break
            end -= 1
        console.print(build({k: columns[k] for k in keys[start:end]}))
        start = end


def print_run(console: Console, outs: dict[str, dict]) -> None:
    """Print one or several runs (keyed by policy) side by side, as many side by side as
    the console's width allows."""
    overall = {k: o["overall"] for k, o in outs.items()}
    many = len(outs) > 1
    print_fitting(console, lambda cols: latency_table("Latency, all requests", cols, many),
                  overall)
    classes = sorted({c for o in outs.values() for c in o["per_class"]})
    if len(classes) > 1:
        for c in classes:
            cols = {k: o["per_class"].get(c, {}) for k, o in outs.items()}
            print_fitting(console, lambda cc, c=c: latency_table(f"Latency, class {escape(c)}",
                                                                 cc, many), cols)
    print_fitting(console, lambda cols: breakdown_table(cols, many), overall)
    print_fitting(console, throughput_table, overall)
    if all("kv" in o for o in outs.values()):
        print_fitting(console, kv_table, outs)
    if any("stream" in o for o in outs.values()):
        print_fitting(console, stream_table, outs)
    for k, o in outs.items():
        run = o["run"]
        if run["cost_extrapolations"]:
            console.print(f"[yellow]warning[/]: {escape(str(k))}: "
                          f"{run['cost_extrapolations']:,} of "
                          f"{run['cost_lookups']:,} step-cost lookups fell outside the "
                          "profile's measured range and were extrapolated")


STREAM_ROWS = (
    ("frames", "SSE frames"), ("tokens_per_frame", "tokens per frame"),
    ("bytes", "bytes sent"), ("heartbeats", "heartbeat frames"),
    ("peak_buffer_bytes_max", "peak send buffer, max (B)"),
    ("peak_buffer_bytes_p99", "peak send buffer, P99 (B)"),
    ("over_capacity", "streams over buffer_bytes"), ("degraded", "degraded to one body"),
    ("blocked_streams", "streams blocked"), ("blocked_s", "time blocked (s)"),
    ("disconnects_signalled", "disconnects, signalled"),
    ("disconnects_unsignalled", "disconnects, silent"),
    ("disconnects_cancelled", "cancelled by the server"),
    ("wasted_gpu_s_signalled", "GPU-s after signalled ones"),
    ("wasted_gpu_s_unsignalled", "GPU-s after silent ones"),
    ("wasted_cost_usd_unsignalled", "$ after silent ones"),
)


def stream_table(outs: dict[str, dict]) -> Table:
    """The stream model's totals: frames, bytes, buffers, backpressure, disconnects and
    the GPU time spent for clients that had gone; one column per run."""
    t = Table(title="Streaming and disconnects", title_justify="left")
    t.add_column("")
    for name in outs:
        t.add_column(name, justify="right")
    for key, label in STREAM_ROWS:
        t.add_row(label, *[fmt(o.get("stream", {}).get(key)) for o in outs.values()])
    nets = [o.get("network") for o in outs.values()]
    if any(nets):
        regions = sorted({r for n in nets if n for r in n["requests_per_region"]})
        for r in regions:
            t.add_row(f"requests to {r}",
                      *[fmt((n or {}).get("requests_per_region", {}).get(r)) for n in nets])
        t.add_row("mean RTT (ms)", *[fmt((n or {}).get("mean_rtt_ms")) for n in nets])
    return t


def json_safe(o):
    """``o`` with NaN/inf as None and numpy scalars as Python numbers, for JSON."""
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if isinstance(o, dict):
        return {k: json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    if hasattr(o, "item") and callable(o.item):  # numpy scalars
        return json_safe(o.item())
    return o


def file_labels(labels) -> dict:
    """A file-name-safe, distinct form of each run label (``requests-<label>.csv``): a
    label is the scenario's text, and may hold ``/``, spaces or ``..``."""
    out, used = {}, set()
    for label in labels:
        base = re.sub(r"[^A-Za-z0-9._+-]", "_", str(label)).strip(".") or "run"
        name, i = base[:100], 2
        while name in used:
            name, i = f"{base[:100]}-{i}", i + 1
        used.add(name)
        out[label] = name
    return out


def write_run(out_dir: Path, scenario, outs: dict[str, dict], tables: dict[str, pd.DataFrame],
              series: dict[str, pd.DataFrame] | None = None) -> list[Path]:
    """Write requests.csv (one per policy when several), timeseries.csv, summary.json and
    scenario.yaml into ``out_dir`` (the CLI stages them with ``StagedDir``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    multi = len(tables) > 1
    names = file_labels(list(tables) + [k for k in (series or {}) if k not in tables])
    for k, df in tables.items():
        written.append(write_csv([df], out_dir / (f"requests-{names[k]}.csv" if multi
                                                  else "requests.csv")))
    for k, s in (series or {}).items():
        written.append(write_csv([s], out_dir / (f"timeseries-{names[k]}.csv" if multi
                                                 else "timeseries.csv")))
    written += write_run_facts(out_dir, scenario, outs)
    return written


def write_run_facts(out_dir: Path, scenario, outs: dict[str, dict]) -> list[Path]:
    """summary.json (one entry per run when several) and scenario.yaml."""
    multi = len(outs) > 1
    p = Path(out_dir) / "summary.json"
    p.write_text(json.dumps(json_safe(outs if multi else next(iter(outs.values()))), indent=2)
                 + "\n")
    q = Path(out_dir) / "scenario.yaml"
    q.write_text(yaml.safe_dump(scenario.model_dump(mode="json"), sort_keys=False))
    return [p, q]


def series_table(res) -> pd.DataFrame:
    """Per-replica time series (queue length, running batch, KV use) as one table."""
    frames = []
    for i, (ts, wq, run, blk, kv, shared) in enumerate(res.rec.series):
        frames.append(pd.DataFrame({"replica": i, "time": list(ts), "waiting": list(wq),
                                    "running": list(run), "kv_blocks_reserved": list(blk),
                                    "kv_tokens": list(kv), "kv_blocks_shared": list(shared)}))
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if len(df):
        cap = res.kv_capacity_blocks
        sp = res.meta.get("slot_pools")
        if sp:
            # A mixed fleet: each replica's pool, and its own capacity.
            k = df["replica"].to_numpy()
            df.insert(1, "pool", np.array([nm for nm, _c, _g in sp], dtype=object)[k])
            cap = np.array([c for _nm, c, _g in sp], dtype=np.float64)[k]
        df["kv_reserved_frac"] = df["kv_blocks_reserved"] / cap
        # Utilisation as the seeds define it: tokens held / token slots reserved.
        slots = df["kv_blocks_reserved"] * res.scenario.engine.kv.block_size
        df["kv_utilization"] = (df["kv_tokens"] / slots.where(slots > 0)).clip(upper=1.0)
    if "attempts" in res.meta or res.meta.get("utilization"):
        # Traffic control: utilisation columns and the cluster rows (``report.traffic``).
        from simulator.report.traffic import add_utilization, cluster_rows
        df = add_utilization(res, df)
        if "attempts" in res.meta:
            frame = summary_frame(res)
            good = good_mask(frame, res.scenario)
            rows = cluster_rows(res, frame, good if good is not None
                                else frame["finished"].to_numpy(bool))
            df = pd.concat([df, rows], ignore_index=True)
    return df


# -- how much a run takes ------------------------------------------------------------------

# What a run holds per request (workload, recorder, the event loop's state, the summary
# columns, a chunk of the table being written) and what the process holds anyway
# (Python, numpy, pandas, the compiled loop's machine code, or compiling it);
# ``benchmarks/big_run.py`` measures them (620 MiB at 1M requests, 3.8 GiB at 10M on the
# compiled loop), these are rounded up.
RUN_BYTES_PER_REQUEST = {"compiled": 500, "simpy": 2500}
RUN_BASE_BYTES = 600 * 2**20


def run_memory(n_requests: float, loop: str = "compiled") -> float:
    """Bytes a run of ``n_requests`` on ``loop`` (``compiled`` or ``simpy``) is expected
    to need at its peak, writing its results included."""
    return RUN_BASE_BYTES + n_requests * RUN_BYTES_PER_REQUEST[loop]


# -- writing tables, in chunks -----------------------------------------------------------------

REQUESTS_CSV_MAX = 100_000   # ``auto``: CSV up to this many requests per run, Parquet above
CHUNK_ROWS = 100_000         # rows formatted (or converted to Arrow) at a time
TABLE_FORMATS = ("auto", "csv", "parquet")


def _csv_cells(col: pd.Series) -> list:
    """One column as CSV text cells, exactly as ``DataFrame.to_csv(float_format="%.9g")``
    writes them (floats with 9 significant digits and NaN empty, ``True``/``False``,
    integers as such, text quoted where it must be)."""
    a = col.to_numpy()
    kind = a.dtype.kind
    if kind == "f":
        cells = ["%.9g" % v for v in a.tolist()]
        nan = np.flatnonzero(np.isnan(a))
        for i in nan.tolist():
            cells[i] = ""
        return cells
    if kind == "b":
        return ["True" if v else "False" for v in a.tolist()]
    if kind in "iu":
        return list(map(str, a.tolist()))
    quoted: dict = {}
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="")
    out = []
    for v in a.tolist():
        key = (type(v), v) if v == v else (float, "nan")
        q = quoted.get(key)
        if q is None:
            if v is None or v == "" or (isinstance(v, float) and v != v):
                q = ""   # as pandas: missing values and empty text are empty cells
            else:
                buf.seek(0)
                buf.truncate()
                w.writerow([v if isinstance(v, str) else str(v)])
                q = buf.getvalue()
            quoted[key] = q
        out.append(q)
    return out


def _csv_text(df: pd.DataFrame, header: bool) -> str:
    """``df`` as CSV text (see ``_csv_cells``), with the header line when asked."""
    body = "\n".join(map(",".join, zip(*(_csv_cells(df[c]) for c in df.columns))))
    head = ",".join(_csv_cells(pd.Series(list(map(str, df.columns)), dtype=object))) + "\n" \
        if header else ""
    return head + (body + "\n" if len(df) else "")


def write_csv(frames, path: Path) -> Path:
    """Write an iterable of same-columned frames to one CSV file, a frame at a time."""
    with open(path, "w", newline="") as f:
        for i, df in enumerate(frames):
            f.write(_csv_text(df, header=i == 0))
    return path


def write_parquet(frames, path: Path) -> Path:
    """Write an iterable of same-columned frames to one Parquet file, a row group each."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise LatsimError("Parquet needs pyarrow: pip install 'latsim[parquet]' (or "
                          "--table-format csv)", source="--table-format") from None
    writer = None
    try:
        for df in frames:
            table = pa.Table.from_pandas(df, preserve_index=False)
            if writer is None:
                writer = pq.ParquetWriter(str(path), table.schema)
            writer.write_table(table.cast(writer.schema))
    finally:
        if writer is not None:
            writer.close()
    return path


class _RowSlice:
    """Rows ``[a, b)`` of an object whose per-request arrays have ``n`` rows: each such
    array attribute reads as its slice (``n`` reads as ``b - a``), the rest as is."""

    def __init__(self, obj, a: int, b: int, n: int) -> None:
        self._obj, self._a, self._b, self._n = obj, a, b, n

    def __getattr__(self, name: str):
        if name == "n":
            return self._b - self._a
        v = getattr(self._obj, name)
        if isinstance(v, np.ndarray) and v.ndim >= 1 and len(v) == self._n:
            return v[self._a:self._b]
        return v


class _ResultsSlice:
    """A run's ``Results`` restricted to rows ``[a, b)``, for ``requests_table``."""

    def __init__(self, res, a: int, b: int) -> None:
        n = len(res.workload)
        self._res = res
        self.rec = _RowSlice(res.rec, a, b, n)
        self.workload = _RowSlice(res.workload, a, b, n)

    def __getattr__(self, name: str):
        return getattr(self._res, name)


def requests_chunks(res, rows: int = CHUNK_ROWS):
    """``requests_table(res)`` as consecutive frames of at most ``rows`` rows."""
    n = len(res.workload)
    for a in range(0, max(n, 1), rows):
        b = min(a + rows, n)
        df = requests_table(_ResultsSlice(res, a, b))
        df["rid"] += a
        yield df


def table_format(fmt: str, n_requests: int) -> str:
    """``csv`` or ``parquet`` for a run of ``n_requests`` (``auto``: CSV up to
    ``REQUESTS_CSV_MAX``, Parquet above when pyarrow is installed)."""
    if fmt not in TABLE_FORMATS:
        raise LatsimError(f"must be one of {', '.join(TABLE_FORMATS)}", source="--table-format",
                          value=fmt, has_value=True)
    if fmt != "auto":
        return fmt
    if n_requests <= REQUESTS_CSV_MAX:
        return "csv"
    import importlib.util
    return "parquet" if importlib.util.find_spec("pyarrow") is not None else "csv"


def write_requests(res, path: Path, fmt: str = "csv", rows: int = CHUNK_ROWS) -> Path:
    """Stream a run's per-request table to ``path`` (``csv`` or ``parquet``) in chunks."""
    chunks = requests_chunks(res, rows)
    return write_parquet(chunks, path) if fmt == "parquet" else write_csv(chunks, path)


# -- output folders: checked first, written all at once ----------------------------------------

# What a run writes into its folder; ``--force`` replaces exactly these.
RUN_OUTPUTS = ("requests.csv", "requests-*.csv", "requests.parquet", "requests-*.parquet",
               "timeseries.csv", "timeseries-*.csv", "summary.json", "scenario.yaml",
               "latency_cdfs.png", "breakdown.png", "timeseries.png", "cluster.png")


def _writable_dir(d: Path) -> bool:
    return os.access(d, os.W_OK | os.X_OK)


def check_out_dir(out: Path, *, force: bool = False, option: str = "--out") -> None:
    """Fail now (one line) if ``out`` cannot take a run's results: it is a file, a part of
    its path is a file, it cannot be created or written, or it already holds files
    (``force``: allowed, those results are replaced)."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise LatsimError("exists and is not a folder", source=option, value=str(out),
                              has_value=True)
        try:
            entries = sum(1 for _ in out.iterdir())
        except OSError as e:
            raise LatsimError(f"cannot read the folder: {e.strerror}", source=option,
                              value=str(out), has_value=True) from None
        if entries and not force:
            raise LatsimError(f"folder exists and is not empty ({entries} entries): pass "
                              "--force to replace its results, or choose another",
                              source=option, value=str(out), has_value=True)
        if not _writable_dir(out) or not _writable_dir(out.resolve().parent):
            raise LatsimError("folder is not writable", source=option, value=str(out),
                              has_value=True)
        return
    # A new folder: the nearest existing ancestor must be a writable folder.
    anc = out.absolute().parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise LatsimError(f"cannot create the folder: {anc} is a file", source=option,
                          value=str(out), has_value=True)
    if not _writable_dir(anc):
        raise LatsimError(f"cannot create the folder: {anc} is not writable", source=option,
                          value=str(out), has_value=True)


class StagedDir:
    """A hidden temporary folder next to ``out`` that collects a run's files; ``commit``
    moves them into ``out`` (a rename of the whole folder when ``out`` is new or empty),
    ``discard`` removes them. Until ``commit`` nothing in ``out`` changes."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        parent = self.out.absolute().parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=parent))
            # mkdtemp makes it private (0700); the results folder gets the usual mode.
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(self.path, 0o777 & ~umask)
        except OSError as e:
            raise LatsimError(f"cannot create the folder: {e.strerror}", source="--out",
                              value=str(self.out), has_value=True) from None

    def commit(self) -> list[Path]:
        """Move the staged files into ``out``; returns their final paths."""
        names = sorted(p.name for p in self.path.iterdir())
        try:
            if self.out.is_dir() and not any(self.out.iterdir()):
                self.out.rmdir()
            if not self.out.exists():
                os.rename(self.path, self.out)
            else:
                stale = {p for pat in RUN_OUTPUTS for p in self.out.glob(pat)} - \
                    {self.out / n for n in names}
                for n in names:
                    os.replace(self.path / n, self.out / n)
                for p in stale:
                    p.unlink(missing_ok=True)
                self.path.rmdir()
        except OSError as e:
            raise LatsimError(f"cannot move the results into place: {e.strerror} (they are in "
                              f"{self.path})", source="--out", value=str(self.out),
                              has_value=True) from None
        return [self.out / n for n in names]

    def discard(self) -> None:
        """Remove the staged files (an interrupted or failed run)."""
        shutil.rmtree(self.path, ignore_errors=True)
