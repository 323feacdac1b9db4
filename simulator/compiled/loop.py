"""The compiled event loop: ``fastloop.FastLoop.run`` (arrivals, deliveries, each
replica's step ends) as a numba generator.

It yields to Python only when a buffer Python owns must be drained: the ITL
buffer (``Y_ITL``, exactly where ``ItlHistogram.add``/``add_many`` would flush, so
the histogram's sums are formed over the same entries), the time-series buffers
(``Y_SERIES``), and at the end (``Y_DONE``, or ``Y_PREEMPT``/``Y_EMPTY`` when the run
must be handed back to the Python loops)."""
from __future__ import annotations

import heapq

import numpy as np
from numba import njit

from .apply import catch_up_growth, finish_due, prefill, sample
from .replica import (
    acquire,
    enqueue,
    interrupted,
    outstanding,
    plan,
    push,
    rejects,
    release,
)
from .state import (
    D_HANDSHAKE,
    D_INTERVAL,
    D_ONEWAY,
    D_UNTIL,
    EV_ARRIVE,
    EV_DELIVER,
    EV_END,
    EV_INTERRUPT,
    EV_WAKE,
    F_EPSTART,
    F_LASTSAMPLE,
    G_EID,
    G_ITL,
    G_NEXT,
    G_RR,
    G_STEPS,
    H_NOW,
    H_STEPTOT,
    H_T,
    MODE_EPOCH,
    MODE_NONE,
    NORMAL,
    P_FLUSH,
    P_HASUNTIL,
    P_PAGED,
    P_R,
    P_ROUTER,
    P_SERCAP,
    Q_POOLED,
    R_EPM,
    R_HASENDS,
    R_IDLE,
    R_INEP,
    R_KV,
    R_MODE,
    R_ND,
    R_NLT,
    R_NSER,
    R_OUT,
    R_STEPND,
    R_TICKS,
    R_VER,
    R_WAKE,
    ROUTER_RR,
    T_ENQ,
    T_NEWC,
    T_REJ,
    T_REPLICA,
    URGENT,
    Y_DONE,
    Y_ITL,
    Y_SERIES,
)


@njit(cache=True)
def arrivals(now, resumed, heap, GI, GF, IP, FP, RQ, TS, arrival, clients, send, IDL, ILEN,
             OPEN):
    """``FastLoop._arrivals``: send every request whose time has come."""
    n = arrival.shape[0]
    rid = GI[G_NEXT]
    while rid < n:
        a = arrival[rid]
        if not resumed and a > GF[H_T]:
            push(heap, GI, now + (a - GF[H_T]), NORMAL, EV_ARRIVE, -1, 0)
            GF[H_T] = a
            GI[G_NEXT] = rid
            return
        resumed = False
        is_new, pooled = acquire(clients[rid], now, IP, FP, GI, IDL, ILEN, OPEN)
        TS[T_NEWC][rid] = is_new
        RQ[rid, Q_POOLED] = pooled
        t_net = send[rid] + (FP[D_HANDSHAKE] if is_new else 0.0)
        push(heap, GI, now + t_net, NORMAL, EV_DELIVER, rid, 0)
        rid += 1
    GI[G_NEXT] = n


@njit(cache=True)
def deliver(rid, now, heap, GI, RS, RQ, IP, FP, TS, ENDS, WQ, cls, prompt, output, clients, IDL,
            ILEN):
    """``FastLoop._deliver``: reject, or route and enqueue."""
    TS[T_ENQ][rid] = now
    if rejects(rid, IP, prompt, output):
        TS[T_REJ][rid] = True
        release(clients[rid], now + FP[D_ONEWAY], RQ[rid, Q_POOLED] != 0, IP, IDL, ILEN)
        return
    R = IP[P_R]
    if IP[P_ROUTER] == ROUTER_RR:
        GI[G_RR] = (GI[G_RR] + 1) % R
        k = GI[G_RR]
    else:
        # ``LeastOutstanding``: fewest outstanding tokens, ties to the lowest index.
        k = 0
        best = outstanding(0, now, RS, ENDS)
        for i in range(1, R):
            v = outstanding(i, now, RS, ENDS)
            if v < best:
                k, best = i, v
    TS[T_REPLICA][rid] = k
    enqueue(k, rid, now, heap, GI, RS, RQ, IP, WQ, cls, prompt, output)


@njit(cache=True)
def run(arrival, prompt, output, clients, prio, cls, send, IP, FP, GI, GF, RS, RF, RQ, TS, WQ,
        DEC, PRE, CHR, CHN, CHP, CHF, PHASE, ENDS, LT_T, LT_C, SER, IDL, ILEN, OPEN, ITL_G, ITL_W,
        CF, PT, DT, ET, G, YB, SL, BEY, CL):
    """The run, to the end or the clock stop (see module doc for what it yields)."""
    R = IP[P_R]
    heap = [(0.0, 0, 0, 0, 0, 0)]
    heap.pop()
    FH = [[np.int64(0)] for _ in range(R)]
    for r in range(R):
        FH[r].pop()
    # SimPy's start: the replicas' processes, then the arrival process (urgent, at 0),
    # then the stop of ``run(until)``.
    GI[G_EID] = R
    push(heap, GI, 0.0, URGENT, EV_ARRIVE, -1, 0)
    if IP[P_HASUNTIL]:
        push(heap, GI, FP[D_UNTIL], URGENT, 5, -1, 0)
    resumed = False
    flush = IP[P_FLUSH]
    sercap = IP[P_SERCAP]
    interval = FP[D_INTERVAL]
    paged = IP[P_PAGED]
    while len(heap):
        t, _, _, kind, obj, ver = heapq.heappop(heap)
        GF[H_NOW] = t
        if kind == EV_END:
            r = obj
            if ver != RS[r, R_VER]:
                continue
            # ``FastReplica.ended``: apply the epoch or the step.
            epoch = RS[r, R_MODE] == MODE_EPOCH
            RS[r, R_MODE] = MODE_NONE
            if epoch:
                m = RS[r, R_EPM]
                RS[r, R_INEP] = 0
                RS[r, R_HASENDS] = 0
                GI[G_STEPS] += m
                GF[H_STEPTOT] += ENDS[r, m - 1] - RF[r, F_EPSTART]
                first_end = ENDS[r, 0]
            else:
                m = 1 if RS[r, R_STEPND] else 0
                first_end = t
            if m:
                # ``ReplicaApply._decode_fast``: the gaps since each group's last token,
                # then the epoch's later steps' gaps, one per decoder.
                ndc = RS[r, R_ND]
                for i in range(RS[r, R_NLT]):
                    c = LT_C[r, i]
                    if c:
                        j = GI[G_ITL]
                        ITL_G[j] = first_end - LT_T[r, i]
                        ITL_W[j] = c
                        GI[G_ITL] = j + 1
                        if j + 1 >= flush:
                            yield Y_ITL
                if m > 1:
                    j = GI[G_ITL]
                    for i in range(m - 1):
                        ITL_G[j + i] = ENDS[r, i + 1] - ENDS[r, i]
                        ITL_W[j + i] = ndc
                    GI[G_ITL] = j + m - 1
                    if j + m - 1 >= flush:
                        yield Y_ITL
                RS[r, R_NLT] = 1
                LT_T[r, 0] = t
                LT_C[r, 0] = ndc
                RS[r, R_TICKS] += m
                RS[r, R_KV] += m * ndc
                RS[r, R_OUT] -= m * ndc
            if epoch:
                if paged:
                    catch_up_growth(r, RS[r, R_TICKS] - m, RS, IP, PHASE)
            else:
                prefill(r, t, FH, RS, RQ, IP, FP, TS, DEC, PRE, CHR, CHN, PHASE, LT_T, LT_C,
                        prompt, output, clients, IDL, ILEN)
            finish_due(r, t, FH, RS, RQ, IP, FP, TS, DEC, PHASE, LT_T, LT_C, prompt, output,
                       clients, IDL, ILEN)
            if t - RF[r, F_LASTSAMPLE] >= interval:
                sample(r, t, RS, RF, IP, SER)
                if RS[r, R_NSER] >= sercap:
                    yield Y_SERIES
            status = plan(r, t, heap, FH, GI, GF, RS, RF, RQ, IP, FP, WQ, cls, prio, DEC, PRE, CHR,
                          CHN, CHP, CHF, PHASE, ENDS, TS, prompt, output, CF, PT, DT, ET, G, YB,
                          SL, BEY, CL)
            if status:
                yield status
                return
        elif kind == EV_DELIVER:
            deliver(obj, t, heap, GI, RS, RQ, IP, FP, TS, ENDS, WQ, cls, prompt, output, clients,
                    IDL, ILEN)
        elif kind == EV_ARRIVE:
            arrivals(t, resumed, heap, GI, GF, IP, FP, RQ, TS, arrival, clients, send, IDL, ILEN,
                     OPEN)
            resumed = True
        elif kind == EV_WAKE:
            r = obj
            RS[r, R_IDLE] = 0
            RS[r, R_WAKE] = 0
            status = plan(r, t, heap, FH, GI, GF, RS, RF, RQ, IP, FP, WQ, cls, prio, DEC, PRE, CHR,
                          CHN, CHP, CHF, PHASE, ENDS, TS, prompt, output, CF, PT, DT, ET, G, YB,
                          SL, BEY, CL)
            if status:
                yield status
                return
        elif kind == EV_INTERRUPT:
            interrupted(obj, t, heap, GI, RS, ENDS)
        else:
            break
    yield Y_DONE
