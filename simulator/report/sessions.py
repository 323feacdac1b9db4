"""Per-session metrics of a closed-loop run (``kind: sessions``): the ``sessions.csv``
table (one row per session) and the ``sessions`` section of ``summary.json``.

A session's **time to last turn** is from its first request's send to its last
request's last byte: the sum of its requests' E2E latencies and the think and tool
times between them (exactly, by construction of the closed loop). Its TTFT is the
mean TTFT of its requests. Summaries follow ``vllm bench serve``'s names
(``mean_/median_/p90_/p99_<metric>_ms``) over completed sessions.

``response_time_law`` puts the run beside the interactive response-time law
(Denning & Buzen 1978; Jain, *The Art of Computer Systems Performance Analysis*,
ch. 33): with ``N`` users, mean response time ``R`` (E2E) and mean think time ``Z``
(every delay before a request: think, tool, session gap, ramp offset), throughput
``X = N / (R + Z)`` while every user stays in the loop; ``throughput`` is completed
requests over the run (time 0 to the last byte). Users whose sessions are over leave
the loop, so ``X (R + Z)`` equals ``mean_active_users`` (the users in the loop,
averaged over the run), which approaches ``N`` as the run grows long against the
spread of the users' end times.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simulator.report.metrics import PCTS
from simulator.report.percentile import pct_ms
from simulator.workload.sessions import GAP_THINK, GAP_TOOL, SessionPlan

OUTCOMES = ("completed", "aborted", "unfinished")


def session_table(plan: SessionPlan, rec, aborted: np.ndarray, prompt) -> pd.DataFrame:
    """One row per session (module doc); times in seconds, NaN where not reached.
    ``prompt``: each request's prompt tokens (the workload's)."""
    sid = plan.session
    n_s = plan.n_sessions
    arr, last = rec.arrival, rec.last_delivered
    done = ~np.isnan(last)
    first, n_req = plan.s_first, plan.s_requests
    last_rid = first + n_req - 1
    ttft = rec.first_delivered - arr
    e2el = last - arr

    def per(x, mask=None):
        m = done if mask is None else mask
        return np.bincount(sid[m], weights=x[m], minlength=n_s)
    n_done = np.bincount(sid[done], minlength=n_s)
    sent = np.bincount(sid[~np.isnan(arr)], minlength=n_s)
    complete = n_done == n_req
    outcome = np.where(complete, "completed", np.where(aborted, "aborted", "unfinished"))
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_ttft = per(np.nan_to_num(ttft)) / n_done
    sent_mask = ~np.isnan(arr)
    gap = np.where(sent_mask, plan.gap_s, 0.0)
    return pd.DataFrame({
        "session": np.arange(n_s), "user": plan.s_user, "mode": plan.mode,
        "turns": plan.s_turns, "requests": n_req, "requests_sent": sent,
        "requests_completed": n_done, "first_rid": first, "outcome": outcome,
        "start_s": arr[first], "end_s": np.where(complete, last[last_rid], np.nan),
        "time_to_last_turn_s": np.where(complete, last[last_rid] - arr[first], np.nan),
        "e2el_sum_s": per(np.nan_to_num(e2el)),
        "think_s": np.bincount(sid, weights=np.where(plan.gap_kind == GAP_THINK, gap, 0.0),
                               minlength=n_s),
        "tool_s": np.bincount(sid, weights=np.where(plan.gap_kind == GAP_TOOL, gap, 0.0),
                              minlength=n_s),
        "mean_ttft_s": np.where(n_done > 0, mean_ttft, np.nan),
        "prompt_tokens_last": np.asarray(prompt, dtype=np.int64)[last_rid],
        "cached_tokens": np.bincount(sid, weights=rec.cached_tokens.astype(float),
                                     minlength=n_s).astype(np.int64),
    })


def _stats(x: np.ndarray, name: str, out: dict) -> None:
    x = x[~np.isnan(x)]
    for label, q in PCTS:
        out[f"{label}_{name}_ms"] = (math.nan if not len(x) else
                                     float(x.mean()) * 1e3 if q is None else pct_ms(x, q))


def law(plan: SessionPlan, rec) -> dict:
    """The run beside the interactive response-time law (module doc)."""
    arr, last = rec.arrival, rec.last_delivered
    done = ~np.isnan(last)
    delay = plan.delays
    r = float(np.mean(last[done] - arr[done])) if done.any() else math.nan
    z = float(np.mean(delay[done])) if done.any() else math.nan
    span = float(np.max(last[done])) if done.any() else math.nan
    x = float(done.sum()) / span if span and span > 0 else math.nan
    # Each user's last byte: after it the user is out of the loop, so the law's N is,
    # over the run, the mean number of users still in it (``mean_active_users``).
    user = plan.s_user[plan.session]
    ends = np.zeros(plan.users)
    np.maximum.at(ends, user[done], last[done])
    n = min(plan.users, plan.n_sessions)     # users with a session to run
    return {"users": n, "throughput": x, "mean_response_s": r, "mean_think_s": z,
            "law_throughput": n / (r + z) if r + z > 0 else math.nan,
            "mean_active_users": float(ends.sum() / span) if span and span > 0 else math.nan}


def session_summary(table: pd.DataFrame, plan: SessionPlan, rec) -> dict:
    """``summary.json``'s ``sessions`` section."""
    ok = table["outcome"].to_numpy() == "completed"
    out = {"users": plan.users, "sessions": len(table), "mode": plan.mode}
    for o in OUTCOMES:
        out[f"sessions_{o}"] = int((table["outcome"] == o).sum())
    done = table[ok]
    out["mean_turns_per_session"] = float(done["turns"].mean()) if ok.any() else math.nan
    out["mean_requests_per_session"] = float(done["requests"].mean()) if ok.any() else math.nan
    _stats(done["time_to_last_turn_s"].to_numpy(float), "time_to_last_turn", out)
    _stats(done["mean_ttft_s"].to_numpy(float), "session_ttft", out)
    gaps = plan.gap_s[~np.isnan(rec.arrival)]
    kinds = plan.gap_kind[~np.isnan(rec.arrival)]
    out["mean_think_time_ms"] = _mean_ms(gaps[kinds == GAP_THINK])
    out["mean_tool_time_ms"] = _mean_ms(gaps[kinds == GAP_TOOL])
    out["response_time_law"] = law(plan, rec)
    return out


def _mean_ms(x: np.ndarray) -> float:
    return float(x.mean()) * 1e3 if len(x) else math.nan


def session_meta(plan: SessionPlan, rec, aborted: np.ndarray, prompt) -> dict:
    """What a sessions run adds to ``Results.meta``: the table and its summary."""
    table = session_table(plan, rec, aborted, prompt)
    return {"sessions": session_summary(table, plan, rec), "session_table": table}


CONSOLE_ROWS = (
    ("sessions_completed", "sessions completed"), ("sessions_aborted", "sessions aborted"),
    ("sessions_unfinished", "sessions unfinished"),
    ("mean_turns_per_session", "turns per session"),
    ("mean_requests_per_session", "requests per session"),
    ("median_time_to_last_turn_ms", "time to last turn P50 (ms)"),
    ("p99_time_to_last_turn_ms", "time to last turn P99 (ms)"),
    ("median_session_ttft_ms", "session TTFT P50 (ms)"),
    ("p99_session_ttft_ms", "session TTFT P99 (ms)"),
    ("mean_think_time_ms", "mean think time (ms)"), ("mean_tool_time_ms", "mean tool time (ms)"),
)


def sessions_console_table(outs: dict):
    """The console table of the runs' ``sessions`` sections, one column per run, with the
    response-time law's prediction beside the measured throughput."""
    from rich.table import Table

    from simulator.report.cells import fmt
    t = Table(title="Sessions (closed-loop users)", title_justify="left")
    t.add_column("")
    for name in outs:
        t.add_column(name, justify="right")
    sess = [o.get("sessions", {}) for o in outs.values()]
    for key, label in CONSOLE_ROWS:
        t.add_row(label, *[fmt(s.get(key)) for s in sess])
    law_rows = (("throughput", "requests/s"), ("law_throughput", "users / (E2E + think)"),
                ("mean_active_users", "users in the loop, mean"))
    for key, label in law_rows:
        t.add_row(label, *[fmt(s.get("response_time_law", {}).get(key)) for s in sess])
    return t
