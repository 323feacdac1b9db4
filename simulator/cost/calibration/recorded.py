"""Reading a recorded serving run: what a server really did with some traffic
(``read_recorded_run``), and which of a scenario's policy runs served it
(``match_policy``, ``RunCase``).

Two formats are read:

- ``refbench``: the reference engine's run folders (``data/h200-refbench/runs/*``):
  ``trace.csv``, ``requests.csv`` (with the serving ``policy``), ``tokens.csv`` (every
  token's time) and, when present, the step log ``iterations.csv`` (its prefill chunks
  rebuilt by ``runs.read_run``); times on the engine's clock (format in that folder's
  README).
- ``bench``: what ``latsim bench --out DIR`` writes against any OpenAI-compatible
  server: ``requests.csv`` (send time, first and last token of every request and,
  against ``latsim serve``, the server's enqueue, admission and token times, on the
  same clock) and ``summary.json``; plus, when present, ``tokens.csv`` (``request_id,
  token_index, time_s``: every content frame's arrival on the bench clock).

Anything missing or malformed is a one-line ``LatsimError`` naming the file, field and
value, before any work.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from simulator.cost.runs import latency_metrics, numeric_column, read_run, read_table
from simulator.errors import LatsimError, check_text_file, one_line, present, read_json
from simulator.report.percentile import pct_ms


# The reference engine's policy names -> latsim's.
RUN_POLICIES = {"fifo": "fifo", "chunked": "chunked", "priority": "priority_aging",
                "priority_aging": "priority_aging", "fair_score": "fair_score"}
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RecordedRun:
    """A recorded serving run (module doc), one row per request in arrival order (ties
    by ``rid``; a bench run: in ``rid`` order).

    ``arrival``: when the client sent it (the trace's time for refbench); ``visible``:
    when the engine's scheduler could first see it (the server's enqueue time when
    recorded, else the arrival); ``scheduled``: the start of the step that admitted it
    (NaN: not recorded); ``first_token`` / ``last_token``: the end of the steps that
    made them, as recorded (NaN: not recorded; client-side frame arrivals when
    ``token_clock`` is ``client``). ``tokens``: every token's time (``rid, index,
    time``) when recorded. ``real``: the run's P50/P99 of TTFT, TPOT, ITL and E2E (ms).
    ``steps``: the step log (``runs.RunSteps``) when the run has one."""

    folder: Path
    kind: str
    policy: Optional[str]
    recorded_policy: Optional[str]
    rid: np.ndarray
    arrival: np.ndarray
    visible: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    priority: np.ndarray
    scheduled: np.ndarray
    first_token: np.ndarray
    last_token: np.ndarray
    finished: np.ndarray
    token_clock: str
    real: dict
    tokens: Optional[pd.DataFrame] = None
    steps: object = None
    notes: list = field(default_factory=list)
    first_delivered: Optional[np.ndarray] = None
    last_delivered: Optional[np.ndarray] = None

    @property
    def name(self) -> str:
        """The run's name: its folder's."""
        return self.folder.name

    def __len__(self) -> int:
        return len(self.rid)

    def requests_table(self) -> pd.DataFrame:
        """The run as the simulator's per-request table (``requests.csv`` columns that the
        latency metrics and plots read): times relative to the run's clock, tokens taken
        as delivered when recorded (engine-side runs) or when their frames arrived."""
        from simulator.report.metrics import add_derived
        top = int(self.priority.max()) if len(self.priority) else 0
        names = np.array([f"P{i}" for i in range(top + 1)], dtype=object)
        nan = np.full(len(self), np.nan)
        df = pd.DataFrame({
            "rid": self.rid, "priority": self.priority, "class": names[self.priority],
            "prompt_tokens": self.prompt, "output_tokens": self.output, "replica": 0,
            "new_connection": False, "arrival": self.arrival, "enqueued": self.visible,
            "scheduled": self.scheduled, "first_token": self.first_token,
            "last_token": self.last_token,
            "first_delivered": (self.first_delivered if self.first_delivered is not None
                                else self.first_token),
            "last_delivered": np.where(self.finished, self.last_delivered
                                       if self.last_delivered is not None
                                       else self.last_token, nan)})
        df["finished"] = self.finished & np.isfinite(df["last_delivered"].to_numpy())
        df["rejected"] = False
        return add_derived(df)

    def window_end(self) -> Optional[float]:
        """When the recording stopped, if it stopped with requests unfinished (the last
        time it recorded, on its clock); ``None`` when every request finished."""
        if self.finished.all():
            return None
        if self.tokens is not None and len(self.tokens):
            return float(self.tokens["time"].max())
        seen = np.concatenate([self.first_token, self.last_token, self.scheduled])
        return float(np.nanmax(seen)) if np.isfinite(seen).any() else None

    def itl_values(self) -> Optional[np.ndarray]:
        """Every gap between consecutive recorded tokens of a request (s), pooled; None
        when the run records no token times."""
        if self.tokens is None:
            return None
        tok = self.tokens.sort_values(["rid", "index"])
        r = tok["rid"].to_numpy()
        return np.diff(tok["time"].to_numpy())[r[1:] == r[:-1]]

    def workload(self):
        """The run's traffic as a ``Workload`` (its arrivals, lengths and classes)."""
        from simulator.workload import Workload
        top = int(self.priority.max()) if len(self.priority) else 0
        return Workload(arrival_s=self.arrival.astype(float).copy(),
                        prompt_tokens=self.prompt.astype(np.int64).copy(),
                        output_tokens=self.output.astype(np.int64).copy(),
                        priority=self.priority.astype(np.int64).copy(),
                        class_names=tuple(f"P{i}" for i in range(top + 1)),
                        meta={"source": str(self.folder)})


def _no_duplicates(path: Path, col: str, values: np.ndarray, what: str) -> None:
    """A one-line ``LatsimError`` at the first value of ``col`` seen before."""
    dup = pd.Series(values).duplicated().to_numpy()
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        first = int(np.flatnonzero(values == values[i])[0])
        raise LatsimError(f"duplicate {what} (also on row {first + 1})", source=str(path),
                          field=f"{col} (row {i + 1})", value=int(values[i]), has_value=True)


def _read_tokens(path: Path, rids: set) -> pd.DataFrame:
    """``tokens.csv``, checked: request ids and token indexes whole numbers (indexes at
    least 0), times finite and at least 0, each ``(request_id, token_index)`` once, and
    every request listed by the run."""
    tok = read_table(path, ("request_id", "token_index", "time_s"), "tokens")
    rid = numeric_column(path, tok, "request_id", integer=True)
    index = numeric_column(path, tok, "token_index", integer=True, minimum=0)
    time = numeric_column(path, tok, "time_s", minimum=0)
    tok = pd.DataFrame({"rid": rid.astype(np.int64), "index": index.astype(np.int64),
                        "time": time})
    unknown = ~tok["rid"].isin(rids).to_numpy()
    if unknown.any():
        i = int(np.flatnonzero(unknown)[0])
        raise LatsimError("token of a request the run does not list", source=str(path),
                          field=f"request_id (row {i + 1})", value=int(tok["rid"].iloc[i]),
                          has_value=True)
    dup = tok.duplicated(["rid", "index"]).to_numpy()
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        raise LatsimError(f"duplicate token: request {int(tok['rid'].iloc[i])}'s token "
                          f"{int(tok['index'].iloc[i])} is listed twice", source=str(path),
                          field=f"token_index (row {i + 1})",
                          value=int(tok["index"].iloc[i]), has_value=True)
    return tok


def _refbench_missing(folder: Path) -> None:
    """A folder whose ``requests.csv`` is the reference engine's (``request_id``, no
    ``rid``) but lacks ``trace.csv`` or ``tokens.csv``: a one-line ``LatsimError``
    naming the missing file (rather than the bench reader's missing ``rid``)."""
    try:
        cols = set(pd.read_csv(folder / "requests.csv", nrows=0).columns)
    except (OSError, ValueError, pd.errors.ParserError, pd.errors.EmptyDataError,
            UnicodeDecodeError):
        return      # the bench reader says what is wrong with it
    if "request_id" in cols and "rid" not in cols:
        for name in ("trace.csv", "tokens.csv"):
            if not present(folder / name):
                raise LatsimError("file not found (a refbench run folder holds trace.csv, "
                                  "requests.csv and tokens.csv)", source=str(folder / name))


MAX_RUN_FILE_BYTES = 4 * 2**30   # a recorded run's table (the refbench ones: a few MB)
# A run folder's files, by what each holds (as errors name them).
RUN_FILES = {"trace.csv": "trace", "requests.csv": "requests", "tokens.csv": "tokens",
             "iterations.csv": "step log", "summary.json": "bench summary"}


def _vet_files(folder: Path) -> None:
    """Every file of the folder that is read (the run's tables, its summary and, for the
    digest, every other ``.csv`` / ``.json``) is a regular UTF-8 text file: a named pipe
    (which would block the read forever), a loop of links, a folder or binary bytes
    where one should be is a one-line ``LatsimError`` naming it, before anything is read."""
    names = dict.fromkeys([*RUN_FILES, *sorted(p.name for p in folder.glob("*.csv")),
                           *sorted(p.name for p in folder.glob("*.json"))])
    for name in names:
        if present(folder / name):
            check_text_file(folder / name, max_bytes=MAX_RUN_FILE_BYTES,
                            what=RUN_FILES.get(name, "run file"))


def read_recorded_run(folder: str | Path) -> RecordedRun:
    """Read a recorded run folder (module doc); one-line ``LatsimError`` naming the
    file, field and value for anything missing or malformed, before any work: a
    refbench folder missing one of its files, a file with no rows, a cell that is not
    a number or is out of range (negative times and counts, token counts below 1,
    fractional counts), duplicate request ids or tokens, token counts in
    ``requests.csv`` that differ from the trace's,
    tokens beyond a request's output or before its arrival, and steps out of order or
    overlapping."""
    folder = Path(folder)
    if not folder.is_dir():
        raise LatsimError("run folder not found", source=str(folder), field="--run")
    _vet_files(folder)
    if present(folder / "trace.csv") and present(folder / "tokens.csv"):
        return _read_refbench(folder)
    if present(folder / "requests.csv"):
        _refbench_missing(folder)
        return _read_bench(folder)
    raise LatsimError("not a recorded run: needs trace.csv, requests.csv and tokens.csv "
                      "(a refbench run) or the requests.csv of `latsim bench --out`",
                      source=str(folder), field="--run")


def _read_trace(path: Path) -> pd.DataFrame:
    """A refbench ``trace.csv``, checked: at least one request; request ids whole
    numbers, each once; arrivals finite and at least 0; token counts whole numbers of at
    least 1; priorities (when given) whole numbers of at least 0. Sorted by arrival (ties
    by request id): the order the run is replayed in."""
    trace = read_table(path, ("request_id", "arrival_s", "prompt_tokens", "output_tokens"),
                      "trace")
    if trace.empty:
        raise LatsimError("the run has no requests", source=str(path))
    rids = numeric_column(path, trace, "request_id", integer=True)
    _no_duplicates(path, "request_id", rids, "request_id")
    arrival = numeric_column(path, trace, "arrival_s", minimum=0)
    ints = {"request_id": rids}
    for c in ("prompt_tokens", "output_tokens"):
        ints[c] = numeric_column(path, trace, c, integer=True, minimum=1)
    if "priority" in trace.columns:
        ints["priority"] = numeric_column(path, trace, "priority", integer=True, minimum=0)
    for c, v in ints.items():
        trace[c] = v.astype(np.int64)
    trace["arrival_s"] = arrival
    # The run is kept and replayed in arrival order (ties by request id), whatever order
    # its ids were given in.
    order = np.lexsort((rids, arrival))
    return trace.iloc[order].reset_index(drop=True)


def _read_requests(path: Path, trace: pd.DataFrame) -> pd.DataFrame:
    """A refbench ``requests.csv``, checked against the run's ``trace``: at least one
    request; request ids whole numbers, each once, every one in the trace (a trace
    request missing here has no recorded admission); one serving policy; the token
    counts, when given, the trace's; ``first_scheduled_s`` a time of at least 0 or
    empty."""
    reqs = read_table(path, ("request_id",), "requests")
    if reqs.empty:
        raise LatsimError("the run has no requests", source=str(path))
    qid = numeric_column(path, reqs, "request_id", integer=True)
    _no_duplicates(path, "request_id", qid, "request_id")
    reqs["request_id"] = qid = qid.astype(np.int64)
    tr = trace.set_index("request_id")
    unknown = ~np.isin(qid, tr.index.to_numpy())
    if unknown.any():
        i = int(np.flatnonzero(unknown)[0])
        raise LatsimError("a request that trace.csv does not list", source=str(path),
                          field=f"request_id (row {i + 1})", value=int(qid[i]),
                          has_value=True)
    if "policy" in reqs.columns:
        pols = reqs["policy"].astype(str).to_numpy()
        other = pols != pols[0]
        if other.any():
            i = int(np.flatnonzero(other)[0])
            raise LatsimError(f"more than one serving policy (row 1 says {pols[0]!r})",
                              source=str(path), field=f"policy (row {i + 1})",
                              value=pols[i], has_value=True)
    for c in ("prompt_tokens", "output_tokens"):
        if c not in reqs.columns:
            continue
        v = numeric_column(path, reqs, c, integer=True)
        want = tr[c].reindex(qid).to_numpy(float)
        off = v != want
        if off.any():
            i = int(np.flatnonzero(off)[0])
            raise LatsimError(f"request {int(qid[i])}: trace.csv says {int(want[i])}",
                              source=str(path), field=f"{c} (row {i + 1})",
                              value=int(v[i]), has_value=True)
    if "first_scheduled_s" in reqs.columns:
        reqs["first_scheduled_s"] = numeric_column(path, reqs, "first_scheduled_s",
                                                   minimum=0, allow_nan=True)
    return reqs


# A step log recorded with the run replays against its trace and tokens without a
# mismatch: 0 in each shipped run (load50-fifo's 3,158 steps, load90-chunked's 2,008, and
# either cut short at any point), since the replay is the engine's own scheduling rule.
# Past this share of steps (or of first tokens) off, the log is not the run's (another
# run's, edited, shuffled): a profile calibrated on it would fit step times to the
# wrong steps. The leeway is for a log whose recording ends inside a step.
MAX_STEP_LOG_MISMATCH = 0.01


def check_step_log(check: dict, source, first_tokens: int) -> None:
    """Refuse a step log that contradicts the run (``runs.read_run``'s replay check
    ``check``: steps whose decode side or prefill sequence count the trace and tokens do
    not give, first tokens not at the end of the step that finished the prompt) beyond
    ``MAX_STEP_LOG_MISMATCH``, saying how far off it is."""
    steps = max(int(check.get("steps", 0)), 1)
    parts = []
    for key, what, base in (("decode_mismatches", "decode counts or contexts", steps),
                            ("prefill_seq_mismatches", "prefill sequence counts", steps),
                            ("first_token_mismatches", "first tokens", max(first_tokens, 1))):
        n = int(check.get(key, 0))
        if n > MAX_STEP_LOG_MISMATCH * base:
            unit = "steps" if base is steps else "requests"
            parts.append(f"{what} of {n:,} of {base:,} {unit} ({n / base:.0%})")
    if parts:
        off = float(check.get("first_token_max_abs_s") or 0.0)
        raise LatsimError(
            "the step log contradicts the run's trace and tokens: " + "; ".join(parts)
            + (f" differ (first tokens up to {off:.3g} s off)" if off else " differ")
            + f" (a log of this run has none; over {MAX_STEP_LOG_MISMATCH:.0%} is refused)",
            source=str(source))


def _read_refbench(folder: Path) -> RecordedRun:
    trace = _read_trace(folder / "trace.csv")
    reqs = _read_requests(folder / "requests.csv", trace)
    rids = trace["request_id"].to_numpy(np.int64)
    tpath = folder / "tokens.csv"
    tok = _read_tokens(tpath, set(rids.tolist()))
    if tok.empty:
        raise LatsimError("the run has no tokens", source=str(tpath))
    # Every token within its request's output, and not before the request arrived.
    tr = trace.set_index("request_id")
    beyond = tok["index"].to_numpy() >= tr["output_tokens"].reindex(tok["rid"]).to_numpy()
    if beyond.any():
        i = int(np.flatnonzero(beyond)[0])
        r = int(tok["rid"].iloc[i])
        raise LatsimError(f"request {r} has {int(tr.at[r, 'output_tokens'])} output_tokens "
                          f"in trace.csv: no token of that index", source=str(tpath),
                          field=f"token_index (row {i + 1})",
                          value=int(tok["index"].iloc[i]), has_value=True)
    early = tok["time"].to_numpy() < tr["arrival_s"].reindex(tok["rid"]).to_numpy()
    if early.any():
        i = int(np.flatnonzero(early)[0])
        r = int(tok["rid"].iloc[i])
        raise LatsimError(f"a token before its request arrived (request {r} at "
                          f"{tr.at[r, 'arrival_s']:g} s in trace.csv)", source=str(tpath),
                          field=f"time_s (row {i + 1})", value=float(tok["time"].iloc[i]),
                          has_value=True)
    pol = None
    if "policy" in reqs.columns and len(reqs):
        pol = str(reqs["policy"].iloc[0])
        if pol not in RUN_POLICIES:
            raise LatsimError("unknown serving policy", source=str(folder / "requests.csv"),
                              field="policy", value=pol, has_value=True)
    arrival = trace["arrival_s"].to_numpy(float)
    r = reqs.set_index("request_id")
    sched = (r["first_scheduled_s"].reindex(rids).to_numpy(float)
             if "first_scheduled_s" in r.columns else np.full(len(rids), np.nan))
    g = tok.groupby("rid")["time"]
    first = g.min().reindex(rids).to_numpy(float)
    last = g.max().reindex(rids).to_numpy(float)
    count = g.count().reindex(rids).fillna(0).to_numpy(np.int64)
    out = trace["output_tokens"].to_numpy(np.int64)
    steps = None
    notes = []
    if present(folder / "iterations.csv"):
        try:
            steps = read_run(folder)
        except (KeyError, ValueError, AttributeError) as e:
            raise LatsimError(f"cannot rebuild the step log: {one_line(str(e), 80)}",
                              source=str(folder / "iterations.csv")) from None
        check_step_log(steps.check, folder / "iterations.csv", int((count > 0).sum()))
    else:
        notes.append("no iterations.csv: steps rebuilt by replaying the policy")
    if (count < out).any():
        notes.append(f"{int((count < out).sum())} of {len(rids)} requests unfinished when the "
                     f"recording ended ({tok['time'].max():.1f} s): real and simulated "
                     f"latencies are of the requests finished by then")
    return RecordedRun(
        folder=folder, kind="refbench", policy=RUN_POLICIES.get(pol) if pol else None,
        recorded_policy=pol, rid=rids, arrival=arrival, visible=arrival.copy(),
        prompt=trace["prompt_tokens"].to_numpy(np.int64), output=out,
        priority=(trace["priority"].to_numpy(np.int64) if "priority" in trace.columns
                  else np.zeros(len(rids), np.int64)),
        scheduled=sched, first_token=first, last_token=last, finished=count >= out,
        token_clock="engine",
        # As ``vllm bench serve``: the latencies of the requests that finished.
        real=latency_metrics(dict(zip(rids, arrival)),
                             tok[tok["rid"].isin(set(rids[count >= out].tolist()))],
                             dict(zip(rids.tolist(), out.tolist()))),
        tokens=tok, steps=steps, notes=notes)


_BENCH_COLS = ("rid", "prompt_tokens", "output_tokens", "arrival", "first_token",
               "last_token")


def _read_bench(folder: Path) -> RecordedRun:
    path = folder / "requests.csv"
    df = read_table(path, _BENCH_COLS, "requests")
    if df.empty:
        raise LatsimError("the run has no requests", source=str(path))
    rid = numeric_column(path, df, "rid", integer=True)
    _no_duplicates(path, "rid", rid, "rid")
    df["rid"] = rid.astype(np.int64)
    for c in ("prompt_tokens", "output_tokens"):
        df[c] = numeric_column(path, df, c, integer=True, minimum=1).astype(np.int64)
    df["arrival"] = numeric_column(path, df, "arrival")
    df = df.sort_values("rid", kind="stable").reset_index(drop=True)
    rids = df["rid"].to_numpy(np.int64)
    nan = np.full(len(df), np.nan)

    def col(name):
        return pd.to_numeric(df[name], errors="coerce").to_numpy(float) \
            if name in df.columns else nan.copy()

    first, last = col("first_token"), col("last_token")
    fin = (df["finished"].astype(bool).to_numpy() if "finished" in df.columns
           else np.isfinite(last))
    frames = col("frames")
    if not np.isfinite(first).any() or (np.isfinite(frames).any() and np.nansum(frames) == 0):
        raise LatsimError("the run has no tokens (no request received a content frame)",
                          source=str(path), field="first_token")
    enq = col("enqueued")
    server = bool(np.isfinite(enq).any())
    tok = None
    if present(folder / "tokens.csv"):
        tok = _read_tokens(folder / "tokens.csv", set(rids.tolist()))
        if tok.empty:
            raise LatsimError("the run has no tokens", source=str(folder / "tokens.csv"))
    arrival = col("arrival")
    if np.isnan(arrival).any():
        i = int(np.where(np.isnan(arrival))[0][0])
        raise LatsimError("not a number", source=str(path), field=f"arrival (row {i + 1})")
    real = _bench_real(folder, df, tok, dict(zip(rids, arrival)))
    notes = []
    if (~fin).any():
        notes.append(f"{int((~fin).sum())} requests did not finish: replayed as if they "
                     f"had, without their token times")
    clock = "server" if server else "client"
    if tok is not None:
        clock = "client"
    policy = None
    if "policy" in df.columns:
        p = str(df["policy"].iloc[0])
        if p not in RUN_POLICIES:
            raise LatsimError("unknown serving policy", source=str(path), field="policy",
                              value=p, has_value=True)
        policy = p
    return RecordedRun(
        folder=folder, kind="bench", policy=RUN_POLICIES.get(policy) if policy else None,
        recorded_policy=policy, rid=rids, arrival=arrival,
        visible=np.where(np.isfinite(enq), enq, arrival),
        prompt=df["prompt_tokens"].to_numpy(np.int64),
        output=df["output_tokens"].to_numpy(np.int64),
        priority=(pd.to_numeric(df["priority"], errors="coerce").fillna(0).to_numpy(np.int64)
                  if "priority" in df.columns else np.zeros(len(df), np.int64)),
        scheduled=col("scheduled"), first_token=np.where(fin | np.isfinite(first), first, nan),
        last_token=np.where(fin, last, nan), finished=fin, token_clock=clock, real=real,
        tokens=tok, notes=notes,
        first_delivered=col("first_delivered") if "first_delivered" in df.columns else None,
        last_delivered=col("last_delivered") if "last_delivered" in df.columns else None)


def _bench_real(folder: Path, df: pd.DataFrame, tok, arrival: dict) -> dict:
    """The bench run's own P50/P99s: from ``tokens.csv`` when recorded, else from its
    ``summary.json`` (bench pools every frame gap into ITL there), else from the
    per-request table (ITL then unknown)."""
    fin = df[df["finished"].astype(bool)] if "finished" in df.columns else df
    if tok is not None:
        keep = set(fin["rid"].tolist())
        # TPOT over the tokens asked for (bench sends ignore_eos), as bench's own
        # summary counts them: a server may stream several tokens in one frame.
        return latency_metrics(arrival, tok[tok["rid"].isin(keep)],
                               dict(zip(df["rid"].tolist(), df["output_tokens"].tolist())))
    sj = folder / "summary.json"
    if present(sj):
        s = read_json(sj, max_bytes=MAX_RUN_FILE_BYTES, what="bench summary").get("overall")
        if s is None:
            s = {}
        if not isinstance(s, dict):
            raise LatsimError("must be a JSON object (as `latsim bench --out` writes it)",
                              source=str(sj), field="overall", value=s, has_value=True)
        keys = [f"{q}_{m}_ms" for m in METRICS for q in ("median", "p99")]
        if all(isinstance(s.get(k), (int, float)) for k in keys):
            return {k: float(s[k]) for k in keys}
    out = {}
    for m, c in (("ttft", "ttft"), ("tpot", "tpot"), ("e2el", "e2el")):
        v = pd.to_numeric(fin[c], errors="coerce").dropna().to_numpy() if c in fin else []
        out[f"median_{m}_ms"] = pct_ms(v, 50)
        out[f"p99_{m}_ms"] = pct_ms(v, 99)
    out["median_itl_ms"] = out["p99_itl_ms"] = math.nan
    return out


def match_policy(scenario, run: RecordedRun, source: str, label: Optional[str] = None,
                 label_option: str = "--policy"):
    """The scenario's policy run (``(label, scenario)``) that served ``run``: the one
    whose policy the run records; else the one named ``label`` (given by the option
    ``label_option``); else the only one (``run`` None: a run that records no policy).
    One-line ``LatsimError`` when the scenario's policy differs from the run's."""
    runs = scenario.policy_runs()
    if label is not None:
        runs = [r for r in runs if r[0] == label]
        if not runs:
            names = ", ".join(lb for lb, _ in scenario.policy_runs())
            raise LatsimError(f"no policy run labelled so (the scenario has: {names})",
                              source=label_option, value=label, has_value=True)
    if run is not None and run.policy is not None:
        same = [r for r in runs if r[1].engine.policy == run.policy]
        if not same:
            have = ", ".join(sorted({r[1].engine.policy for r in runs}))
            raise LatsimError(f"the scenario's policy ({have}) differs from the one the run "
                              f"{run.name} recorded ({run.recorded_policy})", source=source,
                              field="engine.policy", value=have, has_value=True)
        return same[0]
    if len(runs) > 1:
        names = ", ".join(lb for lb, _ in runs)
        raise LatsimError(f"the run does not record its policy and the scenario has several "
                          f"({names}): pick one with {label_option}", source=source,
                          field="policies")
    return runs[0]


@dataclass
class RunCase:
    """One recorded run with the scenario policy run it is replayed under."""

    run: RecordedRun
    label: str
    scenario: object


def run_digest(run: RecordedRun) -> str:
    """A content hash of the run's files (what ``meta.calibration`` names)."""
    h = hashlib.sha256()
    for f in sorted(run.folder.glob("*.csv")) + sorted(run.folder.glob("*.json")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
