"""A run's outputs as data: the per-request table, the summary (overall, per class, run
facts, KV cache, cluster), the per-replica time series, and how much memory a run takes.

The console tables are in ``report.tables``, the result files in ``report.files``.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from simulator.report.chunks import CHUNK_ROWS, requests_chunks
from simulator.report.kv import kv_summary
from simulator.report.metrics import good_mask, per_class, requests_table, summarize



def run_outputs(res) -> tuple[pd.DataFrame, dict]:
    """The per-request table and the summary (overall, per class, run facts) of a run."""
    df = requests_table(res)
    return df, _outputs(res, df)


def run_summary(res) -> dict:
    """``run_outputs``'s summary without building the per-request table: the same numbers
    from only the columns they need (what a large run can afford)."""
    return _outputs(res, summary_frame(res))


# Columns of ``requests_table`` no summary reads (only the derived ones made from them):
# left out of ``summary_frame``. Any other column, including one added later, is kept, so
# the two summaries stay the same.
_NOT_SUMMARISED = ("rid", "replica", "new_connection", "enqueued", "scheduled", "first_token",
                   "last_token", "first_delivered", "cached_tokens")


def summary_frame(res, rows: int | None = None) -> pd.DataFrame:
    """``requests_table(res)`` less the columns no summary reads, built chunk by chunk
    into preallocated columns (never the whole table at once, nor a copy of it)."""
    n = len(res.workload)
    rows = rows or CHUNK_ROWS
    cols: dict = {}
    for a, df in zip(range(0, max(n, 1), rows), requests_chunks(res, rows)):
        df = df.drop(columns=[c for c in _NOT_SUMMARISED if c in df])
        for c in df.columns:
            v = df[c].to_numpy()
            if c not in cols:
                cols[c] = np.empty(n, dtype=v.dtype)
            cols[c][a:a + len(v)] = v
    return pd.DataFrame(cols, copy=False)


def _outputs(res, df: pd.DataFrame) -> dict:
    """The summary of a run from a table holding (at least) ``summary_frame``'s columns."""
    summary = summarize(df, res.rec.itl, res.scenario)
    out = {
        "policy": res.policy,
        "seed": res.seed,
        "overall": summary,
        "per_class": per_class(df, res.scenario),
        "run": {
            "replicas": res.scenario.cluster.replicas,
            "kv_capacity_blocks": res.kv_capacity_blocks,
            "kv_capacity_tokens": res.kv_capacity_tokens,
            "engine_steps": res.rec.steps,
            "cost_model": res.cost_info,
            "cost_extrapolations": res.extrapolations,
            "cost_lookups": res.cost_lookups,
            "connections": res.connections,
            "sim_end_s": res.sim_end,
            # ``compiled`` or ``simpy``, with why the compiled loop did not run.
            "event_loop": res.meta.get("loop", "simpy"),
            "policy_params": res.meta.get("policy_params", {}),
        },
        "kv": kv_summary(res, df),
    }
    from simulator.report.traffic import cluster_summary
    out["cluster"] = cluster_summary(res, df, good_mask(df, res.scenario))
    if "faults" in res.meta:
        from simulator.report.faults import fault_summary
        out["faults"] = fault_summary(res, df, good_mask(df, res.scenario))
    if "degrade" in res.meta:
        from simulator.report.faults import degrade_summary
        out["degrade"] = degrade_summary(res.meta["degrade"], df, good_mask(df, res.scenario))
    # The rich stream/network model's totals (see simulate._Wire), when it was on; the
    # gateway's attempt tallies (``loops.traffic``), when traffic control was on.
    for key in ("stream", "network", "traffic", "speculative", "disaggregation", "edge"):
        if key in res.meta:
            out[key] = res.meta[key]
    if "sessions" in res.meta:   # closed-loop sessions (``report.sessions``)
        out["sessions"] = res.meta["sessions"]
    return out

def series_table(res) -> pd.DataFrame:
    """Per-replica time series (queue length, running batch, KV use) as one table."""
    frames = []
    for i, (ts, wq, run, blk, kv, shared) in enumerate(res.rec.series):
        frames.append(pd.DataFrame({"replica": i, "time": list(ts), "waiting": list(wq),
                                    "running": list(run), "kv_blocks_reserved": list(blk),
                                    "kv_tokens": list(kv), "kv_blocks_shared": list(shared)}))
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if len(df):
        cap = res.kv_capacity_blocks
        sp = res.meta.get("slot_pools")
        if sp:
            # A mixed fleet: each replica's pool, and its own capacity.
            k = df["replica"].to_numpy()
            df.insert(1, "pool", np.array([nm for nm, _c, _g in sp], dtype=object)[k])
            cap = np.array([c for _nm, c, _g in sp], dtype=np.float64)[k]
        df["kv_reserved_frac"] = df["kv_blocks_reserved"] / cap
        # Utilisation: tokens held / token slots reserved (what a reservation wastes).
        slots = df["kv_blocks_reserved"] * res.scenario.engine.kv.block_size
        df["kv_utilization"] = (df["kv_tokens"] / slots.where(slots > 0)).clip(upper=1.0)
    if "attempts" in res.meta or res.meta.get("utilization"):
        # Traffic control: utilisation columns and the cluster rows (``report.traffic``).
        from simulator.report.traffic import add_utilization, cluster_rows
        df = add_utilization(res, df)
        if "attempts" in res.meta:
            frame = summary_frame(res)
            good = good_mask(frame, res.scenario)
            rows = cluster_rows(res, frame, good if good is not None
                                else frame["finished"].to_numpy(bool))
            df = pd.concat([df, rows], ignore_index=True)
    return df


# -- how much a run takes ------------------------------------------------------------------

# What a run holds per request (workload, recorder, the event loop's state, the summary
# columns, a chunk of the table being written) and what the process holds anyway
# (Python, numpy, pandas, the compiled loop's machine code, or compiling it);
# ``benchmarks/big_run.py`` measures them (620 MiB at 1M requests, 3.8 GiB at 10M on the
# compiled loop), these are rounded up.
RUN_BYTES_PER_REQUEST = {"compiled": 500, "simpy": 2500}
RUN_BASE_BYTES = 600 * 2**20


def run_memory(n_requests: float, loop: str = "compiled") -> float:
    """Bytes a run of ``n_requests`` on ``loop`` (``compiled`` or ``simpy``) is expected
    to need at its peak, writing its results included."""
    return RUN_BASE_BYTES + n_requests * RUN_BYTES_PER_REQUEST[loop]

