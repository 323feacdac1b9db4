"""What a run with traffic control adds to its outputs: the cluster rows of
``timeseries.csv``, the utilisation columns of its replica rows, and the ``cluster``
and ``traffic`` sections of ``summary.json``.

Cluster rows (``replica`` = -1, one per ``report.window_s``, ``time`` = the window's
end), per second over the window: ``offered_rps`` (attempts sent, retries included),
``first_rps`` and ``retry_rps`` (its two parts), ``accepted_rps`` (admitted into a
queue), ``refused_rps`` and ``timed_out_rps`` (attempts whose client learned so in
the window), ``completed_rps`` (requests whose last byte arrived); the time-averaged
``replicas_ready``, ``replicas_provisioning`` and ``replicas_draining``; and, of the
requests first sent in the window, ``slo_attainment`` (meeting their class's SLO,
refused and timed-out ones counting as failures) and ``p99_ttft_ms`` (of those that
completed). A retry storm shows as ``offered_rps`` well above ``first_rps`` while
``accepted_rps`` stays flat.

Replica rows gain ``busy_frac``, ``tokens_per_s`` (and its prefill and decode parts)
and ``mfu`` over the trailing window when ``report.utilization`` is on
(``report.utilization``).

``summary.json``'s ``cluster`` (every run): GPU-hours (replicas provisioning, ready or
draining, times ``gpus_per_replica``, over the run), their cost at
``cluster.gpu_cost_per_hour``, the fleet's mean and largest size, scale events, the
lowest per-window SLO attainment and, with utilisation, the mean busy fraction and MFU.
With ``cluster.pools`` it adds ``pools`` (per pool: ``loops.traffic._pools_meta``, and
with utilisation each pool's busy fraction, tokens/s per replica and MFU) and
``autoscaled_pool``; replica rows of ``timeseries.csv`` gain ``pool``.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from simulator.report.percentile import pct_ms
from simulator.report.utilization import window_columns
from simulator.wire import clients as C

CLUSTER_ROW = -1
UTIL_COLUMNS = ("busy_frac", "tokens_per_s", "prefill_tokens_per_s", "decode_tokens_per_s",
                "mfu")


def _window_edges(end: float, w: float) -> np.ndarray:
    n = max(1, int(np.ceil(end / w - 1e-9)))
    return np.arange(n + 1) * w


def _per_window(times: np.ndarray, edges: np.ndarray) -> np.ndarray:
    t = times[~np.isnan(times)]
    counts, _ = np.histogram(t, bins=edges)   # (the last window includes its end)
    return counts.astype(np.float64)


def _state_means(timeline: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Time-averaged (ready, provisioning, draining) over each window."""
    t = timeline[:, 0]
    out = np.zeros((len(edges) - 1, 3))
    for k in range(len(edges) - 1):
        a, b = edges[k], edges[k + 1]
        pts = np.concatenate(([a], t[(t > a) & (t < b)], [b]))
        idx = np.searchsorted(t, pts[:-1], side="right") - 1
        vals = timeline[np.maximum(idx, 0), 1:]
        out[k] = (vals * np.diff(pts)[:, None]).sum(axis=0) / (b - a)
    return out


def cluster_rows(res, frame: pd.DataFrame, good: np.ndarray) -> pd.DataFrame:
    """The cluster rows of a traffic run (module doc); ``frame``: its summary columns
    (arrival, ttft, last_delivered), ``good``: which requests met their SLO."""
    meta = res.meta
    att = meta["attempts"]
    w = res.scenario.report.window_s
    end = max(float(res.sim_end), float(np.nanmax(att["sent"])) if len(att["sent"]) else 0.0)
    edges = _window_edges(end, w)
    out = att["outcome"]
    timed = np.isin(out, (C.CONNECT_TIMEOUT, C.READ_TIMEOUT, C.DEADLINE))
    cols = {
        "replica": CLUSTER_ROW, "time": edges[1:],
        "offered_rps": _per_window(att["sent"], edges) / w,
        "first_rps": _per_window(att["sent"][att["first"]], edges) / w,
        "retry_rps": _per_window(att["sent"][~att["first"]], edges) / w,
        "accepted_rps": _per_window(att["admitted"], edges) / w,
        "refused_rps": _per_window(att["end"][out == C.REFUSED], edges) / w,
        "timed_out_rps": _per_window(att["end"][timed], edges) / w,
        "completed_rps": _per_window(frame["last_delivered"].to_numpy(float), edges) / w,
    }
    states = _state_means(meta["fleet_timeline"], edges)
    cols["replicas_ready"], cols["replicas_provisioning"], cols["replicas_draining"] = states.T
    if "faults" in meta:
        from simulator.report.faults import fault_columns
        cols.update(fault_columns(res, edges))
    arrival = frame["arrival"].to_numpy(float)
    k = np.clip(np.searchsorted(edges, arrival, side="right") - 1, 0, len(edges) - 2)
    n = np.bincount(k, minlength=len(edges) - 1).astype(np.float64)
    g = np.bincount(k, weights=good.astype(np.float64), minlength=len(edges) - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cols["slo_attainment"] = np.where(n > 0, g / n, np.nan)
    ttft = frame["ttft"].to_numpy(float)
    done = ~np.isnan(frame["last_delivered"].to_numpy(float))
    p99 = np.full(len(edges) - 1, np.nan)
    for j in np.unique(k[done]):
        p99[j] = pct_ms(ttft[done & (k == j)], 99)
    cols["p99_ttft_ms"] = p99
    return pd.DataFrame(cols)


def add_utilization(res, df: pd.DataFrame) -> pd.DataFrame:
    """Add the utilisation columns to the replica rows of ``df`` (a ``series_table``)."""
    trackers = res.meta.get("utilization")
    if not trackers or not len(df):
        return df
    w = res.scenario.report.window_s
    for c in UTIL_COLUMNS:
        df[c] = np.nan
    for i, tr in enumerate(trackers):
        rows = (df["replica"] == i).to_numpy()
        if tr is None or not rows.any():
            continue
        vals = window_columns(tr, df.loc[rows, "time"].to_numpy(float), w)
        for c in UTIL_COLUMNS:
            df.loc[rows, c] = vals[c]
    return df


def cluster_summary(res, frame: pd.DataFrame, good) -> dict:
    """``summary.json``'s ``cluster`` section (module doc)."""
    sc = res.scenario
    meta = res.meta.get("cluster")
    if meta is not None:
        out = dict(meta)
    else:
        reps, gpus = sc.cluster.replicas, sc.cluster.gpus_per_replica
        hours = reps * gpus * float(res.sim_end) / 3600.0
        price = sc.cluster.gpu_cost_per_hour
        out = {"gpu_hours": hours, "cost_usd": hours * price if price is not None else None,
               "gpu_cost_per_hour": price, "replicas_mean": float(reps),
               "replicas_max": reps, "ready_min": reps, "scale_ups": 0, "scale_downs": 0}
    if "attempts" in res.meta and good is not None:
        rows = cluster_rows(res, frame, good)
        att = rows["slo_attainment"].to_numpy(float)
        out["slo_attainment_min_window"] = float(np.nanmin(att)) if np.isfinite(att).any() \
            else None
    trackers = [t for t in res.meta.get("utilization") or [] if t is not None]
    if trackers and res.meta.get("slot_pools"):
        _pool_utilization(res, out)
    elif trackers:
        # Over the time replicas were held (provisioning time included: a GPU loading
        # weights is not serving).
        held_s = out["gpu_hours"] * 3600.0 / sc.cluster.gpus_per_replica
        out["busy_frac_mean"] = sum(t.busy for t in trackers) / held_s if held_s > 0 else None
        if trackers[0].known and held_s > 0:
            out["mfu_mean"] = sum(t.flops for t in trackers) / (trackers[0].peak * held_s)
    return out


def _pool_utilization(res, out: dict) -> None:
    """Busy fraction and MFU of a mixed fleet, overall and per pool (each pool's own
    peak FLOPs and GPUs); ``tokens_per_s_per_replica``: tokens its replicas computed per
    held replica-second."""
    sp = res.meta["slot_pools"]
    trackers = res.meta["utilization"]
    pools = out.get("pools") or {}
    busy_all = held_all = flops_all = peak_all = 0.0
    known = True
    for name, info in pools.items():
        slots = [i for i, (nm, _c, _g) in enumerate(sp) if nm == name]
        trs = [trackers[i] for i in slots if trackers[i] is not None]
        held = info["gpu_hours"] * 3600.0 / info["gpus_per_replica"]
        busy = sum(t.busy for t in trs)
        toks = sum(t.prefill + t.decode for t in trs)
        info["busy_frac_mean"] = busy / held if held > 0 else None
        info["tokens_per_s_per_replica"] = toks / held if held > 0 else None
        if trs and trs[0].known and held > 0:
            info["mfu_mean"] = sum(t.flops for t in trs) / (trs[0].peak * held)
            flops_all += sum(t.flops for t in trs)
            peak_all += trs[0].peak * held
        elif held > 0:
            known = False
        busy_all += busy
        held_all += held
    out["busy_frac_mean"] = busy_all / held_all if held_all > 0 else None
    if known and peak_all > 0:
        out["mfu_mean"] = flops_all / peak_all
