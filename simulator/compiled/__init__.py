"""The fast loop, compiled with numba (the optional ``fast`` extra).

``fastloop`` replays the SimPy model without SimPy; this package is the same replay
compiled to machine code, for the configurations large runs use: the three built-in
policies (fifo, chunked prefill, priority classes with aging), paged or contiguous
memory with watermarks, round-robin or least-outstanding routing, keep-alive pools, a
measured profile without noise, and a clock stop. It runs ``benchmarks/sim_speed.py``
an order of magnitude faster than ``fastloop``.

It is not an approximation either: every decision and formula is ``fastreplica``'s /
``fastapply``'s, events are processed in SimPy's order, the floating-point operations
are the same in the same order, and the ITL histogram is fed the same entries with
the same flushes. ``tests/test_compiled.py`` checks the results against the SimPy
model bit for bit on random configurations.

What it does not cover is decided before the run (``kernel_reason``): prefix caching,
the random router, cost noise, or numba not installed; those run on ``fastloop``. A
run that needs a preemption (growth finds too few free blocks), or that hits an empty
plan, is handed back mid-run (``Handback``) and ``simulate`` runs it again, from the
seed, on ``fastloop``.
"""
from __future__ import annotations

import importlib.util
import sys
from array import array
from typing import Optional

import numpy as np

from ..blockmanager import KVStats
from ..costmodel.profile import ProfileCostModel
from ..network import ConnectionPools
from ..replica import MAX_EPOCH_STEPS
from ..scheduling.policies import ChunkedPolicy, FifoPolicy, PriorityAgingPolicy

__all__ = ["Handback", "kernel_reason", "run_compiled", "worth_compiling"]


class Handback(Exception):
    """The compiled loop stopped a run it does not model (the message says why)."""


# ``auto`` compiles (once per machine: numba caches the machine code on disk, which
# takes ~45 s on a 2-core box) only for runs the Python loop would take seconds on.
COMPILE_MIN_REQUESTS = 10_000
MAX_CLASSES = 1024          # priority values the compiled aging queue takes (0..1023)
SERIES_CAP = 4096           # time-series samples buffered per replica between hand-overs


def worth_compiling(n_requests: int) -> bool:
    """Whether ``loop="auto"`` should use the compiled loop for a run this size: a
    large run, or any run once this process has the compiled code loaded (a sweep's
    later points). Results do not depend on it, only the speed does."""
    if n_requests >= COMPILE_MIN_REQUESTS:
        return True
    loop = sys.modules.get(__name__ + ".loop")
    return loop is not None and bool(loop.run.signatures)


def kernel_reason(policy, rules, pools, costs, router: str, priority=None) -> Optional[str]:
    """Why the compiled loop cannot run this configuration (None if it can); asked
    after ``fastloop.unsupported_reason`` found the fast loop can."""
    if importlib.util.find_spec("numba") is None:
        return "numba is not installed (pip install latsim[fast])"
    if type(policy) not in (ChunkedPolicy, FifoPolicy, PriorityAgingPolicy):
        return f"policy {policy.name!r}"
    if rules.prefix_caching and rules.allocation == "paged":
        return "prefix caching"
    if router not in ("round_robin", "least_outstanding"):
        return f"router {router!r}"
    if type(pools) is not ConnectionPools:
        return "HTTP/2 connections"
    if type(policy) is PriorityAgingPolicy and priority is not None and len(priority):
        lo, hi = int(np.min(priority)), int(np.max(priority))
        if lo < 0 or hi >= MAX_CLASSES:
            return f"priority classes outside 0..{MAX_CLASSES - 1}"
    for c in costs:
        if type(c) is not ProfileCostModel:
            return "a cost model other than a profile"
        if c._rng is not None:
            return "cost noise"
    return None


def run_compiled(*, rec, n_replicas: int, policy, costs, capacity: int, rules, pools, net,
                 frame_time: float, one_way: float, series_interval: float, arrival, prompt,
                 output, priority, clients, until: Optional[float],
                 router: str) -> tuple[float, list]:
    """Run the model compiled; fills ``rec``, the pools' and cost models' tallies.
    Returns (end of the run, each replica's ``KVStats``); raises ``Handback``."""
    from . import state as S
    from .cost import pack_cost
    from .loop import run

    R = n_replicas
    lim = policy.limits
    max_seqs = lim.max_num_seqs
    n = len(arrival)
    bs = rules.block_size
    IP = np.zeros(S.P_NCOLS, dtype=np.int64)
    IP[S.P_R] = R
    IP[S.P_BUDGET] = lim.max_num_batched_tokens
    IP[S.P_MAXSEQS] = max_seqs
    IP[S.P_CHUNK] = getattr(policy, "chunk_size", 0) or 0
    IP[S.P_FIFO] = type(policy) is FifoPolicy
    IP[S.P_CAPACITY] = capacity
    IP[S.P_WATERMARK] = int(rules.watermark * capacity)
    IP[S.P_PAGED] = rules.allocation == "paged"
    IP[S.P_BS] = bs
    IP[S.P_MAXLEN] = -1 if rules.max_model_len is None else rules.max_model_len
    IP[S.P_ROUTER] = S.ROUTER_RR if router == "round_robin" else S.ROUTER_LEAST
    IP[S.P_REUSE] = bool(pools.reuse)
    IP[S.P_POOLSIZE] = pools.size
    IP[S.P_HASUNTIL] = until is not None
    IP[S.P_MAXEPOCH] = MAX_EPOCH_STEPS
    flush = rec.itl.FLUSH
    IP[S.P_FLUSH] = flush
    series_cap = SERIES_CAP
    IP[S.P_SERCAP] = series_cap
    aging = type(policy) is PriorityAgingPolicy
    IP[S.P_AGING] = aging
    FP = np.zeros(S.D_NCOLS)
    FP[S.D_HANDSHAKE] = net.handshake
    FP[S.D_ONEWAY] = one_way
    FP[S.D_FT] = frame_time
    FP[S.D_INTERVAL] = series_interval
    FP[S.D_UNTIL] = float(until) if until is not None else 0.0
    FP[S.D_KEEPALIVE] = pools.keepalive
    FP[S.D_AGING] = policy.aging_s if aging else 1.0

    arrival = np.ascontiguousarray(arrival, dtype=np.float64)
    prompt = np.ascontiguousarray(prompt, dtype=np.int64)
    output = np.ascontiguousarray(output, dtype=np.int64)
    clients = np.ascontiguousarray(clients, dtype=np.int64)
    prio = np.ascontiguousarray(priority, dtype=np.int64)
    # The queue class of each request: its priority with aging, else one FIFO.
    cls = prio if aging else np.zeros(n, dtype=np.int64)
    n_cls = int(prio.max()) + 1 if aging and n else 1
    WQ = (np.full((R, n_cls), -1, dtype=np.int64),      # W_HEAD
          np.full((R, n_cls), -2, dtype=np.int64),      # W_TAIL (-2: class never seen)
          np.zeros((R, n_cls), dtype=np.int64),         # W_LEN
          np.zeros((R, n_cls), dtype=np.int64),         # W_ORDER
          np.zeros(n_cls, dtype=np.int64),              # W_CUR
          np.zeros(max_seqs + 2, dtype=np.int64))       # W_ADM
    # ``NetworkTiming.send_time`` of each request, by the method itself (once per length).
    lengths, inverse = np.unique(prompt, return_inverse=True)
    send = np.array([net.send_time(int(p)) for p in lengths], dtype=np.float64)[inverse]

    GI = np.zeros(S.G_NCOLS, dtype=np.int64)
    GI[S.G_RR] = -1
    GF = np.zeros(S.H_NCOLS)
    RS = np.zeros((R, S.R_NCOLS), dtype=np.int64)
    RS[:, S.R_GROWN] = -1
    RS[:, S.R_FREE] = capacity
    RS[:, S.R_IDLE] = 1
    RF = np.zeros((R, S.F_NCOLS))
    RF[:, S.F_LASTSAMPLE] = -np.inf
    RQ = np.zeros((n, S.Q_NCOLS), dtype=np.int64)
    RQ[:, S.Q_NEXT] = -1
    # The kernel writes the recorder's arrays in place (``state.RECORDED``).
    TS = tuple(getattr(rec, name) for name in S.RECORDED)
    width = max_seqs + 2
    DEC = np.zeros((R, width), dtype=np.int64)
    PRE = np.zeros((R, width), dtype=np.int64)
    CHR = np.zeros((R, width), dtype=np.int64)
    CHN = np.zeros((R, width), dtype=np.int64)
    CHP = np.zeros(width, dtype=np.int64)
    CHF = np.zeros(width, dtype=np.bool_)
    PHASE = np.zeros((R, bs), dtype=np.int64)
    ENDS = np.zeros((R, MAX_EPOCH_STEPS))
    LT_T = np.zeros((R, width))
    LT_C = np.zeros((R, width), dtype=np.int64)
    SER = np.zeros((R, 6, series_cap))
    n_clients = len(pools._open)
    IDL = np.zeros((n_clients, max(pools.size, 1)))
    ILEN = np.zeros(n_clients, dtype=np.int64)
    OPEN = np.zeros(n_clients, dtype=np.int64)
    ITL_G = np.zeros(flush + MAX_EPOCH_STEPS + 1)
    ITL_W = np.zeros(flush + MAX_EPOCH_STEPS + 1, dtype=np.int64)
    CF, PT, DT, ET, G, YB, SL, BEY = pack_cost(costs[0], max_seqs)
    CL = np.zeros((R, 2), dtype=np.int64)

    itl = rec.itl

    def drain_series() -> None:
        for r in range(R):
            k = int(RS[r, S.R_NSER])
            for f in range(6):
                rec.series[r][f].frombytes(SER[r, f, :k].tobytes())
            RS[r, S.R_NSER] = 0

    status = S.Y_DONE
    for status in run(arrival, prompt, output, clients, prio, cls, send, IP, FP, GI, GF, RS, RF,
                      RQ, TS, WQ, DEC, PRE, CHR, CHN, CHP, CHF, PHASE, ENDS, LT_T, LT_C, SER,
                      IDL, ILEN, OPEN, ITL_G, ITL_W, CF, PT, DT, ET, G, YB, SL, BEY, CL):
        if status == S.Y_ITL:
            k = int(GI[S.G_ITL])
            itl._g = array("d", ITL_G[:k].tobytes())
            itl._w = array("q", ITL_W[:k].tobytes())
            itl._flush()
            GI[S.G_ITL] = 0
        elif status == S.Y_SERIES:
            drain_series()
        else:
            break
    if status == S.Y_PREEMPT:
        raise Handback("a preemption")
    if status == S.Y_EMPTY:
        raise Handback("an empty plan")
    # What is left in the ITL buffer stays buffered, as it would in ``ItlHistogram``.
    k = int(GI[S.G_ITL])
    itl._g = array("d", ITL_G[:k].tobytes())
    itl._w = array("q", ITL_W[:k].tobytes())
    drain_series()
    rec.steps += int(GI[S.G_STEPS])
    rec.step_time_total += float(GF[S.H_STEPTOT])
    pools.new_connections += int(GI[S.G_NEWC])
    pools.reused_connections += int(GI[S.G_REUSEDC])
    stats = []
    for r in range(R):
        costs[r].lookups += int(CL[r, 0])
        costs[r].extrapolations += int(CL[r, 1])
        st = KVStats()
        st.admissions = int(RS[r, S.R_ADMISSIONS])
        st.queried_tokens = int(RS[r, S.R_QUERIED])
        stats.append(st)
    return float(GF[S.H_NOW]), stats
