"""What a run says about KV memory: capacity, utilisation, preemptions, swapping,
prefix-cache hits and what they saved.

- *Utilisation* is tokens held / token slots reserved (20-40% for contiguous
  reservations, near 100% for paged blocks: ``data/README.md``, *Facts from two design
  articles*), time-weighted over the run's samples.
- *Block hit ratio*: of the full prompt blocks looked up at admissions, the share
  found cached (the longest leading run). *Token hit ratio*: prompt tokens whose
  prefill a hit skipped, over prompt tokens admitted (at least one token of a
  prompt is always recomputed, so it is a little lower).
- *CPU tier* (``engine.kv.offload``, ``model.kv.offload``): of the same looked-up
  blocks, the share found in the CPU tier after the GPU's run (``cpu_block_hit_ratio``;
  the two ratios and the misses add up to 1), the GB loaded back over PCIe and copied
  out to the tier, and the step time the loads took (loaded blocks x one GPU's slice of
  a block / the link's rate: the GPUs of a replica load in parallel).
- *Memory saved*: block references beyond the first on shared blocks, i.e. the
  blocks an engine without prefix sharing would have held on top, in GB.
- *Prefill time saved*: per request with a hit, the cost model's time to prefill
  the cached tokens in the engine's chunks (``chunk_size``, else the token budget),
  each with the tokens before it as prior context: the work the hit skipped. (Not
  a difference of two whole-prompt lookups: far outside a profile's range their
  extrapolations can differ in sign.)
"""
from __future__ import annotations

import math

import numpy as np
from rich.table import Table

from simulator.report.percentile import pct_ms


def kv_run_stats(stats, cost, rec, workload, chunk: int) -> dict:
    """Tallies of the replicas' block managers (their ``KVStats``) and the prefill
    time hits saved."""
    keys = ("queried_blocks", "hit_blocks", "queried_tokens", "cached_tokens", "evictions",
            "admissions", "cpu_hit_blocks", "loaded_blocks", "stored_blocks", "cpu_evictions")
    out = {k: sum(getattr(st, k) for st in stats) for k in keys}
    out["swap_copy_s"] = float(rec.swap_copy_s)
    out["prefill_s_saved"] = _prefill_saved(cost, rec, chunk)
    return out


def _prefill_saved(cost, rec, chunk: int) -> float:
    hit = np.flatnonzero(rec.cached_tokens > 0)
    if not len(hit) or not hasattr(cost, "prefill_ms"):
        return 0.0
    # These lookups are for the report, not the run: leave the run's tallies alone.
    saved_lookups = (cost.lookups, cost.extrapolations)
    # A prefill row's time depends on (chunk, prior) only, and hits repeat a few pairs
    # (16,790 lookups, 2 pairs on a 16,800-request replay): each is priced once.
    ms: dict = {}
    total = 0.0
    for c in rec.cached_tokens[hit].tolist():
        done = 0
        while done < c:
            n = min(chunk, c - done)
            key = (n, done)
            if key not in ms:
                ms[key] = cost.prefill_ms(n, done)
            total += ms[key]
            done += n
    cost.lookups, cost.extrapolations = saved_lookups
    return total / 1000.0


def _time_weighted(ts: np.ndarray, x: np.ndarray) -> float:
    ok = ~np.isnan(x)
    if ok.sum() < 2:
        return float(np.nanmean(x)) if ok.any() else float("nan")
    ts, x = ts[ok], x[ok]
    w = np.diff(ts, append=ts[-1])
    return float((x * w).sum() / w.sum()) if w.sum() > 0 else float(x.mean())


def kv_summary(res, df) -> dict:
    """The ``kv`` section of a run's summary (see module doc)."""
    sc = res.scenario
    kv = sc.engine.kv
    shape = sc.model.shape
    bpt = shape.kv_bytes_per_token
    block_gb = bpt * kv.block_size / 1e9
    st = res.meta.get("kv", {})
    util, saved_mean, saved_peak = [], [], []
    for ts, _wq, _run, blk, tok, shared in res.rec.series:
        ts = np.asarray(ts)
        blk = np.asarray(blk)
        tok = np.asarray(tok)
        with np.errstate(invalid="ignore", divide="ignore"):
            u = np.where(blk > 0, np.minimum(tok / (blk * kv.block_size), 1.0), np.nan)
        if len(ts):
            util.append(_time_weighted(ts, u))
            sh = np.asarray(shared)
            saved_mean.append(_time_weighted(ts, sh))
            saved_peak.append(float(sh.max()))
    pre = df["preemptions"].to_numpy() if "preemptions" in df else np.zeros(0)
    pre_s = df["preempted_s"].to_numpy()[pre > 0] if len(pre) else np.zeros(0)
    qb, qt = st.get("queried_blocks", 0), st.get("queried_tokens", 0)
    return {
        "allocation": kv.allocation,
        "capacity_blocks": res.kv_capacity_blocks,
        "capacity_tokens": res.kv_capacity_tokens,
        "capacity_gb": res.kv_capacity_blocks * block_gb,
        "bytes_per_token": bpt,
        # NaN when no replica had a sample to weigh (a run that served nothing).
        "utilization": (float(np.nanmean(util)) if np.isfinite(util).any()
                        else float("nan")),
        "preemption": kv.preemption,
        "preemptions": int(pre.sum()),
        "requests_preempted": int((pre > 0).sum()),
        "recomputed_tokens": int(df["recomputed_tokens"].sum()) if "recomputed_tokens" in df else 0,
        "swapped_gb": float(df["swapped_bytes"].sum()) / 1e9 if "swapped_bytes" in df else 0.0,
        "swap_copy_s": st.get("swap_copy_s", 0.0),
        "mean_preempted_ms": float(pre_s.mean()) * 1000 if len(pre_s) else float("nan"),
        "p99_preempted_ms": pct_ms(pre_s, 99),
        "prefix_caching": kv.prefix_caching,
        "block_hit_ratio": st.get("hit_blocks", 0) / qb if qb else float("nan"),
        "token_hit_ratio": st.get("cached_tokens", 0) / qt if qt and kv.prefix_caching else float("nan"),
        "cache_evictions": st.get("evictions", 0),
        "mean_memory_saved_gb": sum(saved_mean) * block_gb if saved_mean else 0.0,
        "peak_memory_saved_gb": sum(saved_peak) * block_gb if saved_peak else 0.0,
        "prefill_s_saved": st.get("prefill_s_saved", 0.0),
        **_offload_summary(sc, st, block_gb),
    }


def _offload_summary(sc, st: dict, block_gb: float) -> dict:
    """The CPU tier's part of the ``kv`` section (see module doc); {} without one."""
    off = sc.engine.kv.offload
    if off is None:
        return {}
    from simulator.deploy.replica import kv_bytes_per_token
    from simulator.model.kv.offload import load_time
    qb, loaded = st.get("queried_blocks", 0), st.get("loaded_blocks", 0)
    slice_bytes = kv_bytes_per_token(sc, per_gpu=True) * sc.engine.kv.block_size
    return {
        "offload_cpu_gb": off.cpu_gb,
        "gpu_block_hit_ratio": st.get("hit_blocks", 0) / qb if qb else float("nan"),
        "cpu_block_hit_ratio": st.get("cpu_hit_blocks", 0) / qb if qb else float("nan"),
        "cpu_hit_blocks": st.get("cpu_hit_blocks", 0),
        "loaded_blocks": loaded,
        "loaded_gb": loaded * block_gb,
        "stored_gb": st.get("stored_blocks", 0) * block_gb,
        "cpu_evictions": st.get("cpu_evictions", 0),
        "offload_load_s": float(load_time(loaded, slice_bytes, off.pcie_gb_per_s * 1e9)[1]),
    }


def kv_capacity_line(scenario, capacity_blocks: int) -> str:
    """One line printed before a run: the KV cache each replica gets, and why."""
    kv = scenario.engine.kv
    if scenario.cluster.pools:
        # A mixed fleet: each pool's own (``cluster.pools``).
        from simulator.cluster.pools import plan_pools
        each = ", ".join(f"{p.name}{f' ({p.gpu})' if p.gpu else ''} {p.capacity:,} blocks"
                         for p in plan_pools(scenario))
        return (f"KV cache per replica by pool: {each}, x {kv.block_size} tokens; "
                f"{kv.allocation}, preemption {kv.preemption}, prefix caching "
                f"{'on' if kv.prefix_caching else 'off'}")
    return scenario.model.cost.capacity_line(scenario, capacity_blocks)


def _f(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def kv_table(outs: dict) -> Table:
    """KV memory per run, side by side."""
    t = Table(title="KV memory", title_justify="left")
    t.add_column("")
    for k in outs:
        t.add_column(k, justify="right")
    rows = [("capacity GB per replica", "capacity_gb", ".1f"),
            ("utilization (tokens / reserved)", "utilization", ".1%"),
            ("preemptions", "preemptions", ","),
            ("requests preempted", "requests_preempted", ","),
            ("recomputed tokens", "recomputed_tokens", ","),
            ("swapped GB", "swapped_gb", ".2f"),
            ("swap copy s", "swap_copy_s", ".3f"),
            ("P99 time preempted ms", "p99_preempted_ms", ",.1f"),
            ("prefix block hit ratio", "block_hit_ratio", ".1%"),
            ("prefix token hit ratio", "token_hit_ratio", ".1%"),
            ("CPU tier block hit ratio", "cpu_block_hit_ratio", ".1%"),
            ("GB loaded from CPU tier", "loaded_gb", ".2f"),
            ("GB copied to CPU tier", "stored_gb", ".2f"),
            ("CPU tier load s", "offload_load_s", ".3f"),
            ("mean memory saved GB", "mean_memory_saved_gb", ".2f"),
            ("prefill s saved", "prefill_s_saved", ",.2f")]
    for label, key, spec in rows:
        t.add_row(label, *(_f(o["kv"].get(key), spec) for o in outs.values()))
    return t
