"""Metrics with ``vllm bench serve`` names, the additive breakdown, goodput and
a bottleneck diagnosis (``data/README.md``, *Facts from two design articles*).

Per request (seconds): ``t_net = enqueued - arrival``, ``t_queue = scheduled -
enqueued``, ``t_prefill = first_token - scheduled``, ``t_decode = last_token -
first_token``, ``t_stream = last_delivered - last_token``; they add up to
``e2el = last_delivered - arrival``. ``ttft = first_delivered - arrival``;
``tpot = (last_delivered - first_delivered) / (N - 1)`` for N > 1 output tokens;
ITL is every gap between delivered tokens, pooled over requests (with speculative
decoding the tokens of one step arrive together: every token after a step's first one
has a gap of 0).

Summaries are in ms as ``mean_/median_/p90_/p99_<metric>_ms``, throughputs per
second over the benchmark duration (first arrival to last delivery), and goodput
counts requests meeting their class's SLO.

Traffic control (``cluster.gateway``): a request's row is its last attempt, ``arrival``
its first send (so its latencies are what its user saw, retries included, and
``retry_s`` is the part of ``t_net`` spent on earlier attempts and backoff). Requests
refused by admission control or given up by their clients are not completed: they
are in ``rejected`` / ``rejected_by_reason`` and ``timed_out``, missing from the
latency percentiles (which are of completed requests) and failures for goodput and
``slo_attainment`` (good requests / all requests). ``wait_estimate`` is the queue wait
the server published at admission; its error is ``wait_estimate - t_queue``.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd

from simulator.cluster.admission import REASONS
from simulator.report.percentile import pct_ms
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
    if rec.spec_steps is not None:
        # Speculative decoding: verify steps the request took part in, and the mean
        # tokens one of them gave it (its accepted length + 1).
        df["spec_steps"] = rec.spec_steps
        with np.errstate(invalid="ignore", divide="ignore"):
            df["tokens_per_step"] = np.where(rec.spec_steps > 0, rec.spec_tokens
                                             / np.maximum(rec.spec_steps, 1), np.nan)
    if rec.kv_load_s is not None:
        # A CPU tier (``model.kv.offload``): prompt tokens loaded from it (their prefill
        # skipped, counted in ``cached_tokens`` too) and the part of t_prefill the copy took.
        df["loaded_tokens"] = rec.loaded_tokens
        df["kv_load_s"] = rec.kv_load_s
    # Disaggregated serving: the parts of t_decode spent waiting to be taken in by a
    # decode replica and moving the KV there, the bytes moved, and which replica.
    for name in rec.disagg_columns:
        df[name] = getattr(rec, name)
    for name in getattr(rec, "edge_columns", ()):   # an edge node: how it was answered
        df[name] = getattr(rec, name)
    add_traffic_columns(df, rec)
    add_derived(df)
    df["wait_error"] = df["wait_estimate"] - df["t_queue"]
    return df


OUTCOMES = ("completed", "rejected", "timed_out", "cancelled", "unfinished", "failed")


def outcome_names(rec) -> np.ndarray:
    """How each request ended, exactly one of (``summary.json`` ``outcomes`` counts them):

    - ``completed``: its last byte reached its client;
    - ``rejected``: too large for the KV cache (413), or refused by admission control
      (429 rate/queue/wait limit, 503 shed) on its last attempt, retries exhausted;
    - ``timed_out``: its client stopped waiting because one of its own timers fired
      (``client``: connect or read timeout on its last attempt, or its deadline); the
      server then cancelled the attempt where it was (dropped from the queue, its KV
      freed at the next step boundary);
    - ``cancelled``: its client disconnected for a reason of its own, not a timeout
      (``stream.disconnect``: the per-request stream model's disconnects); the server
      cancelled it as above. The traffic model's clients only time out, so a run with
      ``client``/``cluster.admission``/autoscaling has no ``cancelled`` requests;
    - ``failed``: lost to a replica failure (``cluster.faults``: in flight on it, or
      sent to it while it was down, and not retried);
    - ``unfinished``: still queued or running when the clock stopped
      (``max_sim_time_s``)."""
    out = np.full(rec.n, "unfinished", dtype=object)
    out[rec.cancelled] = "cancelled"
    out[rec.timed_out] = "timed_out"
    out[rec.rejected | rec.refused] = "rejected"
    out[rec.failed] = "failed"
    out[~np.isnan(rec.last_delivered)] = "completed"
    return out


def add_traffic_columns(df: pd.DataFrame, rec) -> pd.DataFrame:
    """The traffic-control columns of the per-request table (see module doc)."""
    df["outcome"] = outcome_names(rec)
    names = np.array(REASONS + ("",), dtype=object)
    df["reject_reason"] = names[np.where(rec.reject_reason >= 0, rec.reject_reason, -1)]
    df["refused"] = rec.refused
    df["timed_out"] = rec.timed_out
    df["failed"] = rec.failed
    df["attempts"] = rec.attempts
    df["timeout_retries"] = rec.timeout_retries
    df["retry_s"] = rec.retry_s
    df["wait_estimate"] = rec.wait_estimate
    df["wait_estimate_p99"] = rec.wait_estimate_p99
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
            v = math.nan
        elif q is None:
            v = float(x.mean()) * 1000.0
        else:
            v = pct_ms(x, q)
        out[f"{label}_{prefix}_ms"] = v


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


def good_mask(df: pd.DataFrame, scenario) -> Optional[np.ndarray]:
    """Which requests completed within their class's SLO (None: no class has one)."""
    slos = class_slos(scenario)
    return _slo_mask(df, slos) if slos else None


def class_slos(scenario) -> dict:
    """SLO per class name: the class's own, else the scenario's default."""
    classes = getattr(scenario.workload, "classes", None) or []
    out = {c.name: (c.slo or scenario.slo) for c in classes}
    return out


def summarize(df: pd.DataFrame, itl: Optional[ItlHistogram], scenario=None,
              slos: Optional[dict] = None, rows: Optional[np.ndarray] = None) -> dict:
    """Summary metrics over ``df`` (vLLM names, ms) plus breakdown means and P99s.
    ``rows``: a boolean mask, to summarise those rows only. The table is read column by
    column through masks, never copied whole (a million-request run stays small)."""
    keep = np.ones(len(df), dtype=bool) if rows is None else np.asarray(rows, dtype=bool)
    fin_mask = df["finished"].to_numpy(dtype=bool) & keep

    def fin(col: str, dtype=None) -> np.ndarray:
        return df[col].to_numpy(dtype=dtype)[fin_mask]

    n_rows, n_fin = int(keep.sum()), int(fin_mask.sum())
    out: dict = {
        "num_requests": n_rows,
        "completed": n_fin,
        "not_finished": n_rows - n_fin,
        "rejected": int(df["rejected"].to_numpy()[keep].sum()) if "rejected" in df else 0,
        "total_input_tokens": int(fin("prompt_tokens").sum()),
        "total_output_tokens": int(fin("output_tokens").sum()),
    }
    if n_fin:
        # nanmin: a closed-loop session's turn never sent has no arrival (NaN).
        duration = float(fin("last_delivered").max() - np.nanmin(df["arrival"].to_numpy()[keep]))
    else:
        duration = float("nan")
    out["duration_s"] = duration
    dur = duration if duration and duration > 0 else float("nan")
    out["request_throughput"] = n_fin / dur
    out["output_throughput"] = out["total_output_tokens"] / dur
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / dur
    for m in LATENCIES:
        _stats(fin(m, float), m, out)
    if itl is not None and itl.n:
        out["mean_itl_ms"] = itl.mean * 1000.0
        for label, q in PCTS[1:]:
            out[f"{label}_itl_ms"] = itl.quantile(q / 100.0) * 1000.0
    else:
        for label, _ in PCTS:
            out[f"{label}_itl_ms"] = float("nan")
    for b in BREAKDOWN:
        x = fin(b, float)
        out[f"mean_{b}_ms"] = float(x.mean()) * 1000.0 if len(x) else float("nan")
        out[f"p99_{b}_ms"] = pct_ms(x, 99)
    if slos is None and scenario is not None:
        slos = class_slos(scenario)
    if slos:
        good = _slo_mask(df, slos) & keep
        out["good_requests"] = int(good.sum())
        out["request_goodput"] = float(good.sum()) / dur
        out["slo_attainment"] = float(good.sum()) / n_rows if n_rows else float("nan")
    _traffic_summary(df, keep, fin_mask, out)
    cfg = getattr(getattr(scenario, "report", None), "diagnosis", None)
    verdicts = diagnoses(out, cfg) if n_fin else ["no_completed_requests"]
    out["diagnosis"] = verdicts[0]
    out["diagnosis_all"] = verdicts
    return out


def _traffic_summary(df: pd.DataFrame, keep: np.ndarray, fin_mask: np.ndarray,
                     out: dict) -> None:
    """Rejections (by reason), time-outs, attempts and the wait estimate's error; the
    shares the diagnosis reads. Columns a table lacks (one written by another tool)
    count as neutral."""
    n = int(keep.sum())

    def col(name, default, dtype=None):
        return (df[name].to_numpy(dtype=dtype)[keep] if name in df
                else np.full(n, default, dtype=dtype))

    too_large = col("rejected", False, bool)
    refused = col("refused", False, bool)
    reason = col("reject_reason", "", object) if "reject_reason" in df else np.full(n, "", object)
    by = {nm: int(((reason == nm) & refused).sum()) for nm in REASONS[1:]}
    out["rejected"] = int(too_large.sum() + refused.sum())
    out["rejected_by_reason"] = {"too_large": int(too_large.sum()), **by}
    out["timed_out"] = int(col("timed_out", False, bool).sum())
    if "outcome" in df:
        # How each request ended, each counted once (``outcome_names``): they add up to
        # the requests.
        oc = col("outcome", "", object)
        out["outcomes"] = {k: int((oc == k).sum()) for k in OUTCOMES}
    attempts = col("attempts", 1, np.int64)
    out["attempts"] = int(attempts.sum())
    out["retries"] = int(attempts.sum()) - n
    out["timeout_retries"] = int(col("timeout_retries", 0, np.int64).sum())
    out["refused_frac"] = float(refused.mean()) if n else 0.0
    out["retries_per_request"] = out["retries"] / n if n else 0.0
    out["timeout_retries_per_request"] = out["timeout_retries"] / n if n else 0.0
    out["preempted_frac"] = float((col("preemptions", 0, np.int64) > 0).mean()) if n else 0.0
    fin = fin_mask[keep]
    retry = col("retry_s", 0.0, float)[fin]
    out["mean_retry_ms"] = float(retry.mean()) * 1000.0 if len(retry) else float("nan")
    est = col("wait_estimate", np.nan, float)
    q = col("t_queue", np.nan, float)
    ok = ~np.isnan(est) & ~np.isnan(q)
    if ok.any():
        err = (est - q)[ok]
        out["mean_wait_estimate_error_ms"] = float(err.mean()) * 1000.0
        out["median_abs_wait_estimate_error_ms"] = float(np.median(np.abs(err))) * 1000.0
        out["p90_abs_wait_estimate_error_ms"] = float(np.percentile(np.abs(err), 90)) * 1000.0
        p99 = col("wait_estimate_p99", np.nan, float)[ok]
        out["wait_estimate_p99_coverage"] = float((q[ok] <= p99).mean())


VERDICTS = ("retry_storm", "admission_limited", "queue_saturation", "kv_pressure",
            "prefill_bottleneck", "network_bound", "stream_bound", "decode_jitter")


def diagnoses(s: dict, cfg=None) -> list[str]:
    """Every bottleneck verdict a summary shows, most fundamental first (``VERDICTS``
    order; ``["healthy"]`` when none). The classic rule (queueing, then prefill, then
    decode jitter) with the traffic verdicts around it: ``retry_storm`` (retries after
    a timeout, per request, above ``retry_frac``: clients resending work the server
    may already be doing; retries after a 429 are admission's, cheap to refuse),
    ``admission_limited`` (share refused by admission
    above ``reject_frac``), ``kv_pressure`` (share of requests preempted above
    ``preempt_frac``), ``network_bound`` / ``stream_bound`` (mean T_net without
    retries, or mean T_stream, above ``network_frac`` / ``stream_frac`` of mean E2E).
    ``cfg``: ``report.diagnosis`` thresholds (defaults when None)."""
    if cfg is None:
        from simulator.config.traffic import DiagnosisConfig
        cfg = DiagnosisConfig()

    def get(key: str) -> float:
        v = s.get(key)
        return float("nan") if v is None else float(v)

    e2e = get("mean_e2el_ms")
    fired = {
        "retry_storm": get("timeout_retries_per_request") > cfg.retry_frac,
        "admission_limited": get("refused_frac") > cfg.reject_frac,
        "queue_saturation": s.get("mean_t_queue_ms", 0) > cfg.queue_ms,
        "kv_pressure": get("preempted_frac") > cfg.preempt_frac,
        "prefill_bottleneck": s.get("median_ttft_ms", 0) > cfg.ttft_ms,
        "network_bound": (get("mean_t_net_ms") - np.nan_to_num(get("mean_retry_ms")))
        > cfg.network_frac * e2e,
        "stream_bound": get("mean_t_stream_ms") > cfg.stream_frac * e2e,
        "decode_jitter": False,
    }
    p50, p99 = s.get("median_tpot_ms"), s.get("p99_tpot_ms")
    if p50 and p99 and not math.isnan(p50) and p99 > cfg.jitter * p50:
        fired["decode_jitter"] = True
    return [v for v in VERDICTS if fired[v]] or ["healthy"]


def diagnose(s: dict, queue_ms: float = 100.0, ttft_ms: float = 500.0,
             jitter: float = 2.0, cfg=None) -> str:
    """The first of ``diagnoses``: the classic bottleneck rule (queueing, then prefill,
    then decode jitter, else healthy) with the traffic verdicts. ``cfg`` (thresholds)
    overrides ``queue_ms``, ``ttft_ms`` and ``jitter``."""
    if cfg is None:
        from simulator.config.traffic import DiagnosisConfig
        cfg = DiagnosisConfig(queue_ms=queue_ms, ttft_ms=ttft_ms, jitter=jitter)
    return diagnoses(s, cfg)[0]


def per_class(df: pd.DataFrame, scenario=None) -> dict:
    """Latency summary per priority class (no ITL: it is pooled run-wide), in the order
    of the class names."""
    out = {}
    slos = class_slos(scenario) if scenario is not None else {}
    cls = df["class"].to_numpy()
    for name in sorted(pd.unique(cls[~pd.isna(cls)]) if len(cls) else []):
        out[str(name)] = summarize(df, None, slos={k: v for k, v in slos.items() if k == name},
                                   rows=cls == name)
    return out


def unfinished(df: pd.DataFrame, max_sim_time_s: Optional[float]) -> dict:
    """Why requests did not finish: ``rejected`` (too large for the KV cache: they can
    never run), ``cancelled`` (their client disconnected, as the scenario asked),
    ``refused`` (by admission control) and ``timed_out`` (their client gave up), both as
    the scenario asked, ``failed`` (lost to a replica failure, as ``cluster.faults``
    asked), ``unsent`` (closed-loop sessions: never sent, their session ended first or
    the clock stopped before their turn), ``cut`` (still queued or running when the clock
    stopped at ``max_sim_time_s``), and ``stuck`` (none of these: the run ended without
    them)."""
    done = df["finished"].to_numpy(dtype=bool)
    none = np.zeros(len(df), dtype=bool)
    rej = df["rejected"].to_numpy(dtype=bool) & ~done
    can = df["cancelled"].to_numpy(dtype=bool) & ~done & ~rej if "cancelled" in df else none
    ref = df["refused"].to_numpy(dtype=bool) & ~done if "refused" in df else none
    tout = df["timed_out"].to_numpy(dtype=bool) & ~done & ~ref if "timed_out" in df else none
    fail = df["failed"].to_numpy(dtype=bool) & ~done if "failed" in df else none
    unsent = df["unsent"].to_numpy(dtype=bool) & ~done if "unsent" in df else none
    rest = ~done & ~rej & ~can & ~ref & ~tout & ~fail & ~unsent
    cut = int(rest.sum()) if max_sim_time_s is not None else 0
    out = {"rejected": int(rej.sum()), "cancelled": int(can.sum()), "refused": int(ref.sum()),
           "timed_out": int(tout.sum()), "failed": int(fail.sum()), "cut": cut,
           "stuck": int(rest.sum()) - cut}
    if "unsent" in df:
        out["unsent"] = int(unsent.sum())
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
