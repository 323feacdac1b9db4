"""The console tables a person reads after a run: latency percentiles, the E2E breakdown,
throughput, KV cache and streaming totals, one column per run when several are compared,
split to fit the console's width (``print_run``)."""
from __future__ import annotations

import math

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from simulator.report.cells import fmt
from simulator.report.kv import kv_table
from simulator.report.metrics import BREAKDOWN


def latency_table(title: str, columns: dict[str, dict], side_by_side: bool | None = None) -> Table:
    """P50/P90/P99 of TTFT, TPOT, ITL, E2EL (ms): one column per percentile for a single
    run, one column per run (rows metric x percentile) when comparing several
    (``side_by_side``; default: when there are several)."""
    metrics = ("ttft", "tpot", "itl", "e2el")
    if not any(s.get("p99_itl_ms") is not None and not math.isnan(s.get("p99_itl_ms"))
               for s in columns.values()):
        metrics = ("ttft", "tpot", "e2el")  # per-class tables: ITL is pooled run-wide only
    t = Table(title=title, title_justify="left")
    t.add_column("metric (ms)")
    if not (len(columns) > 1 if side_by_side is None else side_by_side):
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


def breakdown_table(columns: dict[str, dict], side_by_side: bool | None = None) -> Table:
    """Mean and P99 of each additive stage (ms); one column per run when comparing
    (``side_by_side``; default: when there are several)."""
    t = Table(title="E2E breakdown (ms)", title_justify="left")
    t.add_column("stage")
    single = not (len(columns) > 1 if side_by_side is None else side_by_side)
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
    """Completed, not finished, throughputs, goodput and the diagnosis; a column per run."""
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


def print_fitting(console: Console, build, columns: dict) -> None:
    """Print ``build(columns)`` (a table with one column per entry), split into several
    tables of fewer entries when it is wider than the console, so that no cell (a number)
    is ever wrapped or cut: each part keeps the row labels."""
    # Labels come from the scenario: print them as text, never as rich markup.
    columns = {escape(str(k)): v for k, v in columns.items()}
    keys = list(columns)
    width = console.width
    start = 0
    while start < len(keys):
        end = len(keys)
        # The most entries from ``start`` whose table fits (at least one).
        while end - start > 1:
            t = build({k: columns[k] for k in keys[start:end]})
            if console.measure(t).maximum <= width:
                break
            end -= 1
        console.print(build({k: columns[k] for k in keys[start:end]}))
        start = end


def print_run(console: Console, outs: dict[str, dict]) -> None:
    """Print one or several runs (keyed by policy) side by side, as many side by side as
    the console's width allows."""
    overall = {k: o["overall"] for k, o in outs.items()}
    many = len(outs) > 1
    print_fitting(console, lambda cols: latency_table("Latency, all requests", cols, many),
                  overall)
    classes = sorted({c for o in outs.values() for c in o["per_class"]})
    if len(classes) > 1:
        for c in classes:
            cols = {k: o["per_class"].get(c, {}) for k, o in outs.items()}
            print_fitting(console, lambda cc, c=c: latency_table(f"Latency, class {escape(c)}",
                                                                 cc, many), cols)
    print_fitting(console, lambda cols: breakdown_table(cols, many), overall)
    print_fitting(console, throughput_table, overall)
    if all("kv" in o for o in outs.values()):
        print_fitting(console, kv_table, outs)
    if any("stream" in o for o in outs.values()):
        print_fitting(console, stream_table, outs)
    if any("sessions" in o for o in outs.values()):
        from simulator.report.sessions import sessions_console_table   # kind: sessions
        print_fitting(console, sessions_console_table, outs)
    if any("edge" in o for o in outs.values()):
        from simulator.report.edge import edge_table   # an edge node (``cluster.edgerun``)
        print_fitting(console, edge_table, outs)
    for k, o in outs.items():
        run = o["run"]
        if run["cost_extrapolations"]:
            console.print(f"[yellow]warning[/]: {escape(str(k))}: "
                          f"{run['cost_extrapolations']:,} of "
                          f"{run['cost_lookups']:,} step-cost lookups fell outside the "
                          "profile's measured range and were extrapolated")


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
    ("write_timeouts", "closed by the write timeout"),
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
