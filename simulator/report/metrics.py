"""Metrics with ``vllm bench serve`` names, the additive breakdown, goodput and
the seeds' bottleneck diagnosis.

Per request (seconds): ``t_net = enqueued - arrival``, ``t_queue = scheduled -
enqueued``, ``t_prefill = first_token - scheduled``, ``t_decode = last_token -
first_token``, ``t_stream = last_delivered - last_token``; they add up to
``e2el = last_delivered - arrival``. ``ttft = first_delivered - arrival``;
``tpot = (last_delivered - first_delivered) / (N - 1)`` for N > 1 output tokens;
ITL is every gap between delivered tokens, pooled over requests.

Summaries are in ms as ``mean_/median_/p90_/p99_<metric>_ms``, throughputs per
second over the benchmark duration (first arrival to last delivery), and goodput
counts requests meeting their class's SLO.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd

from simulator.report.recorder import TIMESTAMPS, ItlHistogram

PCTS = (("mean", None), ("median", 50), ("p90", 90), ("p99", 99))
BREAKDOWN = ("t_net", "t_queue", "t_prefill", "t_decode", "t_stream")
LATENCIES = ("ttft", "tpot", "e2el")


def requests_table(res) -> pd.DataFrame:
    """One row per request: inputs, timestamps, breakdown and latencies (seconds)."""
    rec, wl = res.rec, res.workload
    names = np.array(wl.class_names, dtype=object)
    prio = wl.priority
    cls = names[np.minimum(prio, len(names) - 1)] if len(names) else prio
    df = pd.DataFrame({
        "rid": np.arange(rec.n),
        "priority": prio,
        "class": cls,
        "prompt_tokens": wl.prompt_tokens,
        "output_tokens": wl.output_tokens,
        "replica": rec.replica,
        "new_connection": rec.new_connection,
    })
    for name in TIMESTAMPS:
        df[name] = getattr(rec, name)
    df["finished"] = ~np.isnan(df["last_delivered"].to_numpy())
    df["rejected"] = rec.rejected
    df["cancelled"] = rec.cancelled
    df["cached_tokens"] = rec.cached_tokens
    df["preemptions"] = rec.preemptions
    df["recomputed_tokens"] = rec.recomputed_tokens
    df["swapped_bytes"] = rec.swapped_bytes
    df["preempted_s"] = rec.preempted_s
    add_derived(df)
    return df


def add_derived(df: pd.DataFrame) -> pd.DataFrame:
    """Add the breakdown and latency columns from the timestamp columns (in place)."""
    df["t_net"] = df["enqueued"] - df["arrival"]
    df["t_queue"] = df["scheduled"] - df["enqueued"]
    df["t_prefill"] = df["first_token"] - df["scheduled"]
    df["t_decode"] = df["last_token"] - df["first_token"]
    df["t_stream"] = df["last_delivered"] - df["last_token"]
    df["ttft"] = df["first_delivered"] - df["arrival"]
    n = df["output_tokens"].to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        df["tpot"] = np.where(n > 1, (df["last_delivered"] - df["first_delivered"]) / (n - 1),
                              np.nan)
    df["e2el"] = df["last_delivered"] - df["arrival"]
    return df


def _stats(x: np.ndarray, prefix: str, out: dict) -> None:
    x = x[~np.isnan(x)]
    for label, q in PCTS:
        if len(x) == 0:
            v = float("nan")
        elif q is None:
            v = float(x.mean())
        else:
            v = float(np.percentile(x, q))
        out[f"{label}_{prefix}_ms"] = v * 1000.0


def _slo_mask(df: pd.DataFrame, slos: dict) -> np.ndarray:
    """True where a finished request meets its class's SLO (absent bounds always pass)."""
    ok = df["finished"].to_numpy().copy()
    cls = df["class"].to_numpy()
    for name, slo in slos.items():
        if slo is None:
            continue
        m = cls == name
        for metric in ("ttft", "tpot", "e2el"):
            bound = getattr(slo, f"{metric}_ms", None)
            if bound is None:
                continue
            v = df[metric].to_numpy() * 1000.0
            fail = m & ~(np.nan_to_num(v, nan=0.0) <= bound)
            ok &= ~fail
    return ok


def class_slos(scenario) -> dict:
    """SLO per class name: the class's own, else the scenario's default."""
    classes = getattr(scenario.workload, "classes", None) or []
    out = {c.name: (c.slo or scenario.slo) for c in classes}
    return out


def summarize(df: pd.DataFrame, itl: Optional[ItlHistogram], scenario=None,
              slos: Optional[dict] = None) -> dict:
    """Summary metrics over ``df`` (vLLM names, ms) plus breakdown means and P99s."""
    fin = df[df["finished"]]
    out: dict = {
        "num_requests": int(len(df)),
        "completed": int(len(fin)),
        "not_finished": int(len(df) - len(fin)),
        "rejected": int(df["rejected"].sum()) if "rejected" in df else 0,
        "total_input_tokens": int(fin["prompt_tokens"].sum()),
        "total_output_tokens": int(fin["output_tokens"].sum()),
    }
    if len(fin):
        duration = float(fin["last_delivered"].max() - df["arrival"].min())
    else:
        duration = float("nan")
    out["duration_s"] = duration
    dur = duration if duration and duration > 0 else float("nan")
    out["request_throughput"] = len(fin) / dur
    out["output_throughput"] = out["total_output_tokens"] / dur
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / dur
    for m in LATENCIES:
        _stats(fin[m].to_numpy(dtype=float), m, out)
    if itl is not None and itl.n:
        out["mean_itl_ms"] = itl.mean * 1000.0
        for label, q in PCTS[1:]:
            out[f"{label}_itl_ms"] = itl.quantile(q / 100.0) * 1000.0
    else:
        for label, _ in PCTS:
            out[f"{label}_itl_ms"] = float("nan")
    for b in BREAKDOWN:
        x = fin[b].to_numpy(dtype=float)
        out[f"mean_{b}_ms"] = float(x.mean()) * 1000.0 if len(x) else float("nan")
        out[f"p99_{b}_ms"] = float(np.percentile(x, 99)) * 1000.0 if len(x) else float("nan")
    if slos is None and scenario is not None:
        slos = class_slos(scenario)
    if slos:
        good = _slo_mask(df, slos)
        out["good_requests"] = int(good.sum())
        out["request_goodput"] = float(good.sum()) / dur
    out["diagnosis"] = diagnose(out) if len(fin) else "no_completed_requests"
    return out


def diagnose(s: dict, queue_ms: float = 100.0, ttft_ms: float = 500.0,
             jitter: float = 2.0) -> str:
    """The seeds' bottleneck rule: queueing, then prefill, then decode jitter, else healthy."""
    if s.get("mean_t_queue_ms", 0) > queue_ms:
        return "queue_saturation"
    if s.get("median_ttft_ms", 0) > ttft_ms:
        return "prefill_bottleneck"
    p50, p99 = s.get("median_tpot_ms"), s.get("p99_tpot_ms")
    if p50 and p99 and not math.isnan(p50) and p99 > jitter * p50:
        return "decode_jitter"
    return "healthy"


def per_class(df: pd.DataFrame, scenario=None) -> dict:
    """Latency summary per priority class (no ITL: it is pooled run-wide)."""
    out = {}
    slos = class_slos(scenario) if scenario is not None else {}
    for name, g in df.groupby("class", sort=True):
        out[str(name)] = summarize(g, None, slos={k: v for k, v in slos.items() if k == name})
    return out


def batch_share_seconds(ts, running, t0: float, t1: float) -> float:
    """``integral from t0 to t1 of dt / B(t)``: the time one running request held, as a
    share of its replica, when ``B(t)`` requests ran there. ``B`` is piecewise constant
    from a replica's time series (``ts``: sample times; ``running``: the batch right
    after each sample; before the first sample, and at 0, it counts as 1, the request
    itself)."""
    if not t1 > t0:
        return 0.0
    ts = np.asarray(ts, dtype=np.float64)
    run = np.maximum(np.asarray(running, dtype=np.float64), 1.0)
    inner = ts[(ts > t0) & (ts < t1)]
    edges = np.concatenate(([t0], inner, [t1]))
    idx = np.searchsorted(ts, edges[:-1], side="right") - 1
    b = np.where(idx >= 0, run[np.maximum(idx, 0)] if len(run) else 1.0, 1.0)
    return float(np.sum(np.diff(edges) / b))
