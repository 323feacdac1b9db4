"""Result files: what a run writes, written so that nothing is lost and nothing
half-written looks whole.

``check_out_dir`` vets an output folder before any work, ``StagedDir`` collects a
command's files in a hidden temporary folder next to it and moves them into place only
when all are written (``StagedFile``: the same for a one-file result, a profile), so a
failed, interrupted or disk-full write leaves the destination as it was; ``writing``
makes such an OS error one line. The per-request table is streamed in chunks of rows
(``write_requests``: CSV, byte for byte what ``DataFrame.to_csv`` writes, or Parquet), so
a run of millions of requests never holds its whole table, nor its text, in memory.
"""
from __future__ import annotations

import contextlib
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

from simulator.errors import LatsimError
from simulator.report.chunks import CHUNK_ROWS, requests_chunks


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


# -- writing tables, in chunks -----------------------------------------------------------------

REQUESTS_CSV_MAX = 100_000   # ``auto``: CSV up to this many requests per run, Parquet above
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
               "timeseries.csv", "timeseries-*.csv", "sessions.csv", "sessions-*.csv",
               "summary.json", "scenario.yaml",
               "latency_cdfs.png", "breakdown.png", "timeseries.png", "cluster.png")


def _writable_dir(d: Path) -> bool:
    """Whether a file can be made in folder ``d``, by making one (permission bits do not
    say it for root, nor for /proc or a read-only mount)."""
    if not os.access(d, os.W_OK | os.X_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=d):
            return True
    except OSError:
        return False


def check_out_dir(out: Path, *, force: bool = False, option: str = "--out",
                  keep: bool = False) -> None:
    """Fail now (one line) if ``out`` cannot take a run's results: it is a file, a part of
    its path is a file, it cannot be created or written, or it already holds files
    (``force``: allowed, those results are replaced; ``keep``: allowed, the command adds
    to them, as a resumed sweep does)."""
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
        if entries and not (force or keep):
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


def check_out_file(out: Path, *, force: bool = False, option: str = "--out",
                   reading: tuple = ()) -> None:
    """Fail now (one line) if ``out`` cannot be written as a result file: it is a folder,
    its folder does not exist or cannot be written, it is one of the files the command
    reads (``reading``), or it exists (``force``: it is replaced)."""
    out = Path(out)
    if out.is_dir():
        raise LatsimError("is a folder; give a file name", source=option, value=str(out),
                          has_value=True)
    for src in reading:
        try:
            same = out.exists() and os.path.samefile(out, src)
        except OSError:
            same = False
        if same:
            raise LatsimError("is the file being read: write to another file", source=option,
                              value=str(out), has_value=True)
    parent = out.absolute().parent
    if not parent.is_dir():
        raise LatsimError(f"its folder {parent} does not exist" if not parent.exists() else
                          f"{parent} is a file, not a folder", source=option, value=str(out),
                          has_value=True)
    if out.exists() and not force:
        raise LatsimError("exists (--force to replace it)", source=option, value=str(out),
                          has_value=True)
    if not _writable_dir(parent) or (out.exists() and not os.access(out, os.W_OK)):
        raise LatsimError("not writable", source=option, value=str(out), has_value=True)


@contextlib.contextmanager
def writing(out, option: str = "--out"):
    """Writing results: an OS error (a full disk, a quota) is one line naming ``out``."""
    try:
        yield
    except OSError as e:
        raise LatsimError(f"cannot write the results: {e.strerror or e}", source=option,
                          value=str(out), has_value=True) from None


def _usual_mode(path: Path, mode: int) -> None:
    """``mkdtemp``/``mkstemp`` make private (0700/0600) files; a result gets the usual mode."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


class _Staged:
    """What ``StagedDir`` and ``StagedFile`` share: as a context manager, the block's
    results are committed when it ends normally and discarded when it raises (an OS
    error while writing becomes the one ``writing`` line); ``files`` are the committed
    paths."""

    files: list

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb) -> bool:
        if kind is None:
            self.files = self.commit()
            return False
        self.discard()
        if isinstance(err, OSError):
            with writing(self.out, self.option):
                raise err
        return False


class StagedDir(_Staged):
    """A hidden temporary folder next to ``out`` that collects a command's files;
    ``commit`` moves them into ``out`` (a rename of the whole folder when ``out`` is new
    or empty), ``discard`` removes them. Until ``commit`` nothing in ``out`` changes.
    ``outputs``: the command's result names (patterns); ``commit`` removes those the
    earlier results in ``out`` have and these do not (other files are left alone)."""

    def __init__(self, out: Path, outputs: tuple = RUN_OUTPUTS, option: str = "--out") -> None:
        self.out, self.outputs, self.option = Path(out), outputs, option
        parent = self.out.absolute().parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=parent))
            _usual_mode(self.path, 0o777)
        except OSError as e:
            raise LatsimError(f"cannot create the folder: {e.strerror}", source=option,
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
                stale = {p for pat in self.outputs for p in self.out.glob(pat)} - \
                    {self.out / n for n in names}
                for n in names:
                    os.replace(self.path / n, self.out / n)
                for p in stale:
                    p.unlink(missing_ok=True)
                self.path.rmdir()
        except OSError as e:
            raise LatsimError(f"cannot move the results into place: {e.strerror} (they are in "
                              f"{self.path})", source=self.option, value=str(self.out),
                              has_value=True) from None
        return [self.out / n for n in names]

    def discard(self) -> None:
        """Remove the staged files (an interrupted or failed run)."""
        shutil.rmtree(self.path, ignore_errors=True)


class StagedFile(_Staged):
    """A hidden temporary file next to ``out`` (``path``) that takes a one-file result;
    ``commit`` renames it over ``out`` (whole or not at all: never a 0-byte or cut-short
    file), ``discard`` removes it."""

    def __init__(self, out: Path, option: str = "--out") -> None:
        self.out, self.option = Path(out), option
        try:
            fd, name = tempfile.mkstemp(prefix=f".{self.out.name}.partial-",
                                        suffix=self.out.suffix, dir=self.out.absolute().parent)
            os.close(fd)
            self.path = Path(name)
            _usual_mode(self.path, 0o666)
        except OSError as e:
            raise LatsimError(f"cannot write the file: {e.strerror}", source=option,
                              value=str(self.out), has_value=True) from None

    def commit(self) -> list[Path]:
        """Rename the staged file over ``out``; returns ``[out]``."""
        try:
            os.replace(self.path, self.out)
        except OSError as e:
            self.discard()
            raise LatsimError(f"cannot move the result into place: {e.strerror}",
                              source=self.option, value=str(self.out), has_value=True) from None
        return [self.out]

    def discard(self) -> None:
        """Remove the staged file (a failed or interrupted write)."""
        self.path.unlink(missing_ok=True)
