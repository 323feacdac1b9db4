"""Turning runs into what a person reads: console tables and result files.

This is the only module of the simulator (with the CLI) that does I/O.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import yaml
from rich.console import Console
from rich.table import Table

from simulator.report.kv import kv_summary, kv_table
from simulator.report.metrics import BREAKDOWN, per_class, requests_table, summarize


def run_outputs(res) -> tuple[pd.DataFrame, dict]:
    """The per-request table and the summary (overall, per class, run facts) of a run."""
    df = requests_table(res)
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
    # The rich stream/network model's totals (see simulate._Wire), when it was on.
    for key in ("stream", "network"):
        if key in res.meta:
            out[key] = res.meta[key]
    return df, out


def fmt(v, digits: str = ".2f") -> str:
    """A number for a table cell: thousands separators, '-' for missing."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:,{digits}}"
    return str(v)


def latency_table(title: str, columns: dict[str, dict]) -> Table:
    """P50/P90/P99 of TTFT, TPOT, ITL, E2EL (ms): one column per percentile for a single
    run, one column per run (rows metric x percentile) when comparing several."""
    metrics = ("ttft", "tpot", "itl", "e2el")
    if not any(s.get("p99_itl_ms") is not None and not math.isnan(s.get("p99_itl_ms"))
               for s in columns.values()):
        metrics = ("ttft", "tpot", "e2el")  # per-class tables: ITL is pooled run-wide only
    t = Table(title=title, title_justify="left")
    t.add_column("metric (ms)")
    if len(columns) == 1:
        s = next(iter(columns.values()))
        for q in ("P50", "P90", "P99"):
            t.add_column(q, justify="right")
        for m in metrics:
            t.add_row(m.upper(), fmt(s.get(f"median_{m}_ms")), fmt(s.get(f"p90_{m}_ms")),
                      fmt(s.get(f"p99_{m}_ms")))
        return t
    for name in columns:
        t.add_column(name, justify="right")
    for m in metrics:
        for q, key in (("P50", "median"), ("P90", "p90"), ("P99", "p99")):
            t.add_row(f"{m.upper()} {q}", *[fmt(s.get(f"{key}_{m}_ms")) for s in columns.values()])
    return t


def breakdown_table(columns: dict[str, dict]) -> Table:
    """Mean and P99 of each additive stage (ms); one column per run when comparing."""
    t = Table(title="E2E breakdown (ms)", title_justify="left")
    t.add_column("stage")
    single = len(columns) == 1
    if single:
        t.add_column("mean", justify="right")
        t.add_column("P99", justify="right")
    else:
        for name in columns:
            t.add_column(name, justify="right")
    for b in (*BREAKDOWN, "e2el"):
        if single:
            s = next(iter(columns.values()))
            t.add_row(b.upper(), fmt(s.get(f"mean_{b}_ms")), fmt(s.get(f"p99_{b}_ms")))
        else:
            for key in ("mean", "p99"):
                t.add_row(f"{b.upper()} {key}", *[fmt(s.get(f"{key}_{b}_ms"))
                                                   for s in columns.values()])
    return t


def throughput_table(columns: dict[str, dict]) -> Table:
    t = Table(title="Throughput", title_justify="left")
    t.add_column("")
    for name in columns:
        t.add_column(name, justify="right")
    for key, label in (("completed", "completed"), ("not_finished", "not finished"),
                       ("request_throughput", "requests/s"),
                       ("output_throughput", "output tokens/s"),
                       ("request_goodput", "goodput requests/s"), ("diagnosis", "diagnosis")):
        t.add_row(label, *[fmt(s.get(key)) for s in columns.values()])
    return t


def print_run(console: Console, outs: dict[str, dict]) -> None:
    """Print one or several runs (keyed by policy) side by side."""
    overall = {k: o["overall"] for k, o in outs.items()}
    console.print(latency_table("Latency, all requests", overall))
    classes = sorted({c for o in outs.values() for c in o["per_class"]})
    if len(classes) > 1:
        for c in classes:
            cols = {k: o["per_class"].get(c, {}) for k, o in outs.items()}
            console.print(latency_table(f"Latency, class {c}", cols))
    console.print(breakdown_table(overall))
    console.print(throughput_table(overall))
    if all("kv" in o for o in outs.values()):
        console.print(kv_table(outs))
    if any("stream" in o for o in outs.values()):
        console.print(stream_table(outs))
    for k, o in outs.items():
        run = o["run"]
        if run["cost_extrapolations"]:
            console.print(f"[yellow]warning[/]: {k}: {run['cost_extrapolations']} of "
                          f"{run['cost_lookups']} step-cost lookups fell outside the profile's "
                          "measured range and were extrapolated")


STREAM_ROWS = (
    ("frames", "SSE frames"), ("tokens_per_frame", "tokens per frame"),
    ("bytes", "bytes sent"), ("heartbeats", "heartbeat frames"),
    ("peak_buffer_bytes_max", "peak send buffer, max (B)"),
    ("peak_buffer_bytes_p99", "peak send buffer, P99 (B)"),
    ("over_capacity", "streams over buffer_bytes"), ("degraded", "degraded to one body"),
    ("blocked_streams", "streams blocked"), ("blocked_s", "time blocked (s)"),
    ("disconnects_signalled", "disconnects, signalled"),
    ("disconnects_unsignalled", "disconnects, silent"),
    ("disconnects_cancelled", "cancelled by the server"),
    ("wasted_gpu_s_signalled", "GPU-s after signalled ones"),
    ("wasted_gpu_s_unsignalled", "GPU-s after silent ones"),
    ("wasted_cost_usd_unsignalled", "$ after silent ones"),
)


def stream_table(outs: dict[str, dict]) -> Table:
    """The stream model's totals: frames, bytes, buffers, backpressure, disconnects and
    the GPU time spent for clients that had gone; one column per run."""
    t = Table(title="Streaming and disconnects", title_justify="left")
    t.add_column("")
    for name in outs:
        t.add_column(name, justify="right")
    for key, label in STREAM_ROWS:
        t.add_row(label, *[fmt(o.get("stream", {}).get(key)) for o in outs.values()])
    nets = [o.get("network") for o in outs.values()]
    if any(nets):
        regions = sorted({r for n in nets if n for r in n["requests_per_region"]})
        for r in regions:
            t.add_row(f"requests to {r}",
                      *[fmt((n or {}).get("requests_per_region", {}).get(r)) for n in nets])
        t.add_row("mean RTT (ms)", *[fmt((n or {}).get("mean_rtt_ms")) for n in nets])
    return t


def json_safe(o):
    """``o`` with NaN/inf as None and numpy scalars as Python numbers, for JSON."""
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if isinstance(o, dict):
        return {k: json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    if hasattr(o, "item") and callable(o.item):  # numpy scalars
        return json_safe(o.item())
    return o


def write_run(out_dir: Path, scenario, outs: dict[str, dict], tables: dict[str, pd.DataFrame],
              series: dict[str, pd.DataFrame] | None = None) -> list[Path]:
    """Write requests.csv (one per policy when several), summary.json, scenario.yaml."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    multi = len(tables) > 1
    for k, df in tables.items():
        p = out_dir / (f"requests-{k}.csv" if multi else "requests.csv")
        df.to_csv(p, index=False, float_format="%.9g")
        written.append(p)
    for k, s in (series or {}).items():
        p = out_dir / (f"timeseries-{k}.csv" if multi else "timeseries.csv")
        s.to_csv(p, index=False, float_format="%.9g")
        written.append(p)
    p = out_dir / "summary.json"
    p.write_text(json.dumps(json_safe(outs if multi else next(iter(outs.values()))), indent=2) + "\n")
    written.append(p)
    p = out_dir / "scenario.yaml"
    p.write_text(yaml.safe_dump(scenario.model_dump(mode="json"), sort_keys=False))
    written.append(p)
    return written


def series_table(res) -> pd.DataFrame:
    """Per-replica time series (queue length, running batch, KV use) as one table."""
    frames = []
    for i, (ts, wq, run, blk, kv, shared) in enumerate(res.rec.series):
        frames.append(pd.DataFrame({"replica": i, "time": list(ts), "waiting": list(wq),
                                    "running": list(run), "kv_blocks_reserved": list(blk),
                                    "kv_tokens": list(kv), "kv_blocks_shared": list(shared)}))
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if len(df):
        df["kv_reserved_frac"] = df["kv_blocks_reserved"] / res.kv_capacity_blocks
        # Utilisation as the seeds define it: tokens held / token slots reserved.
        slots = df["kv_blocks_reserved"] * res.scenario.engine.kv.block_size
        df["kv_utilization"] = (df["kv_tokens"] / slots.where(slots > 0)).clip(upper=1.0)
    return df
