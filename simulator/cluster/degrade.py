"""Degradation when overloaded (降级): a cheaper answer instead of a longer wait.

The gateway asks ``route`` for every routing decision with the replicas it may route
to. Overloaded means those replicas (less the degrade ``pool``'s) hold on average at
least ``queue_per_replica`` waiting requests (``Replica.n_queued``). Not overloaded,
the request goes to them (never to the degrade pool). Overloaded, it goes to the
degrade pool's replicas when there are any routable (a smaller model: its own cost
model, KV capacity and price, ``cluster.pools``), and its output is cut to
``max_output_tokens`` (its KV reservation shrinks with it). Without a ``pool`` only the
cap applies.

Overloaded also when no main replica is routable (all down, or their breakers open) and
the degrade pool is: what it serves then is degraded too.

What the run reports (``report.faults.degrade_summary``): a degraded answer is cheaper
and faster, so it can meet the latency SLO while not being the answer asked for.
``overall.slo_attainment`` stays the latency SLO over all requests (``vllm bench
serve``'s goodput); ``summary.json`` ``degrade`` adds ``degraded_requests``,
``good_degraded`` (degraded and within the SLO) and ``slo_attainment_undegraded`` (good
and not degraded / all requests: what a capacity plan should be sized on), and the
fault phases each carry ``degraded`` and ``slo_attainment_undegraded``.

Per request: ``degraded`` (its final attempt was routed while overloaded) and
``output_tokens`` (the tokens it was to generate: the cap when degraded, else its
own); the latter replaces the workload's column in the per-request table, so TPOT and
output throughput count what was served.
"""
from __future__ import annotations

import numpy as np

from simulator.model.kv.blocks import request_blocks


class Degrade:
    """``cfg``: ``config.faults.DegradeConfig``; ``pool_slots``: the degrade pool's slots
    (empty without a pool); ``rid_of(aid)``: the request of an attempt."""

    def __init__(self, cfg, workload, pool_slots, rid_of, block_size: int) -> None:
        self.cfg = cfg
        self.pool = frozenset(pool_slots)
        self.rid_of = rid_of
        self.bs = block_size
        self.full = np.asarray(workload.output_tokens, dtype=np.int64)
        self.output = self.full.copy()
        self.degraded = np.zeros(len(self.full), dtype=bool)
        self.routed = 0           # routing decisions taken while overloaded

    def overloaded(self, reps) -> bool:
        """Whether ``reps`` (the main replicas) hold ``queue_per_replica`` waiting each;
        none routable (all down, or their breakers open) is overloaded too: the degrade
        pool then serves what it is sent, degraded (capped, counted)."""
        return not reps or (sum(r.n_queued() for r in reps) / len(reps)
                            >= self.cfg.queue_per_replica)

    def route(self, slots, seq, replicas) -> list:
        """Of the routable ``slots``, those ``seq`` goes to (module doc); caps its output
        when overloaded."""
        main = [s for s in slots if s not in self.pool]
        rid = self.rid_of(seq.rid)
        if not self.overloaded([replicas[s] for s in main]):
            # (A request held at the gateway keeps the cut it was given.)
            self.degraded[rid] = seq.output_tokens < self.full[rid]
            self.output[rid] = seq.output_tokens
            return main
        self.routed += 1
        self.degraded[rid] = True
        cap = self.cfg.max_output_tokens
        if cap is not None and seq.output_tokens > cap:
            seq.output_tokens = cap
            seq.blocks_needed = request_blocks(seq.prompt_tokens, cap, self.bs)
        self.output[rid] = seq.output_tokens
        small = [s for s in slots if s in self.pool]
        return small or main

    def columns(self) -> dict:
        return {"output_tokens": self.output, "degraded": self.degraded}

    def meta(self) -> dict:
        return {"degraded_requests": int(self.degraded.sum()),
                "overloaded_routings": self.routed,
                "queue_per_replica": self.cfg.queue_per_replica,
                "max_output_tokens": self.cfg.max_output_tokens, "pool": self.cfg.pool}
