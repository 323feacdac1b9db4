"""Read a recorded serving run of the reference engine (``data/h200-refbench/runs/*``)
into per-step compositions a cost model can price.

A run folder holds ``trace.csv`` (arrivals and token counts), ``requests.csv`` (per
request timestamps, and the serving ``policy``), ``tokens.csv`` (every emitted token's
time) and ``iterations.csv`` (every engine step: start, end, decode count, prefill
tokens and sequences, decode contexts). ``iterations.csv`` does not say which prompt
each prefill token belonged to, how much of that prompt was already cached (the
chunk's ``prior``) or whether the chunk finished it. Those follow from the engine's
scheduling rule, so they are rebuilt here by replaying the recorded steps against the
trace:

- ``chunked`` / ``priority``: the prefill tokens of a step go first to the partially
  prefilled request(s), then to new requests in the policy's order (arrival; for
  ``priority``, ``priority - floor(wait / 2 s)`` then arrival), each getting
  ``min(remaining prompt, remaining tokens)``: latsim's own chunked fill rule
  (``policies.chunked.fill_chunked``) and aging order (``policies.priority_aging``);
- ``fifo``: the same walk, which gives whole prompts because the engine never splits
  one.

The replay is checked three ways: the number of prefill sequences of every step, the
decode count and decode contexts (max and sum) of every step, and every request's
first-token time (the end of the step that finished its prompt) against
``tokens.csv``. ``RunSteps.check`` holds the mismatch counts.

``iterations.csv`` is checked before the replay (``read_iterations``): a malformed step
log is a one-line ``LatsimError`` naming the file, the column and row, and the value.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from simulator.errors import LatsimError
from simulator.report.percentile import pct_ms
from simulator.model.policies.chunked import fill_chunked
from simulator.model.policies.priority_aging import aging_key


@dataclass
class RunSteps:
    """One recorded run as per-step compositions (arrays indexed by step).

    ``chunks[i]`` is a list of ``(n, prior, completes, request_id)``; ``nd``,
    ``ctx_max``, ``ctx_sum`` the recorded decode side; ``dur_s`` the measured step
    durations and ``gap_s`` the host time before the next step starts."""

    name: str
    policy: str
    start_s: np.ndarray
    end_s: np.ndarray
    nd: np.ndarray
    ctx_max: np.ndarray
    ctx_sum: np.ndarray
    n_running: np.ndarray
    chunks: list
    trace: pd.DataFrame
    requests: pd.DataFrame
    tokens: pd.DataFrame
    check: dict = field(default_factory=dict)

    @property
    def dur_s(self) -> np.ndarray:
        return self.end_s - self.start_s

    @property
    def gap_s(self) -> np.ndarray:
        """Host time between a step's end and the next one's start (NaN for the last)."""
        g = np.full(len(self.start_s), np.nan)
        g[:-1] = self.start_s[1:] - self.end_s[:-1]
        return g

    def kinds(self, large_chunk: int = 256) -> np.ndarray:
        """Step kind labels: ``decode``, ``prefill-small`` / ``prefill-large`` (all
        prefill tokens below / at least ``large_chunk``), ``mixed``."""
        out = []
        for nd, ch in zip(self.nd, self.chunks):
            if not ch:
                out.append("decode")
            elif nd:
                out.append("mixed")
            else:
                tot = sum(c[0] for c in ch)
                out.append("prefill-large" if tot >= large_chunk else "prefill-small")
        return np.array(out)


def plain_value(v):
    """A cell as a plain Python value for an error message (not ``np.float64(...)``)."""
    return v.item() if isinstance(v, np.generic) else v


MAX_TABLE_BYTES = 4 * 2**30   # a run's table (the refbench ones: a few MB)


def read_table(path, need, what: str) -> pd.DataFrame:
    """A CSV file that must hold the columns ``need``: a one-line ``LatsimError`` naming
    the file when it is missing, unreadable (not text, not CSV, a folder) or lacks a
    column (the first missing one as the field)."""
    from simulator.errors import read_csv
    path = Path(path)
    # A regular UTF-8 text file (not a pipe, a loop of links or a folder), then CSV.
    df = read_csv(path, max_bytes=MAX_TABLE_BYTES, what=what)
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise LatsimError(f"missing columns: {', '.join(missing)}", source=str(path),
                          field=missing[0])
    return df


def numeric_column(path, df: pd.DataFrame, col: str, *, integer: bool = False,
                   minimum: float | None = None, positive: bool = False,
                   allow_nan: bool = False) -> np.ndarray:
    """Column ``col`` of ``df`` (read from ``path``) as floats, checked: every cell a
    number (text is an error; an empty cell too unless ``allow_nan``), finite, a whole
    number when ``integer``, at least ``minimum``, above 0 when ``positive``; the first
    bad cell is a one-line
    ``LatsimError`` naming the file, the column and row (1: the first data row) and the
    value. The caller checks that the column exists."""
    raw = df[col]
    v = pd.to_numeric(raw, errors="coerce").to_numpy(float)
    nan = np.isnan(v)

    def bad(mask, why):
        i = int(np.flatnonzero(mask)[0])
        raise LatsimError(why, source=str(path), field=f"{col} (row {i + 1})",
                          value=plain_value(raw.iloc[i]), has_value=True)

    if nan.any():
        text = nan & raw.notna().to_numpy()
        if text.any():
            bad(text, "not a number")
        if not allow_nan:
            bad(nan, "empty or NaN")
    if np.isinf(v).any():
        bad(np.isinf(v), "not a finite number")
    w = np.where(nan, 0.0, v)          # empty cells (allowed here) pass every check below
    if integer and (w != np.floor(w)).any():
        bad(w != np.floor(w), "not a whole number")
    if integer and (np.abs(w) > 2.0 ** 53).any():
        bad(np.abs(w) > 2.0 ** 53, "too large")
    if minimum is not None and (~nan & (w < minimum)).any():
        bad(~nan & (w < minimum), f"must be at least {minimum:g}")
    if positive and (~nan & (w <= 0)).any():
        bad(~nan & (w <= 0), "must be above 0")
    return v


# iterations.csv: every column the replay reads (``n_waiting`` is checked when present).
STEP_TIMES = ("start_s", "end_s")
STEP_COUNTS = ("n_decode", "n_prefill_tokens", "n_prefill_seqs", "max_decode_context",
               "sum_decode_context", "n_running")


def read_iterations(path: str | Path) -> pd.DataFrame:
    """A run's step log (``iterations.csv``), checked before any work: the columns the
    replay reads present, at least one step, start and end times finite, at least 0,
    each step ending no earlier than it starts and starting no earlier than the one
    before it ended (steps in start order), counts and contexts whole numbers of at
    least 0. Anything else is a one-line ``LatsimError`` naming the file, the column
    and row, and the value. Times as floats, counts as int64."""
    path = Path(path)
    it = read_table(path, STEP_TIMES + STEP_COUNTS, "the step log")
    if it.empty:
        raise LatsimError("the step log has no steps", source=str(path))
    start = numeric_column(path, it, "start_s", minimum=0)
    end = numeric_column(path, it, "end_s", minimum=0)
    for c in STEP_COUNTS + (("n_waiting",) if "n_waiting" in it.columns else ()):
        it[c] = numeric_column(path, it, c, integer=True, minimum=0).astype(np.int64)
    if (end < start).any():
        i = int(np.flatnonzero(end < start)[0])
        raise LatsimError(f"the step ends before it starts (start_s {plain_value(start[i])})",
                          source=str(path), field=f"end_s (row {i + 1})",
                          value=plain_value(end[i]), has_value=True)
    if (np.diff(start) < 0).any():
        i = int(np.flatnonzero(np.diff(start) < 0)[0]) + 1
        raise LatsimError(f"steps not in increasing start order (the step before starts "
                          f"at {plain_value(start[i - 1])})", source=str(path),
                          field=f"start_s (row {i + 1})", value=plain_value(start[i]),
                          has_value=True)
    if (start[1:] < end[:-1]).any():
        i = int(np.flatnonzero(start[1:] < end[:-1])[0]) + 1
        raise LatsimError(f"the step starts before the one before it ended (at "
                          f"{plain_value(end[i - 1])})", source=str(path),
                          field=f"start_s (row {i + 1})", value=plain_value(start[i]),
                          has_value=True)
    it["start_s"] = start
    it["end_s"] = end
    return it


# The reference engine's aging interval (data/h200-refbench/README.md: waiting requests
# ordered by ``priority - floor(wait_s / 2.0)``).
REFBENCH_AGING = np.array([2.0])
_NO_LIMIT = 1 << 62       # running requests and free KV blocks: not what shaped a logged step


def _order_key(policy: str, arrival: float, prio: int, now: float) -> tuple:
    if policy == "priority":
        # The aging rule is latsim's own priority_aging order (one function for both).
        return (aging_key(int(prio), float(arrival), 0, float(now), REFBENCH_AGING), arrival)
    return (arrival,)


def read_run(folder: str | Path) -> RunSteps:
    """Read a run folder and rebuild every step's prefill chunks (module doc); its step
    log is checked first (``read_iterations``)."""
    folder = Path(folder)
    trace = pd.read_csv(folder / "trace.csv")
    reqs = pd.read_csv(folder / "requests.csv")
    toks = pd.read_csv(folder / "tokens.csv")
    it = read_iterations(folder / "iterations.csv")
    policy = str(reqs["policy"].iloc[0]) if "policy" in reqs.columns else "chunked"
    tr = trace.set_index("request_id")
    rid_all = tr.index.to_numpy()
    arrival = tr["arrival_s"].to_dict()
    prompt = tr["prompt_tokens"].to_dict()
    output = tr["output_tokens"].to_dict()
    prio = tr["priority"].to_dict() if "priority" in tr.columns else {r: 0 for r in rid_all}

    by_arrival = sorted(rid_all, key=lambda r: (arrival[r], r))
    nxt = 0                      # next request (in arrival order) not yet visible
    waiting: list = []           # visible, not started
    partial: list = []           # started, prompt not finished (in start order)
    prefilled: dict = {}
    decoding: dict = {}          # rid -> tokens emitted so far
    first_tok: dict = {}
    chunks_all = []
    bad_seqs = bad_dec = 0
    eps = 1e-9
    for row in it.itertuples(index=False):
        start = row.start_s
        while nxt < len(by_arrival) and arrival[by_arrival[nxt]] <= start + eps:
            waiting.append(by_arrival[nxt])
            nxt += 1
        # Decode side of this step: every decoding request, unless it is a fifo
        # prefill step (decodes pause while a whole prompt is prefilled).
        budget = int(row.n_prefill_tokens)
        dec_ids = list(decoding) if (row.n_decode or policy != "fifo" or budget == 0) else []
        ctxs = [prompt[r] + decoding[r] for r in dec_ids]
        if (len(dec_ids) != row.n_decode or (ctxs and (max(ctxs) != row.max_decode_context
                                                       or sum(ctxs) != row.sum_decode_context))):
            bad_dec += 1
        # Prefill side: the step's recorded prefill tokens given out by latsim's own
        # chunked fill rule (partially prefilled first, then new ones in policy order),
        # with no limit but those tokens: the engine's own limits shaped the step already.
        waiting.sort(key=lambda r: _order_key(policy, arrival[r], prio[r], start))
        pre_rem = np.array([prompt[r] - prefilled[r] for r in partial], np.int64)
        cand_rem = np.array([prompt[r] for r in waiting], np.int64)
        out_pre = np.zeros(len(partial), np.int64)
        out_cand = np.zeros(len(waiting), np.int64)
        _, npc, na, _ = fill_chunked(budget, max(budget, 1), _NO_LIMIT, 0, _NO_LIMIT, 0,
                                     pre_rem, len(partial), cand_rem,
                                     np.zeros(len(waiting), np.int64), len(waiting),
                                     out_pre, out_cand)
        given = [(partial[i], int(out_pre[i])) for i in range(npc)] + \
            [(waiting[j], int(out_cand[j])) for j in range(na)]
        chunks = []
        for r, n in given:
            p = prefilled.get(r, 0)
            done = p + n >= prompt[r]
            chunks.append((n, int(p), bool(done), int(r)))
            prefilled[r] = p + n
            budget -= n
        del waiting[:na]
        partial.extend(r for r, _ in given[npc:])
        partial[:] = [r for r in partial if prefilled[r] < prompt[r]]
        if len(chunks) != row.n_prefill_seqs or budget != 0:
            bad_seqs += 1
        chunks_all.append(chunks)
        # Apply: decodes emit one token each, finished prompts emit their first one.
        for r in dec_ids:
            decoding[r] += 1
            if decoding[r] >= output[r]:
                del decoding[r]
        for n, p, done, r in chunks:
            if done:
                first_tok[r] = row.end_s
                if output[r] > 1:
                    decoding[r] = 1
    real_first = toks[toks["token_index"] == 0].set_index("request_id")["time_s"]
    diffs = [abs(first_tok[r] - t) for r, t in real_first.items() if r in first_tok]
    n_ttft_bad = int(sum(d > 1e-5 for d in diffs)) + int(len(real_first) - len(diffs))
    steps = RunSteps(
        name=folder.name, policy=policy,
        start_s=it["start_s"].to_numpy(float), end_s=it["end_s"].to_numpy(float),
        nd=it["n_decode"].to_numpy(np.int64),
        ctx_max=it["max_decode_context"].to_numpy(np.int64),
        ctx_sum=it["sum_decode_context"].to_numpy(np.int64),
        n_running=it["n_running"].to_numpy(np.int64),
        chunks=chunks_all, trace=trace, requests=reqs, tokens=toks)
    steps.check = {"steps": len(it), "prefill_seq_mismatches": bad_seqs,
                   "decode_mismatches": bad_dec, "first_token_mismatches": n_ttft_bad,
                   "first_token_max_abs_s": float(max(diffs)) if diffs else 0.0}
    return steps


def real_metrics(run: RunSteps) -> dict:
    """TTFT, TPOT, ITL and E2E percentiles (ms) of the real run (``latency_metrics``)."""
    tok = run.tokens.rename(columns={"request_id": "rid", "token_index": "index",
                                     "time_s": "time"})
    return latency_metrics(dict(zip(run.trace["request_id"], run.trace["arrival_s"])), tok)


def latency_metrics(arrival: dict, tok: pd.DataFrame, n_tokens: Optional[dict] = None) -> dict:
    """TTFT, TPOT, ITL and E2E P50/P99 (ms) from every token's time (``tok``: ``rid,
    index, time``; a row may be a streamed frame) and each request's ``arrival``, as
    ``vllm bench serve`` defines them: TTFT = first token - arrival; TPOT = (last -
    first) / (n - 1) per request with n > 1, n its output tokens (``n_tokens``; else
    its rows, right only when each row is one token); ITL = every gap between
    a request's consecutive rows, pooled; E2E = last token - arrival; linear
    interpolation (NaN where there is no value)."""
    tok = tok.sort_values(["rid", "index"])
    g = tok.groupby("rid")["time"]
    first, last, n = g.first(), g.last(), g.count()
    if n_tokens is not None:
        n = pd.Series([int(n_tokens[r]) for r in n.index], index=n.index)
    arr = np.array([arrival[r] for r in first.index])
    ttft = first.to_numpy() - arr
    e2e = last.to_numpy() - arr
    m = (n > 1).to_numpy()
    tpot = ((last - first).to_numpy()[m] / (n.to_numpy()[m] - 1))
    t = tok["time"].to_numpy()
    r = tok["rid"].to_numpy()
    itl = np.diff(t)[r[1:] == r[:-1]]
    out = {}
    for name, v in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        out[f"median_{name}_ms"] = pct_ms(v, 50)
        out[f"p99_{name}_ms"] = pct_ms(v, 99)
    return out


def fit_bookkeeping(seqs, gaps_ms, max_gap_ms: float = 1.0) -> dict:
    """``gap = a + b * seqs`` by least squares over measured host gaps between busy
    steps (ms), each with the number of sequences (decodes and chunks) of the step
    before it; gaps above ``max_gap_ms`` (the engine idled, waiting for an arrival) are
    left out. Returns ``bookkeeping_ms`` (``a``), ``bookkeeping_seq_ms`` (``b``), both
    at least 0, and ``n`` (gaps used)."""
    x = np.asarray(seqs, float)
    y = np.asarray(gaps_ms, float)
    ok = np.isfinite(y) & (y < max_gap_ms) & (y >= 0)
    x, y = x[ok], y[ok]
    if len(y) < 3:
        return {"bookkeeping_ms": 0.0, "bookkeeping_seq_ms": 0.0, "n": int(len(y))}
    if np.ptp(x) == 0:
        a, b = float(np.mean(y)), 0.0
    else:
        a, b = np.linalg.lstsq(np.c_[np.ones_like(x), x], y, rcond=None)[0]
    if b < 0:
        # A gap that shrinks with the work done is not bookkeeping per sequence.
        a, b = float(np.mean(y)), 0.0
    return {"bookkeeping_ms": float(max(a, 0.0)), "bookkeeping_seq_ms": float(max(b, 0.0)),
            "n": int(len(y))}


def measure_bookkeeping(runs: list) -> dict:
    """Host time between steps (scheduling the next one, applying this one's results),
    which a profile's rows do not include: ``gap = a + b * (sequences in the step)``,
    least squares over every step's following gap (``fit_bookkeeping``; gaps above
    1 ms, when the engine idled waiting for an arrival, left out). Returns
    ``bookkeeping_ms`` (``a``) and ``bookkeeping_seq_ms`` (``b``)."""
    xs, ys = [], []
    for r in runs:
        xs.append(r.nd + np.array([len(ch) for ch in r.chunks]))
        ys.append(r.gap_s * 1e3)
    out = fit_bookkeeping(np.concatenate(xs), np.concatenate(ys))
    return {"bookkeeping_ms": out["bookkeeping_ms"],
            "bookkeeping_seq_ms": out["bookkeeping_seq_ms"]}


def step_arrays(run: RunSteps) -> tuple:
    """A run's steps as the kernel's arguments: ``nd, ctx_max, ctx_sum`` and padded
    ``chn, chp, chf`` (one row per step) with the chunk counts ``nch``."""
    return (run.nd, run.ctx_max, run.ctx_sum) + chunk_arrays(run.chunks)


def chunk_arrays(chunks: list) -> tuple:
    """Steps' prefill chunks (a list per step of ``(n, prior, completes, ...)``) as the
    kernels take them: ``chn, chp, chf`` padded to the most chunks of a step (one row
    per step), and the chunk counts ``nch``."""
    n = len(chunks)
    w = max(1, max((len(ch) for ch in chunks), default=1))
    chn = np.zeros((n, w), np.int64)
    chp = np.zeros((n, w), np.int64)
    chf = np.zeros((n, w), np.bool_)
    nch = np.zeros(n, np.int64)
    for i, ch in enumerate(chunks):
        nch[i] = len(ch)
        for j, c in enumerate(ch):
            chn[i, j], chp[i, j], chf[i, j] = c[0], c[1], c[2]
    return chn, chp, chf, nch


def predict_steps(c: np.ndarray, run: RunSteps, *, core: bool = True) -> np.ndarray:
    """A physics model's milliseconds for every recorded step of ``run`` (``core``:
    the step itself, without bookkeeping or scale, as ``iterations.csv`` times it)."""
    from simulator.cost import physics as ph

    nd, cm, cs, chn, chp, chf, nch = step_arrays(run)
    out = np.empty(len(nd))
    for i in range(len(nd)):
        if core:
            out[i] = ph.step_core_ms(c, int(nd[i]), int(cm[i]), int(cs[i]), chn[i], chp[i],
                                     chf[i], int(nch[i]), False)
        else:
            out[i] = ph.step_ms(c, int(nd[i]), int(cm[i]), int(cs[i]), chn[i], chp[i],
                                chf[i], int(nch[i]))
    return out


def decode_samples(run: RunSteps, skip: int = 40) -> tuple:
    """A run's decode-only steps (after the first ``skip``, warm-up) as
    ``(nd, ctx_max, ctx_sum, measured_ms, extra_ms)``: what ``score_decode_waves``
    reads. ``extra_ms`` is what the measurement holds beyond the step itself (none
    here: ``iterations.csv`` times the step alone)."""
    dec = np.array([not ch for ch in run.chunks]) & (run.nd > 0)
    dec[:skip] = False
    idx = np.where(dec)[0]
    return (run.nd[idx], run.ctx_max[idx], run.ctx_sum[idx], run.dur_s[idx] * 1e3,
            np.zeros(len(idx)))


def score_decode_waves(samples: list, profile: dict, *, blocks=(2, 3, 4, 6, 8),
                       costs=(0.25, 0.5, 0.625, 0.75, 1.0)) -> dict:
    """Where decode attention spills into a further wave, from measured decode-only
    steps (``samples``: one ``decode_samples``-shaped tuple per run): for each
    candidate (blocks per SM, wave cost) and for none, the profile is refitted with it
    and its error on the steps is measured as the mean over batch sizes of the median
    log error at that batch size, less its median over batch sizes (every batch size
    counts once, so the cliffs between them decide, not the level); the score of several runs is their mean. Returns
    ``decode_blocks_per_sm`` (0: none) and ``decode_wave_cost`` with the score of each
    candidate."""
    import copy

    from simulator.cost import physics as ph
    from simulator.cost.fit import fit

    z = np.zeros(1, np.int64)
    f = np.zeros(1, np.bool_)

    def score(c):
        errs = []
        for nd, cm, cs, meas, extra in samples:
            if not len(nd):
                continue
            m = np.array([ph.step_core_ms(c, int(a), int(b), int(d), z, z, f, 0, False)
                          for a, b, d in zip(nd, cm, cs)]) + extra
            df = pd.DataFrame({"nd": nd, "lr": np.log(m / meas)})
            by = df.groupby("nd")["lr"].median()
            # Centred: a level the refit will move anyway (host time, efficiency off
            # by a few percent) must not pick the cliffs; only how the error changes
            # from one batch size to the next does.
            errs.append(np.abs(by - by.median()).mean())
        return float(np.mean(errs)) if errs else float("nan")

    scores = {}
    for occ, kappa in [(0, 1.0)] + [(b, k) for b in blocks for k in costs]:
        p = copy.deepcopy(profile)
        p.setdefault("engine", {})["decode_blocks_per_sm"] = occ
        p["engine"]["decode_wave_cost"] = kappa
        scores[(occ, kappa)] = score(fit(p, cv=False).c)
    best = min(scores, key=scores.get)
    return {"decode_blocks_per_sm": best[0], "decode_wave_cost": best[1],
            "scores": {f"{k[0]}x{k[1]}": round(v, 5) for k, v in scores.items()}}


def measure_decode_waves(runs: list, profile: dict, *, blocks=(2, 3, 4, 6, 8),
                         costs=(0.25, 0.5, 0.625, 0.75, 1.0), skip: int = 40) -> dict:
    """Where decode attention spills into a further wave, from the recorded decode-only
    steps of ``runs`` (``score_decode_waves`` on their ``decode_samples``). The
    profile's own batch grid cannot place a cliff when it only has powers of two;
    serving steps of every batch size can."""
    return score_decode_waves([decode_samples(r, skip) for r in runs], profile,
                              blocks=blocks, costs=costs)


def step_cells(run: RunSteps) -> np.ndarray:
    """A label per step grouping steps alike in composition (``cell_labels``)."""
    return cell_labels(run.kinds(), run.nd, run.ctx_max, run.chunks)


def cell_labels(kinds, nd, ctx_max, chunks) -> np.ndarray:
    """A label per step grouping steps alike in composition: its kind, decode batch (in
    eights), longest context (in 512s) and prefill tokens (in 256s, from its
    ``chunks``)."""
    tok = np.array([sum(c[0] for c in ch) for ch in chunks], np.int64)
    return np.array([f"{k}|{a}|{b}|{t}" for k, a, b, t in
                     zip(kinds, np.asarray(nd) // 8, np.asarray(ctx_max) // 512, tok // 256)])


def completes_mask(run: RunSteps) -> np.ndarray:
    """Whether each step finishes some prompt (emits a request's first token)."""
    return np.array([any(c[2] for c in ch) for ch in run.chunks])
