"""What a run with replica faults (``cluster.faults``, ``cluster.breaker``) adds to its
outputs.

``summary.json``'s ``faults``: the fault model's tallies (``cluster.faults.Faults.meta``:
failures, requests failed in flight or refused by a replica that was down, retried,
lost, held at the gateway; each replica's down time and availability over the run; the
breakers' opens) and its ``timeline`` (every failure, detection, recovery and breaker
move), plus ``phases``: the requests first sent ``before`` the first failure,
``during`` an outage (at least one replica down when the request arrived) and ``after``
(every replica up again, after the first failure), each with its request count,
completed and failed, ``slo_attainment`` (good / requests), ``request_goodput`` (good
requests / the phase's time, within the span of arrivals) and the mean time lost to
faults (``fault_lost_s``); with ``cluster.degrade``, also ``degraded`` and
``slo_attainment_undegraded`` (``degrade_summary``: a degraded answer within the SLO is
good for ``slo_attainment``, not for this one).

``timeseries.csv``'s cluster rows gain ``replicas_down`` (time-averaged over the
window) and, with a breaker, ``breakers_open`` (replicas whose breaker is open, same
average), beside ``slo_attainment`` per window: the failure and recovery as a timeline.
"""
from __future__ import annotations

import numpy as np

from simulator.cluster.faults import down_intervals

PHASES = ("before", "during", "after")


def _count_series(intervals, edges: np.ndarray) -> np.ndarray:
    """Time-averaged number of intervals covering each window ``[edges[k], edges[k+1])``."""
    out = np.zeros(len(edges) - 1)
    width = np.diff(edges)
    for a, b in intervals:
        lo = np.clip(a, edges[:-1], edges[1:])
        hi = np.clip(b, edges[:-1], edges[1:])
        out += np.maximum(hi - lo, 0.0)
    return out / width


def _breaker_open_intervals(timeline: list, end: float) -> list:
    """``(open from, open until)`` of every replica's breaker (half-open ends it)."""
    since: dict[int, float] = {}
    out = []
    for ev in timeline:
        t, s, e = ev["time_s"], ev["replica"], ev["event"]
        if e == "breaker_open":
            since[s] = t
        elif e in ("breaker_half_open", "breaker_closed") and s in since:
            out.append((since.pop(s), t))
    out += [(t, max(t, end)) for t in since.values()]
    return out


def _down(meta: dict, n_slots: int, end: float) -> list:
    tl = [(e["time_s"], e["replica"], e["event"]) for e in meta["timeline"]]
    return [iv for x in down_intervals(tl, n_slots, end) for iv in x]


def fault_columns(res, edges: np.ndarray) -> dict:
    """The cluster rows' fault columns over windows ``edges`` (module doc)."""
    meta = res.meta["faults"]
    end = float(edges[-1])
    cols = {"replicas_down": _count_series(_down(meta, len(meta["down_s"]), end), edges)}
    if "breaker_opens" in meta:
        cols["breakers_open"] = _count_series(_breaker_open_intervals(meta["timeline"], end),
                                              edges)
    return cols


def _phase_of(arrival: np.ndarray, down: list) -> np.ndarray:
    """0 before the first failure, 1 when some replica is down at arrival, 2 after."""
    ph = np.full(len(arrival), 0, dtype=np.int64)
    if not down:
        return ph
    first = min(a for a, _ in down)
    during = np.zeros(len(arrival), dtype=bool)
    for a, b in down:
        during |= (arrival >= a) & (arrival < b)
    ph[arrival >= first] = 2
    ph[during] = 1
    return ph


def _phase_seconds(down: list, lo: float, hi: float) -> tuple[float, float, float]:
    """Seconds of ``[lo, hi]`` before the first failure, with a replica down, and after."""
    if not down:
        return hi - lo, 0.0, 0.0
    first = min(a for a, _ in down)
    # The union of the outages, clipped to [lo, hi].
    merged: list = []
    for a, b in sorted(down):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    dur = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in merged)
    before = max(0.0, min(first, hi) - lo)
    return before, dur, max(0.0, (hi - lo) - before - dur)


def fault_summary(res, frame, good) -> dict:
    """``summary.json``'s ``faults`` section (module doc)."""
    meta = dict(res.meta["faults"])
    n_slots = len(meta["down_s"])
    down = _down(meta, n_slots, float(res.sim_end))
    arrival = frame["arrival"].to_numpy(float)
    ph = _phase_of(arrival, down)
    lo, hi = (float(arrival.min()), float(arrival.max())) if len(arrival) else (0.0, 0.0)
    secs = _phase_seconds(down, lo, hi)
    good = (np.asarray(good, dtype=bool) if good is not None
            else frame["finished"].to_numpy(bool))
    done = frame["finished"].to_numpy(bool)
    failed = frame["failed"].to_numpy(bool) if "failed" in frame else np.zeros(len(ph), bool)
    lost = (frame["fault_lost_s"].to_numpy(float) if "fault_lost_s" in frame
            else np.zeros(len(ph)))
    deg = frame["degraded"].to_numpy(bool) if "degraded" in frame else None
    phases = {}
    for k, name in enumerate(PHASES):
        m = ph == k
        n = int(m.sum())
        phases[name] = {
            "requests": n, "completed": int(done[m].sum()), "failed": int(failed[m].sum()),
            "seconds": secs[k],
            "slo_attainment": float(good[m].sum()) / n if n else None,
            "request_goodput": float(good[m].sum()) / secs[k] if secs[k] > 0 else None,
            "mean_fault_lost_s": float(lost[m].mean()) if n else None,
        }
        if deg is not None:
            phases[name]["degraded"] = int(deg[m].sum())
            phases[name]["slo_attainment_undegraded"] = (
                float((good & ~deg)[m].sum()) / n if n else None)
    meta["phases"] = phases
    return meta


def degrade_summary(meta: dict, frame, good) -> dict:
    """``summary.json``'s ``degrade``: the degrade model's tallies (``Degrade.meta``) and
    how the degraded answers stand against the SLO (``cluster.degrade``'s module doc):
    ``good_degraded`` and ``slo_attainment_undegraded`` (good and not degraded / all
    requests). ``good``: the SLO mask (None: no SLO, every completed request is good)."""
    out = dict(meta)
    deg = frame["degraded"].to_numpy(bool)
    good = (np.asarray(good, dtype=bool) if good is not None
            else frame["finished"].to_numpy(bool))
    n = len(deg)
    out["good_degraded"] = int((good & deg).sum())
    out["slo_attainment_undegraded"] = float((good & ~deg).sum()) / n if n else None
    return out


def fault_figures(summary: dict) -> dict:
    """A sweep or plan row's fault cells (``planning.executors.flatten``) from a run's
    summary: ``faults.<tally>`` (failures, in-flight failed, refused while down, retried,
    lost, breaker opens in all), ``faults.<phase>.<figure>`` (requests, failed,
    slo_attainment, request_goodput, mean_fault_lost_s; with degrade, degraded and
    slo_attainment_undegraded) and ``degrade.<figure>`` (degraded_requests,
    good_degraded, slo_attainment_undegraded)."""
    row: dict = {}
    f = summary.get("faults")
    if f is not None:
        for k in ("failures", "in_flight_failed", "refused_while_down", "retried", "lost"):
            row[f"faults.{k}"] = f[k]
        if "breaker_opens" in f:
            row["faults.breaker_opens"] = sum(f["breaker_opens"])
        for name, ph in f.get("phases", {}).items():
            for k in ("requests", "failed", "slo_attainment", "request_goodput",
                      "mean_fault_lost_s", "degraded", "slo_attainment_undegraded"):
                if k in ph:
                    row[f"faults.{name}.{k}"] = ph[k]
    if "degrade" in summary:
        for k in ("degraded_requests", "good_degraded", "slo_attainment_undegraded"):
            if k in summary["degrade"]:
                row[f"degrade.{k}"] = summary["degrade"][k]
    return row
