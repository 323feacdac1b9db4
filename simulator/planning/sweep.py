"""Parameter sweeps: every point of a grid, one tidy table, resumable.

A grid is a list of axes, each ``key=v1,v2,...`` (values read as YAML) or a numeric
range ``key=start:stop[:step]`` (inclusive of ``stop`` when it lands on the grid;
decimal arithmetic, so ``0.1:0.5:0.1`` has five points). Keys are scenario paths
(``engine.chunk_size``) or the shorthands ``replicas``, ``router``, ``policy`` and
``rate`` / ``workload.rate`` (a synthetic workload's ``workload.arrival.rate``; a
trace's own ``workload.rate``). Points are the cartesian product, last axis fastest.

Each (point, seed) is one pure call ``executors.run_point((scenario dict, seed,
base_dir, profile)) -> row`` (parameters + every summary metric, see there), run in a
process pool (``local``) or as Ray tasks (``ray``); no files are shared: the driver
reads the cost profile once and ships it with each task.

``run_sweep`` writes ``sweep.yaml`` (the grid, seeds and scenario) first, appends each
row to ``results.csv`` as soon as it finishes (the parameters and seed are the row's
key, so ``resume`` skips what is done; a row is on disk whole or not at all), then
stages the table sorted by point order then seed (byte-identical whether or not the
run was interrupted), ``results.parquet`` when pyarrow is present and ``sweep.yaml``,
and moves them into place together (``report.files.StagedDir``). A sweep that fails
or is interrupted before its first row leaves nothing behind in a folder it started.
"""
from __future__ import annotations

import contextlib
import copy
import csv
import io
import itertools
import json
import os
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd
import yaml

from simulator.config.scenario import validate_scenario
from simulator.config.yamlfile import INT_LIMIT, parse_override, safe_yaml
from simulator.errors import LatsimError, present, read_text
from simulator.planning.executors import load_profile_for, make_executor
from simulator.report.files import StagedDir, StagedFile, check_out_dir

SHORTHANDS = {"replicas": "cluster.replicas", "router": "cluster.router",
              "policy": "engine.policy"}
RESULTS_CSV = "results.csv"
MAX_TABLE_BYTES = 2**30   # a sweep's table or record read back by --resume (rows: KBs)
SWEEP_OUTPUTS = (RESULTS_CSV, "results.parquet", "sweep.yaml")   # what a sweep writes


@dataclass(frozen=True)
class Axis:
    """One grid axis: a key (as the user wrote it) and its values in order."""

    key: str
    values: tuple


def _number(text: str) -> Optional[Decimal]:
    try:
        d = Decimal(text.strip())
    except InvalidOperation:
        return None
    return d if d.is_finite() else None


def parse_axis(text: str, source: str = "--grid") -> Axis:
    """``key=v1,v2`` or ``key=start:stop[:step]`` -> an ``Axis`` (one-line errors)."""
    key, _ = parse_override(text, source)  # checks the key; the values are parsed below
    raw = text.split("=", 1)[1].strip()
    if not raw:
        raise LatsimError("no values given", source=source, value=text, has_value=True)
    if key == "seed":
        raise LatsimError("use --seeds N to run several seeds", source=source, field=key)
    parts = raw.split(":")
    nums = [_number(p) for p in parts]
    if len(parts) in (2, 3) and "," not in raw and all(n is not None for n in nums):
        start, stop = nums[0], nums[1]
        step = nums[2] if len(parts) == 3 else Decimal(1)
        if step <= 0 or stop < start:
            raise LatsimError("a range needs start <= stop and a step > 0", source=source,
                              field=key, value=raw, has_value=True)
        count = int((stop - start) / step) + 1
        if count > 100_000:
            raise LatsimError("range has too many points", source=source, field=key,
                              value=raw, has_value=True)
        vals = [start + i * step for i in range(count)]
        integral = all("." not in p and "e" not in p.lower() for p in parts)
        return Axis(key, tuple(int(v) if integral else float(v) for v in vals))
    values = []
    for item in raw.split(","):
        _, v = parse_override(f"{key}={item.strip()}", source)
        values.append(v)
    return Axis(key, tuple(values))


def expand(axes: list[Axis]) -> list[dict]:
    """Every point of the grid as ``{key: value}``, in order (last axis fastest)."""
    keys = [a.key for a in axes]
    if len(set(keys)) != len(keys):
        raise LatsimError("a key is given twice", source="--grid",
                          value=sorted(k for k in keys if keys.count(k) > 1)[0], has_value=True)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(a.values for a in axes))]


def resolve_key(data: dict, key: str) -> str:
    """The scenario path a grid key sets (shorthands and ``workload.rate`` resolved)."""
    key = SHORTHANDS.get(key, key)
    if key in ("rate", "workload.rate"):
        kind = (data.get("workload") or {}).get("kind", "synthetic")
        return "workload.arrival.rate" if kind == "synthetic" else "workload.rate"
    return key


def set_path(data: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested mapping (creating mappings on the way), in place."""
    node = data
    keys = dotted.split(".")
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    node[keys[-1]] = value


def policy_axis(base: dict) -> tuple[Axis, dict]:
    """The ``engine.policy`` axis a scenario's ``policies:`` list stands for: its values
    are the runs' labels, and ``runs`` maps each label to its entry (a policy name,
    or ``{policy, label, engine fields, kv}``), which ``point_scenario`` applies."""
    runs = {}
    for entry in base["policies"]:
        if isinstance(entry, dict):
            label = entry.get("label") or entry.get("policy")
        else:
            label = entry
        runs[str(label)] = entry
    return Axis("engine.policy", tuple(runs)), runs


def _apply_run(data: dict, entry) -> None:
    """Set a ``policies:`` entry's engine settings on a scenario mapping."""
    eng = data.setdefault("engine", {})
    if not isinstance(entry, dict):
        eng["policy"] = entry
        return
    for k, v in entry.items():
        if k == "client":
            # ``client: null`` is meaningful (patient clients); a mapping changes fields.
            data["client"] = None if v is None else {**(data.get("client") or {}), **v}
            continue
        if k == "edge":
            # The run's edge node, a section of its own: the base's with the entry's
            # sections changed (``PolicyRun.edge_of``; null: none).
            data["edge"] = None if v is None else {**(data.get("edge") or {}), **v}
            continue
        if k == "label" or v is None:
            continue
        if k == "kv":
            eng["kv"] = {**(eng.get("kv") or {}), **v}
        elif k == "cluster":
            # An entry's cluster settings (``PolicyRun.traffic_update``): a new router
            # starts from its own default parameters.
            cl = data.setdefault("cluster", {})
            if "router" in v and "router_params" not in v:
                cl.pop("router_params", None)
            cl.update(v)
        else:
            eng[k] = v


def point_scenario(base: dict, params: dict, runs: Optional[dict] = None) -> dict:
    """A deep copy of ``base`` with every parameter of one grid point set; an
    ``engine.policy`` value that names one of ``runs`` applies that whole entry
    first, so the other grid axes override its settings (the grid is explicit)."""
    out = copy.deepcopy(base)
    rest = {}
    for key, value in params.items():
        path = resolve_key(out, key)
        if runs and path == "engine.policy" and value in runs:
            _apply_run(out, runs[value])
        else:
            rest[path] = value
    for path, value in rest.items():
        set_path(out, path, value)
    return out


def describe(params: dict) -> str:
    """``k=v, k=v`` for messages."""
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "(base scenario)"


# -- the results table ----------------------------------------------------------------------

def cell(v: Any) -> str:
    """A value as CSV text; floats as their shortest exact repr, NaN as empty."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float) or type(v).__module__ == "numpy":
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, float):
            return "" if v != v else repr(v)
    if isinstance(v, (list, dict)):
        return json.dumps(v, sort_keys=True)
    return str(v)


class ResultsTable:
    """``results.csv``, appended to row by row; rows are keyed by parameters + seed."""

    def __init__(self, path: Path, keys: list[str]) -> None:
        self.path, self.keys = path, keys
        self.columns: list[str] = []
        self.rows: dict[tuple, dict] = {}    # key -> row of strings, file order

    def key(self, row: dict) -> tuple:
        """The row's identity: its parameter cells and seed cell."""
        return tuple(row.get(k, "") for k in self.keys) + (row.get("seed", ""),)

    def load(self) -> None:
        """Read what an earlier run wrote, dropping a last line cut short by a kill (a
        regular UTF-8 text file: a pipe, a link loop, a folder or binary bytes there is a
        one-line error, ``errors.read_text``)."""
        text = read_text(self.path, max_bytes=MAX_TABLE_BYTES, what="sweep table")
        if text and not text.endswith("\n"):
            text = text[: text.rfind("\n") + 1]
            self.path.write_text(text)
        reader = csv.reader(io.StringIO(text))
        header = next(reader, None)
        if not header:
            return
        missing = [k for k in ["point", *self.keys, "seed"] if k not in header]
        if missing:
            raise LatsimError(f"cannot resume: it has no column {missing[0]!r} (a sweep over "
                              "other parameters?)", source=str(self.path))
        self.columns = header
        for cells in reader:
            if len(cells) == len(header):
                row = dict(zip(header, cells))
                self.rows.setdefault(self.key(row), row)

    def append(self, row: dict) -> None:
        """Add one finished row and append it to the file (rewriting it on new columns).
        A failed write (a full disk) leaves the file and the table as they were."""
        srow = {k: cell(v) for k, v in row.items()}
        k = self.key(srow)
        prev, cols = self.rows.get(k), list(self.columns)
        self.rows[k] = srow
        new = [c for c in srow if c not in self.columns]
        try:
            if new or not self.path.exists():
                self.columns += new
                self._write(self.rows.values())
                return
            size = self.path.stat().st_size
            try:
                with self.path.open("a", newline="") as f:
                    csv.writer(f, lineterminator="\n").writerow(
                        [srow.get(c, "") for c in self.columns])
            except BaseException:
                os.truncate(self.path, size)    # no half row: cut back to the whole ones
                raise
        except BaseException:
            self.columns = cols
            if prev is None:
                del self.rows[k]
            else:
                self.rows[k] = prev
            raise

    def _write(self, rows, to: Optional[Path] = None) -> None:
        """The whole table, to ``to`` (a staged folder's file) or over ``path``, whole
        or not at all (``StagedFile``)."""
        staged = None if to is not None else StagedFile(self.path)
        try:
            with open(to or staged.path, "w", newline="") as f:
                w = csv.writer(f, lineterminator="\n")
                w.writerow(self.columns)
                for r in rows:
                    w.writerow([r.get(c, "") for c in self.columns])
        except BaseException:
            if staged is not None:
                staged.discard()
            raise
        if staged is not None:
            staged.commit()

    def finalize(self, order: dict[tuple, tuple[int, int]], to: Path) -> None:
        """Write the table to ``to`` sorted by ``order`` (key -> (point, seed index)); rows
        of other grids keep their file order, after. Columns: point, parameters, seed, then
        the metrics in the order of the first complete row, then ``error``, then any others."""
        known = sorted((r for r in self.rows.values() if self.key(r) in order),
                       key=lambda r: order[self.key(r)])
        for r in known:
            r["point"] = str(order[self.key(r)][0])
        other = [r for r in self.rows.values() if self.key(r) not in order]
        rows = known + other
        head = ["point", *self.keys, "seed"]
        ref = next((r for r in rows if not r.get("error")), {})
        cols = head + [c for c in ref if c not in head and c != "error"]
        rest = sorted({c for r in rows for c in r} - set(cols) - {"error"})
        self.columns = cols + (["error"] if any(r.get("error") for r in rows) else []) + rest
        self._write(rows, to)


@dataclass
class SweepResult:
    """What ``run_sweep`` did: the final table, rows run now and skipped, wall seconds."""

    table: pd.DataFrame
    ran: int
    skipped: int
    wall_s: float
    path: Path
    errors: int = 0


def _progress(console, total: int):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    return Progress(TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("ETA"),
                    TimeRemainingColumn(), console=console, transient=False)


def run_sweep(base: dict, base_dir: Path, axes: list[Axis], out_dir: Path, *, seeds: int = 1,
              executor: str = "local", workers: Optional[int] = None, resume: bool = False,
              force: bool = False, limit: Optional[int] = None, console=None,
              progress: bool = True, address: Optional[str] = None,
              on_start: Optional[Callable[[Optional[float]], None]] = None) -> SweepResult:
    """Run every (point, seed) of the grid over ``base`` (a scenario mapping) into ``out_dir``.

    ``limit`` stops after that many new rows (the rest is left for ``resume``);
    ``address``: a running Ray cluster (``executor="ray"``); ``on_start``: called once
    every point is checked and before the first runs, with the largest point's expected
    requests (None if not known ahead): ``latsim sweep`` says there whether kernels
    compile, so that a bad point's error is the only line on the screen."""
    if seeds < 1:
        raise LatsimError("must be at least 1", source="--seeds", value=seeds, has_value=True)
    if limit is not None and limit < 1:
        raise LatsimError("must be at least 1", source="--limit", value=limit, has_value=True)
    base = copy.deepcopy(base)
    runs = None
    if base.get("policies") and not any(resolve_key(base, a.key) == "engine.policy" for a in axes):
        axis, runs = policy_axis(base)
        axes = [*axes, axis]
    base.pop("policies", None)
    points = expand(axes)
    base_seed = int(base.get("seed", 0) or 0)
    if base_seed + seeds > INT_LIMIT:
        raise LatsimError(f"seeds {base_seed} to {base_seed + seeds - 1} pass the largest seed "
                          f"({INT_LIMIT - 1})", source="--seeds", value=seeds, has_value=True)
    seed_list = [base_seed + i for i in range(seeds)]
    out_dir = Path(out_dir)
    check_out_dir(out_dir, keep=True)
    path = out_dir / RESULTS_CSV
    if path.exists() and not (resume or force):
        raise LatsimError("results already exist: pass --resume to continue them or --force "
                          "to start again", source=str(path))
    keys = [a.key for a in axes]
    table = ResultsTable(path, keys)
    if resume and present(path):   # a link loop is there too: refused, not started over
        table.load()
        _check_same_sweep(out_dir / "sweep.yaml", axes, base)
    elif path.exists():
        path.unlink()
    # Validate every point before running any, and load each profile once.
    cache: dict = {}
    tasks, task_rows, order = [], [], {}
    for i, params in enumerate(points):
        data = point_scenario(base, params, runs)
        try:
            sc = validate_scenario(data, source=f"grid point {describe(params)}",
                                   base_dir=base_dir)
        except LatsimError as e:
            raise LatsimError(str(e)) from None
        profile = load_profile_for(sc, base_dir, cache)
        for j, s in enumerate(seed_list):
            head = {"point": i, **params, "seed": s}
            k = table.key({kk: cell(v) for kk, v in head.items()})
            order[k] = (i, j)
            if k in table.rows:
                continue
            tasks.append((data, s, str(base_dir), profile))
            task_rows.append(head)
    skipped = len(points) * seeds - len(tasks)
    if limit is not None:
        tasks, task_rows = tasks[:limit], task_rows[:limit]
    largest = _check_sweep_memory(tasks, task_rows, executor, workers)
    if on_start is not None and tasks:
        on_start(largest)
    spec = yaml.safe_dump({"grid": {a.key: list(a.values) for a in axes}, "seeds": seed_list,
                           "scenario": base}, sort_keys=False)
    made_dir, new_table = not out_dir.exists(), not path.exists()
    t0 = time.perf_counter()
    ran = errors = 0
    try:
        with _disk():
            out_dir.mkdir(parents=True, exist_ok=True)
            # The spec first: rows a failure keeps resume, checked to be this sweep's.
            _replace_text(out_dir / "sweep.yaml", spec)
        ex = make_executor(executor, workers, address) if tasks else None
        prog = _progress(console, len(tasks)) if progress and tasks else None
        aborted = True
        try:
            results = ex.imap_unordered(tasks) if ex else ()
            if prog is not None:
                prog.start()
                bar = prog.add_task("sweep", total=len(tasks))
            for i, row in results:
                with _disk():
                    table.append({**task_rows[i], **row})
                ran += 1
                errors += "error" in row
                if prog is not None:
                    prog.advance(bar)
            aborted = False
        finally:
            if prog is not None:
                prog.stop()
            if ex is not None:
                ex.close(abort=aborted)
        # The sorted table, its Parquet copy and the spec, moved into place together.
        staged = StagedDir(out_dir, SWEEP_OUTPUTS)
        try:
            with _disk():
                table.finalize(order, staged.path / RESULTS_CSV)
                df = pd.read_csv(staged.path / RESULTS_CSV)
                _write_parquet(df, staged.path / "results.parquet")
                (staged.path / "sweep.yaml").write_text(spec)
        except BaseException:
            staged.discard()
            raise
        staged.commit()
    except BaseException as e:
        if new_table and not table.rows:    # nothing finished: leave nothing behind
            for name in SWEEP_OUTPUTS:
                (out_dir / name).unlink(missing_ok=True)
            if made_dir:
                with contextlib.suppress(OSError):
                    out_dir.rmdir()
        if isinstance(e, _DiskError):
            kept = (f"; the {len(table.rows)} finished row(s) are kept in {path}: free space "
                    "and rerun with --resume" if table.rows else "; nothing was kept")
            raise LatsimError(f"cannot write the results: {e.why}{kept}", source="--out",
                              value=str(out_dir), has_value=True) from None
        raise
    wall = time.perf_counter() - t0
    return SweepResult(df, ran, skipped, wall, path, errors)


class _DiskError(Exception):
    """An OS error while writing the sweep's files (a full disk), told apart from one
    in a point (reading its trace), which is not the results' fault."""

    def __init__(self, e: OSError) -> None:
        super().__init__(str(e))
        self.why = e.strerror or str(e)


@contextlib.contextmanager
def _disk():
    """Writing the sweep's files: an ``OSError`` becomes a ``_DiskError``."""
    try:
        yield
    except OSError as e:
        raise _DiskError(e) from None


def _check_same_sweep(spec: Path, axes: list, base: dict) -> None:
    """``--resume`` continues the sweep its folder holds: the same grid over the same
    scenario (more or fewer seeds are fine), else its rows would be matched to other
    points by index."""
    if not present(spec):
        return
    # Read as a scenario is (regular UTF-8 text, bounded YAML of plain values): a file
    # that is not one is named as such, not taken for another sweep's record.
    old = safe_yaml(read_text(spec, max_bytes=MAX_TABLE_BYTES, what="sweep record"),
                    str(spec)) or {}
    new = yaml.safe_load(yaml.safe_dump({"grid": {a.key: list(a.values) for a in axes},
                                         "scenario": base}, sort_keys=False))
    if not isinstance(old, dict) or any(old.get(k) != new[k] for k in ("grid", "scenario")):
        what = "grid" if not isinstance(old, dict) or old.get("grid") != new["grid"] else \
            "scenario (or --set)"
        raise LatsimError(f"the results there are of another sweep (its {what} differs): pass "
                          f"--force to start again, or --out another folder", source=str(spec))


def _check_sweep_memory(tasks: list, rows: list, executor: str,
                        workers: Optional[int]) -> Optional[float]:
    """Refuse a sweep whose largest points, run side by side, need more memory than the
    machine has (one line naming the point), before any of them starts. Returns the
    largest point's expected requests (None if no point knows it ahead)."""
    from simulator.errors import check_memory
    from simulator.report.output import run_memory
    if not tasks:
        return None
    sizes = []
    for (data, _, bdir, _), row in zip(tasks, rows):
        try:
            sc = validate_scenario(data, base_dir=Path(bdir))
        except LatsimError:
            continue
        expected = getattr(sc.workload, "expected_requests", None)
        if expected is not None:
            sizes.append((expected(), row))
    if not sizes:
        return None
    at_once = 1 if executor != "local" else max(1, min(len(tasks), workers or os.cpu_count() or 1))
    sizes.sort(key=lambda x: -x[0])
    need = sum(run_memory(n) for n, _ in sizes[:at_once])
    params = {k: v for k, v in sizes[0][1].items() if k not in ("point", "seed")}
    check_memory(need, f"running {at_once} point(s) at a time, the largest "
                 f"({describe(params)}) with {sizes[0][0]:,.0f} requests,", source="--grid",
                 hint="lower the requests per point" + (" or --workers" if at_once > 1 else ""))
    return sizes[0][0]


def _replace_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (``StagedFile``)."""
    staged = StagedFile(path)
    try:
        staged.path.write_text(text)
    except BaseException:
        staged.discard()
        raise
    staged.commit()


def _write_parquet(df: pd.DataFrame, path: Path) -> Optional[Path]:
    """Parquet copy of the table (into the staged folder) when pyarrow is installed and
    can type every column; the CSV is canonical."""
    try:
        df.to_parquet(path, index=False)
    except (ImportError, ValueError, TypeError):  # no pyarrow, or a column it cannot type
        path.unlink(missing_ok=True)
        return None
    return path
