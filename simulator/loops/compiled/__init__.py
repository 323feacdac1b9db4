"""The SimPy model's replicas, compiled with numba: the fast event loop.

It runs the configurations large runs use: every policy whose kernels it knows (the
built-in ones: fifo, chunked prefill, priority classes with aging, the weighted fair
score), paged or contiguous memory with watermarks and preemption (by recompute or swap,
either victim rule), prefix caching (``prefix``: the block pools and tables of
``model.kv.prefixcache``, whose kernels ``PrefixKV`` runs for SimPy) with or without a CPU
tier under it (``model.kv.offload``), async scheduling
and the API server front end, round-robin, random or least-outstanding routing,
keep-alive pools, a measured profile without noise, and a clock stop. The decisions are
the very kernels the SimPy model calls: the policies' fill rules and order keys and the
queue's tie rule (``model.scheduling.queues``), how many candidates a fill is offered
(``policy.next_offer``), the memory rules (``model.kv.rules``) and the prefix cache's
(``model.kv.prefixcache``), async scheduling's (``model.scheduling.asyncsched``), what a
step does to a request and the decode tick's keys (``model.scheduling.progress``), the decode epoch's
rules (``model.scheduling.epoch``), the connection pools (``wire.keepalive``), the
routers' picks (``cluster.picks``) and the cost models' kernels. The loop keeps the
SimPy replica's fast bookkeeping (decode epochs, a replica-wide decode tick, decoders
grouped by the tick at which they take their next block) on arrays, processes events
in SimPy's order, does the same floating-point operations in the same order, and feeds
the ITL histogram the same entries with the same flushes. ``tests/test_compiled.py``
checks its results against the SimPy model bit for bit on random configurations.

What it does not cover is decided before the run (``kernel_reason``); those runs use
SimPy. A run that hits an empty plan (an error the SimPy model reports) is handed back
mid-run (``Handback``) and ``simulate`` runs it again, from the seed, on SimPy.
"""
from __future__ import annotations

import importlib.util
from array import array
from typing import Optional

import numpy as np

from simulator import kernel as _kernel
from simulator.cost.model import compiled_reason
from simulator.model.kv import rules as kvr
from simulator.model.kv.manager import KVStats
from simulator.loops.compiled.cost import cost_kind
from simulator.wire.network import ConnectionPools
from simulator.model.scheduling.epoch import MAX_EPOCH_STEPS, fast_reason

__all__ = ["Handback", "kernel_reason", "run_compiled", "worth_compiling"]


class Handback(Exception):
    """The compiled loop stopped a run it does not model (the message says why)."""


# ``auto`` compiles (once per machine and version of the sources: ``simulator.kernel`` caches the
# machine code on disk; ~1 min on a 2-core box) only for runs the Python loop would
# take longer on: loading the cached code takes ~0.3 s, the Python loop 150 us (plain
# chunked traffic) to ~1.3 ms (prefix caching, roofline costs) per request. Measured on
# a loaded 2-core box (``latsim run`` quickstart, simulating time): 1,000 requests
# 0.44 s SimPy / 0.31 s compiled; 4,800: 1.50 s / 0.33 s.
COMPILE_MIN_REQUESTS = 1_000
MAX_CLASSES = 1024          # priority values the compiled aging queue takes (0..1023)
SERIES_CAP = 4096           # time-series samples buffered per replica between hand-overs


def worth_compiling(n_requests: int) -> bool:
    """Whether ``loop="auto"`` should use the compiled loop for a run this size. The
    results do not depend on it, only the speed does; it depends on the size alone (not
    on what this process ran before), so that which loop ran, which a summary and a
    sweep's table record, is the same on every run of a scenario."""
    return n_requests >= COMPILE_MIN_REQUESTS


def kernel_reason(policy, rules, pools, costs, router: str, priority=None, *,
                  rich: bool = False, mode: str = "auto", cost_given: bool = False,
                  frame_time: float = 0.0, traffic: Optional[str] = None,
                  speculative: bool = False, async_sched: bool = False,
                  frontend: bool = False) -> Optional[str]:
    """Why the compiled loop cannot run this configuration (None if it can), in one line.
    ``traffic``: the traffic control the scenario asks for (admission, clients,
    autoscaling, utilisation series), which only the SimPy gateway models;
    ``speculative``: speculative decoding, which only the SimPy replica models.
    ``async_sched`` (``model.scheduling.asyncsched``) and ``frontend`` (the API server
    stage, ``wire.frontend``) run compiled; they stay parameters for the callers."""
    from simulator.loops.compiled.queue import policy_ids
    if importlib.util.find_spec("numba") is None:
        return "numba is not installed"
    if not _kernel.ENABLED:
        return "LATSIM_NO_JIT is set"
    if mode != "auto":
        return f"bookkeeping mode {mode!r} was asked for"
    if rich:
        return "per-request stream models"
    if traffic:
        return traffic
    if speculative:
        return "speculative decoding (engine.speculative)"
    if cost_given:
        return "a cost model passed in"
    if getattr(rules, "offload_async", False):
        return "asynchronous KV loads from the CPU tier (engine.kv.offload.load: async)"
    if policy_ids(policy) is None:
        from simulator.model.scheduling.queues import heads_suffice
        if not heads_suffice(policy):   # e.g. sjf: prompts do not follow arrival order
            return (f"policy {policy.name!r} compares every waiting request by its own key "
                    "(the compiled loop compares per-class FIFO heads)")
        return f"policy {policy.name!r} has kernels the compiled loop does not know"
    lim = policy.limits
    if router not in ("round_robin", "least_outstanding", "random"):
        return f"router {router!r}"
    if type(pools) is not ConnectionPools:
        return "HTTP/2 connections"
    if policy.by_class and priority is not None and len(priority):
        lo, hi = int(np.min(priority)), int(np.max(priority))
        if lo < 0 or hi >= MAX_CLASSES:
            return f"priority classes outside 0..{MAX_CLASSES - 1}"
    for c in costs:
        if cost_kind(c) is None:
            return f"cost model {type(c).__name__}"
        why = compiled_reason(c)       # the cost model's own say (``StepCost``)
        if why:
            return why
        # The loop keeps only the fast bookkeeping (decoders on one tick, epochs).
        why = fast_reason(frame_time, c.min_step_s, lim.max_num_seqs,
                          lim.max_num_batched_tokens)
        if why:
            return why
    return None


def run_compiled(*, rec, n_replicas: int, policy, costs, capacity: int, rules, swap: tuple,
                 pools, net, frame_time: float, one_way: float, series_interval: float,
                 arrival, prompt, output, priority, clients, until: Optional[float],
                 router: str, router_rng=None, keys=None,
                 async_sched: bool = False, offload_bps: float = 0.0) -> tuple[float, list]:
    """Run the model compiled; fills ``rec``, the pools' and cost models' tallies.
    ``swap``: bytes per block, CPU swap space (blocks), copy bandwidth (bytes/s);
    ``router_rng``: the random router's generator; ``keys``: the prefix keys
    (``prefixkeys.WorkloadKeys``) when prefix caching is on; ``async_sched``: async
    scheduling (``model.scheduling.asyncsched``); ``offload_bps``: the link of the CPU
    tier of ``rules.offload_blocks`` blocks (``model.kv.offload``), when there is one.
    Returns (end of the run, each replica's ``KVStats``); raises ``Handback``.

    Long, and kept whole: it is the one place where the Python objects (policy limits,
    KV rules, pools, cost models, recorder) become the flat arrays the kernels read and
    where the kernels' results go back; each block is a column list, not logic, and
    splitting it would pass those dozens of arrays between helpers."""
    from simulator.loops.compiled import state as S
    from simulator.loops.compiled.cost import pack_cost
    from simulator.loops.compiled.loop import run
    from simulator.loops.compiled.prefix import pack_prefix
    from simulator.model.kv.manager import pool_stats

    R = n_replicas
    lim = policy.limits
    max_seqs = lim.max_num_seqs
    n = len(arrival)
    bs = rules.block_size
    from simulator.loops.compiled.queue import policy_ids
    fill_id, order_id = policy_ids(policy)
    by_class = policy.by_class
    flush = rec.itl.FLUSH
    series_cap = SERIES_CAP
    IP = np.zeros(S.P_NCOLS, dtype=np.int64)
    for col, v in ((S.P_R, R), (S.P_BUDGET, lim.max_num_batched_tokens),
                   (S.P_MAXSEQS, max_seqs), (S.P_CHUNK, policy.fill_limits()[1]),
                   (S.P_FILLBUDGET, policy.fill_limits()[0]),
                   (S.P_FILLSEQS, policy.fill_limits()[2]),
                   (S.P_FILL, fill_id), (S.P_CAPACITY, capacity),
                   (S.P_WATERMARK, kvr.watermark_blocks(float(rules.watermark), capacity)),
                   (S.P_PAGED, rules.allocation == "paged"), (S.P_BS, bs),
                   (S.P_MAXLEN, -1 if rules.max_model_len is None else rules.max_model_len),
                   (S.P_ROUTER, {"round_robin": S.ROUTER_RR, "random": S.ROUTER_RANDOM,
                                 "least_outstanding": S.ROUTER_LEAST}[router]),
                   (S.P_REUSE, bool(pools.reuse)), (S.P_POOLSIZE, pools.size),
                   (S.P_HASUNTIL, until is not None),
                   (S.P_FLUSH, flush), (S.P_SERCAP, series_cap), (S.P_ORDER, order_id),
                   (S.P_REQUEUE, policy.requeue), (S.P_TIMEDEP, policy.time_dependent),
                   (S.P_PADDED, bool(costs[0].padded)),
                   (S.P_SWAP, rules.preemption == "swap"),
                   (S.P_VICTIM, rules.victim == "priority"),
                   (S.P_CPUBLOCKS, swap[1]),
                   (S.P_PREFIX, rules.prefix_caching and rules.allocation == "paged"),
                   (S.P_ASYNC, async_sched),
                   (S.P_OFFLOAD, rules.offload_blocks is not None and rules.prefix_caching
                    and rules.allocation == "paged")):
        IP[col] = v
    FP = np.zeros(S.D_NCOLS)
    for col, v in ((S.D_HANDSHAKE, net.handshake), (S.D_ONEWAY, one_way),
                   (S.D_FT, frame_time), (S.D_INTERVAL, series_interval),
                   (S.D_UNTIL, float(until) if until is not None else 0.0),
                   (S.D_KEEPALIVE, pools.keepalive),
                   (S.D_BLOCKBYTES, swap[0]), (S.D_SWAPBPS, swap[2]),
                   (S.D_NETONEWAY, net.one_way), (S.D_FIRSTOUT, net.frontend.per_output_s),
                   (S.D_OFFBPS, offload_bps)):
        FP[col] = v

    prompt = np.ascontiguousarray(prompt, dtype=np.int64)
    prio = np.ascontiguousarray(priority, dtype=np.int64)
    # ``NetworkTiming.send_time`` of each request, by the method itself (once per length).
    lengths, inverse = np.unique(prompt, return_inverse=True)
    send = np.array([net.send_time(int(p)) for p in lengths], dtype=np.float64)[inverse]
    # The queue class of each request: its priority if the order has classes, else one FIFO.
    cls = prio if by_class else np.zeros(n, dtype=np.int64)
    W = (np.ascontiguousarray(arrival, dtype=np.float64), prompt,
         np.ascontiguousarray(output, dtype=np.int64),
         np.ascontiguousarray(clients, dtype=np.int64), prio, cls, send,
         # ``RandomRouter.pick`` draws ``integers(replicas)`` once per routed request; a
         # generator gives the same numbers drawn one at a time or all at once.
         router_rng.integers(R, size=n) if router == "random" else np.zeros(0, np.int64))
    n_cls = int(prio.max()) + 1 if by_class and n else 1
    # Candidates the fill rule is offered: at most one past the free sequence slots,
    # offered in doubling batches (so up to twice that).
    n_cand = 2 * max_seqs + 4
    WQ = (np.full((R, n_cls), -1, dtype=np.int64),      # W_HEAD
          np.full((R, n_cls), -2, dtype=np.int64),      # W_TAIL (-2: class never seen)
          np.zeros((R, n_cls), dtype=np.int64),         # W_LEN
          np.zeros((R, n_cls), dtype=np.int64),         # W_ORDER
          np.zeros(n_cls, dtype=np.int64),              # W_CUR
          np.zeros(n_cand, dtype=np.int64),             # W_CAND
          np.zeros(n_cand, dtype=np.int64),             # W_CREM
          np.zeros(n_cand, dtype=np.int64),             # W_CNEED
          np.zeros(n_cand, dtype=np.int64),             # W_COUT
          np.zeros(max_seqs + 2, dtype=np.int64),       # W_PREM
          np.zeros(max_seqs + 2, dtype=np.int64),       # W_POUT
          np.asarray(policy.order_array, dtype=np.float64))   # W_OP

    GI = np.zeros(S.G_NCOLS, dtype=np.int64)
    GI[S.G_RR] = -1
    GF = np.zeros(S.H_NCOLS)
    RS = np.zeros((R, S.R_NCOLS), dtype=np.int64)
    RS[:, S.R_GROWN] = -1
    RS[:, S.R_FREE] = capacity
    RS[:, S.R_IDLE] = 1
    RF = np.zeros((R, S.F_NCOLS))
    RF[:, S.F_LASTSAMPLE] = -np.inf
    RF[:, S.F_DECIDED] = -np.inf
    RF[:, S.F_STEPEND] = -np.inf
    RQ = np.zeros((n, S.Q_NCOLS), dtype=np.int64)
    RQ[:, S.Q_NEXT] = -1
    RQ[:, S.Q_PLEN] = prompt
    RQ[:, S.Q_LATE] = -1
    RQ[:, S.Q_FKEY] = -1
    RQ[:, S.Q_ROUND] = -1
    RQF = np.zeros((n, S.QF_NCOLS))
    RQF[:, S.QF_PREEMPTED_AT] = np.nan          # never preempted
    # The kernel writes the recorder's arrays in place (``state.RECORDED``).
    TS = tuple(getattr(rec, name) for name in S.RECORDED)
    width = max_seqs + 2
    BUF = (np.zeros((R, width), dtype=np.int64),        # DEC: the decoders (a set)
           np.zeros((R, width), dtype=np.int64),        # PRE: prefilling, in order
           np.zeros((R, width), dtype=np.int64),        # CHR: the step's chunks: request,
           np.zeros((R, width), dtype=np.int64),        # CHN: tokens,
           np.zeros(width, dtype=np.int64),             # CHP: prior tokens (scratch),
           np.zeros(width, dtype=np.bool_),             # CHF: completes its prefill
           np.zeros((R, bs), dtype=np.int64),           # PHASE: decoders by growth phase
           np.zeros((R, MAX_EPOCH_STEPS)),              # ENDS: the epoch's step ends
           np.zeros((R, width)),                        # LT_T, LT_C: ``_last_tok``
           np.zeros((R, width), dtype=np.int64),
           np.zeros((R, 6, series_cap)),                # SER: time-series buffer
           np.zeros(R, dtype=np.int64))                 # LOAD: outstanding tokens (router)
    # The pools' own arrays (``wire.keepalive``): the loop runs their rules on them.
    POOL = (pools.idle, pools.n_idle, pools.n_open)
    # ITL entries of one event: gaps since each group's last token (up to a batch), an
    # epoch's gaps, and recomputed prefills' gaps; plus what waits for a flush.
    cap = flush + MAX_EPOCH_STEPS + 2 * width + 16
    ITL = (np.zeros(cap), np.zeros(cap, dtype=np.int64), np.zeros(2 * width + 16, dtype=np.int64))
    # The cost model's arrays, the lookup counts per replica, epoch scratch, empty chunks.
    PFX = pack_prefix(IP[S.P_PREFIX] != 0, keys, R, capacity, n,
                      rules.offload_blocks if IP[S.P_OFFLOAD] else None)
    COST = pack_cost(costs[0]) + (np.zeros((R, 2), dtype=np.int64), np.zeros(MAX_EPOCH_STEPS),
                                  np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.bool_))

    itl = rec.itl

    def drain_itl(final: bool) -> None:
        # Each flush the histogram would have made, over the same entries; the rest
        # stays buffered (at the end: in the histogram's buffer, as it would be).
        g, w, marks = ITL
        start = 0
        for end in marks[:int(GI[S.G_NFL])].tolist():
            itl._g = array("d", g[start:end].tobytes())
            itl._w = array("q", w[start:end].tobytes())
            itl._flush()
            start = end
        k = int(GI[S.G_ITL]) - start
        if final:
            itl._g = array("d", g[start:start + k].tobytes())
            itl._w = array("q", w[start:start + k].tobytes())
            return
        g[:k] = g[start:start + k].copy()
        w[:k] = w[start:start + k].copy()
        GI[S.G_ITL] = k
        GI[S.G_ITLSEG] = 0
        GI[S.G_NFL] = 0

    def drain_series() -> None:
        ser = BUF[10]
        for r in range(R):
            k = int(RS[r, S.R_NSER])
            for f in range(6):
                rec.series[r][f].frombytes(ser[r, f, :k].tobytes())
            RS[r, S.R_NSER] = 0

    status = S.Y_DONE
    for status in run(W, IP, FP, GI, GF, RS, RF, RQ, RQF, TS, WQ, BUF, POOL, ITL, COST, PFX):
        if status == S.Y_ITL:
            drain_itl(False)
        elif status == S.Y_SERIES:
            drain_series()
        else:
            break
    if status == S.Y_EMPTY:
        raise Handback("an empty plan")
    drain_itl(True)
    drain_series()
    rec.steps += int(GI[S.G_STEPS])
    rec.step_time_total += float(GF[S.H_STEPTOT])
    rec.swap_copy_s += float(GF[S.H_SWAPCOPY])
    if IP[S.P_OFFLOAD] and rec.kv_load_s is not None:
        rec.loaded_tokens[:] = PFX[6]           # (``Recorder.track_offload``)
        rec.kv_load_s[:] = PFX[7]
    pools.new_connections += int(GI[S.G_NEWC])
    pools.reused_connections += int(GI[S.G_REUSEDC])
    CL = COST[11]
    stats = []
    for r in range(R):
        costs[r].lookups += int(CL[r, 0])
        costs[r].extrapolations += int(CL[r, 1])
        if IP[S.P_PREFIX]:
            stats.append(pool_stats(PFX[0][r], PFX[5][r] if IP[S.P_OFFLOAD] else None))
            continue
        st = KVStats()
        st.admissions = int(RS[r, S.R_ADMISSIONS])
        st.queried_tokens = int(RS[r, S.R_QUERIED])
        stats.append(st)
    return float(GF[S.H_NOW]), stats
