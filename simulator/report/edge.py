"""The console's table of an edge node's run (``summary.json`` ``edge``, built by
``cluster.edgerun.edge_summary``): how requests were answered, the cache against its
popularity law, the edge model, and what the edge took off the cluster."""
from __future__ import annotations

from rich.table import Table

from simulator.report.cells import fmt

EDGE_ROWS = (
    (("hit",), "cache hits"), (("edge",), "answered by the edge model"),
    (("escalated",), "escalated to the cluster"), (("miss",), "misses sent to the cluster"),
    (("cache", "hit_ratio"), "hit ratio"),
    (("cache", "expected_hit_ratio", "no_eviction"), "law: never evicting"),
    (("cache", "expected_hit_ratio", "lru_che"), "law: LRU steady state (Che)"),
    (("cache", "coalesced_hits"), "hits that waited on a fetch"),
    (("speculation", "escalation_ratio"), "escalation ratio"),
    (("speculation", "edge_gpu_s"), "edge GPU-s"),
    (("speculation", "mean_edge_wait_s"), "mean wait for an edge GPU (s)"),
    (("saved_gpu_s",), "cluster GPU-s saved (alone)"),
    (("saved_gpu_s_at_run_rate",), "cluster GPU-s saved (run rate)"),
    (("saved_cost_usd",), "cluster $ saved (alone)"),
)


def _get(d, path):
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def edge_figures(edge: dict) -> dict:
    """The table's figures of one run as flat ``edge.<path>`` cells (a sweep's row)."""
    return {"edge." + ".".join(path): _get(edge, path) for path, _label in EDGE_ROWS}


def edge_table(outs: dict[str, dict]) -> Table:
    """One column per run; a run without an edge shows dashes."""
    t = Table(title="Edge node", title_justify="left")
    t.add_column("")
    for name in outs:
        t.add_column(name, justify="right")
    for path, label in EDGE_ROWS:
        t.add_row(label, *[fmt(_get(o.get("edge"), path)) for o in outs.values()])
    return t
