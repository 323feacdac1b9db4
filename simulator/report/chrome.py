"""A run's decision trace as a Chrome trace (``chrome://tracing``, Perfetto's legacy JSON
``traceEvents`` format): ``chrome_trace(res, trace) -> dict``, written by ``latsim run
--chrome-trace`` as ``trace.json`` in the results folder.

Tracks (``pid`` / ``tid``):

- process 0, "requests": a thread per traced request, its stages as complete events
  (``ph: X``) back to back: ``net`` (arrival to the replica's queue: the wire, the
  gateway, retries and backoff), ``queue``, ``prefill`` (to the first token), ``decode``
  (to the last token) and ``stream`` (to the last byte delivered), each with its exact
  length in seconds in ``args.seconds`` (the ``t_*`` columns of ``requests.csv``:
  ``metrics.add_derived``), and instant events (``ph: i``) for each reason it waited
  (``report.decisions``: the reason, the steps it held, the numbers) and for a refusal
  by admission control (``reject_reason``);
- process ``r + 1``, "replica r": its steps (or decode epochs: ``args.steps``) with
  their batch: decodes, prefill chunks ``[rid, tokens]``, admissions.

Times are microseconds from the start of the run, as the format wants.
"""
from __future__ import annotations

import bisect
import math

from simulator.report.decisions import DecisionTrace

__all__ = ["chrome_trace", "STAGES"]

# (stage, from, to): the additive breakdown (``metrics.add_derived``).
STAGES = (("net", "arrival", "enqueued"), ("queue", "enqueued", "scheduled"),
          ("prefill", "scheduled", "first_token"), ("decode", "first_token", "last_token"),
          ("stream", "last_token", "last_delivered"))
US = 1e6


def _meta(pid: int, name: str, tid=None, thread: str = "") -> dict:
    if tid is None:
        return {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}}


def _step_counter(trace: DecisionTrace):
    """``steps_in(replica, t0, t1)``: engine steps the replica started in ``[t0, t1)``."""
    by_rep: dict = {}
    for r, start, _secs, _nd, _pre, _adm, steps in trace.steps:
        by_rep.setdefault(r, ([], [0]))
        by_rep[r][0].append(start)
        by_rep[r][1].append(by_rep[r][1][-1] + steps)

    def steps_in(replica: int, t0: float, t1: float) -> int:
        starts, cum = by_rep.get(replica, ([], [0]))
        return cum[bisect.bisect_left(starts, t1)] - cum[bisect.bisect_left(starts, t0)]
    return steps_in


def _request_events(res, trace: DecisionTrace, rid: int, cls: str, steps_in) -> list[dict]:
    rec = res.rec
    ev = [_meta(0, "", rid, f"request {rid} ({cls})")]
    for stage, a, b in STAGES:
        t0, t1 = float(getattr(rec, a)[rid]), float(getattr(rec, b)[rid])
        if math.isnan(t0) or math.isnan(t1):
            continue
        args = {"seconds": t1 - t0}
        if stage == "net":
            args.update(attempts=int(rec.attempts[rid]), retry_s=float(rec.retry_s[rid]))
        if stage == "prefill":
            args.update(replica=int(rec.replica[rid]), cached_tokens=int(rec.cached_tokens[rid]))
        ev.append({"ph": "X", "cat": "stage", "name": stage, "pid": 0, "tid": rid,
                   "ts": t0 * US, "dur": (t1 - t0) * US, "args": args})
    recs = trace.records(rid)
    t_next_admit = float(rec.scheduled[rid])
    if math.isnan(t_next_admit):
        t_next_admit = float(res.sim_end)
    # From joining the queue to the first decision that saw it: the step (or decode
    # epoch) in progress ran on; the engine decides at step boundaries.
    t_enq, t_next = float(rec.enqueued[rid]), float(rec.scheduled[rid])
    if recs:
        t_next = min(t_next, recs[0]["t"]) if not math.isnan(t_next) else recs[0]["t"]
    if not math.isnan(t_enq) and not math.isnan(t_next) and t_next > t_enq:
        ev.append({"ph": "i", "s": "t", "cat": "wait", "name": "waits: step in progress",
                   "pid": 0, "tid": rid, "ts": t_enq * US,
                   "args": {"until_s": t_next, "text": "the engine decides at step "
                                                        "boundaries"}})
    for i, r in enumerate(recs):
        # It waits so until the next record, or its admission: the steps (and decode
        # epochs' steps) its replica ran meanwhile, and the decisions that passed it over.
        until = recs[i + 1]["t"] if i + 1 < len(recs) else t_next_admit
        args = {"decisions": r["steps"], "steps": steps_in(r["replica"], r["t"], until),
                "replica": r["replica"], "until_s": until, **r["detail"]}
        ev.append({"ph": "i", "s": "t", "cat": "wait", "name": f"waits: {r['reason']}",
                   "pid": 0, "tid": rid, "ts": r["t"] * US, "args": args})
    reason = int(rec.reject_reason[rid]) if rec.reject_reason is not None else -1
    if reason >= 0:
        from simulator.cluster.admission import REASONS
        t = float(rec.arrival[rid]) + float(rec.retry_s[rid])
        ev.append({"ph": "i", "s": "t", "cat": "admission",
                   "name": f"refused: {REASONS[reason]}", "pid": 0, "tid": rid, "ts": t * US,
                   "args": {"attempts": int(rec.attempts[rid])}})
    return ev


def chrome_trace(res, trace: DecisionTrace) -> dict:
    """The Chrome trace of a run filled with ``trace`` (module doc)."""
    wl = res.workload
    names = list(wl.class_names) or ["P0"]
    ids = range(res.rec.n) if trace.ids is None else sorted(i for i in trace.ids
                                                            if 0 <= i < res.rec.n)
    events = [_meta(0, "requests")]
    steps_in = _step_counter(trace)
    for rid in ids:
        p = int(wl.priority[rid])
        events += _request_events(res, trace, rid, names[min(p, len(names) - 1)], steps_in)
    reps = sorted({s[0] for s in trace.steps})
    for r in reps:
        events.append(_meta(r + 1, f"replica {r}"))
        events.append(_meta(r + 1, "", 0, "steps"))
    for r, start, secs, nd, prefill, admit, steps in trace.steps:
        name = "step" if steps == 1 else f"decode epoch ({steps} steps)"
        events.append({"ph": "X", "cat": "step", "name": name, "pid": r + 1, "tid": 0,
                       "ts": start * US, "dur": secs * US,
                       "args": {"seconds": secs, "steps": steps, "decode": nd,
                                "prefill": [list(c) for c in prefill], "admit": list(admit)}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"scenario": res.scenario.name, "seed": int(res.seed),
                          "policy": res.policy,
                          "traced_requests": None if trace.ids is None else len(ids)}}


def parse_ids(text: str, source: str = "--trace-requests") -> list[int]:
    """``"3,17,42"`` as request ids (a one-line error naming the option otherwise)."""
    from simulator.errors import LatsimError
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise LatsimError("must be request ids (comma-separated integers >= 0)",
                              source=source, value=part, has_value=True)
        out.append(int(part))
    if not out:
        raise LatsimError("give at least one request id", source=source, value=text,
                          has_value=True)
    return out


def write_chrome_trace(res, trace: DecisionTrace, path) -> None:
    """``chrome_trace`` as JSON at ``path`` (NaN as null)."""
    import json
    from simulator.report.files import json_safe
    with open(path, "w", encoding="utf-8") as f:
        json.dump(json_safe(chrome_trace(res, trace)), f, separators=(",", ":"))
