"""The compiled event loop: the SimPy run's events (``loops/simpy/driver.py``: arrivals,
deliveries; each replica's step ends, ``Replica._run``) as a numba generator.

It yields to Python only when a buffer Python owns must be drained: the ITL buffer
(``Y_ITL``, when it holds a flush the ``ItlHistogram`` would have made), the
time-series buffers (``Y_SERIES``), and at the end (``Y_DONE``, or ``Y_EMPTY`` when a
plan came out empty and the run must be handed back)."""
from __future__ import annotations

import heapq

import numpy as np

from simulator.loops.compiled import state as S
from simulator.kernel import kernel as jit
from simulator.loops.compiled.apply import catch_up_growth, finish_due, itl_add, itl_add_gaps, prefill, sample
from simulator.cluster.picks import first_least, next_in_turn
from simulator.loops.compiled.plan import plan
from simulator.loops.compiled.replica import enqueue, interrupted, outstanding, push, rejects
from simulator.wire.keepalive import (NEW_ONE_OFF, REUSED, pool_acquire, pool_release,
                                      request_net_s)


@jit
def arrivals(now, resumed, heap, GI, GF, IP, FP, RQ, TS, arrival, clients, send, IDL, ILEN,
             OPEN):
    """``run_simpy``'s ``arrivals``: send every request whose time has come."""
    n = arrival.shape[0]
    rid = GI[S.G_NEXT]
    while rid < n:
        a = arrival[rid]
        if not resumed and a > GF[S.H_T]:
            push(heap, GI, now + (a - GF[S.H_T]), S.NORMAL, S.EV_ARRIVE, -1, 0)
            GF[S.H_T] = a
            GI[S.G_NEXT] = rid
            return
        resumed = False
        got = pool_acquire(IDL, ILEN, OPEN, clients[rid], now, FP[S.D_KEEPALIVE],
                           IP[S.P_POOLSIZE], IP[S.P_REUSE] != 0)
        is_new = got != REUSED
        GI[S.G_NEWC if is_new else S.G_REUSEDC] += 1
        TS[S.T_NEWC][rid] = is_new
        RQ[rid, S.Q_POOLED] = got != NEW_ONE_OFF
        t_net = request_net_s(send[rid], FP[S.D_HANDSHAKE], is_new, 0.0)
        push(heap, GI, now + t_net, S.NORMAL, S.EV_DELIVER, rid, 0)
        rid += 1
    GI[S.G_NEXT] = n


@jit
def deliver(rid, now, heap, GI, RS, RQ, IP, FP, TS, ENDS, LOAD, WQ, cls, picks, prompt,
            output, clients, IDL, ILEN, PFX):
    """``run_simpy``'s ``deliver``: reject, or route and enqueue."""
    TS[S.T_ENQ][rid] = now
    if rejects(rid, IP, RQ, prompt, output):
        TS[S.T_REJ][rid] = True
        pool_release(IDL, ILEN, clients[rid], now + FP[S.D_NETONEWAY], RQ[rid, S.Q_POOLED] != 0,
                     IP[S.P_REUSE] != 0)
        return
    R = IP[S.P_R]
    if IP[S.P_ROUTER] == S.ROUTER_RR:
        GI[S.G_RR] = next_in_turn(GI[S.G_RR], R)
        k = GI[S.G_RR]
    elif IP[S.P_ROUTER] == S.ROUTER_RANDOM:
        # ``RandomRouter``: the router's generator drawn ahead, one pick per routing.
        k = picks[GI[S.G_RANDOM]]
        GI[S.G_RANDOM] += 1
    else:
        # ``LeastOutstanding``: fewest outstanding tokens, ties to the lowest index.
        for i in range(R):
            LOAD[i] = outstanding(i, now, RS, ENDS)
        k = first_least(LOAD, R)
    TS[S.T_REPLICA][rid] = k
    enqueue(k, rid, now, heap, GI, RS, RQ, IP, WQ, cls, prompt, output, PFX)


@jit
def run(W, IP, FP, GI, GF, RS, RF, RQ, RQF, TS, WQ, BUF, POOL, ITL, COST, PFX):
    """The run, to the end or the clock stop (see module doc for what it yields).
    ``W``: the workload's columns; ``BUF``, ``POOL``, ``ITL``, ``COST``: see ``__init__``;
    ``PFX``: the prefix cache's pools and tables (``prefix``).

    One kernel, kept whole: the event dispatch is the hottest loop, numba passes the
    state's tuples of arrays by value on every call, and each event's handling is already
    a call into the shared kernels (``plan``, ``apply``, the policy and memory rules)."""
    arrival, prompt, output, clients, prio, cls, send, picks = W
    DEC, PRE, CHR, CHN, CHP, CHF, PHASE, ENDS, LT_T, LT_C, SER, LOAD = BUF
    IDL, ILEN, OPEN = POOL
    R = IP[S.P_R]
    heap = [(0.0, 0, 0, 0, 0, 0)]
    heap.pop()
    FH = [[np.int64(0)] for _ in range(R)]
    for r in range(R):
        FH[r].pop()
    # SimPy's start: the replicas' processes, then the arrival process (urgent, at 0),
    # then the stop of ``run(until)``.
    GI[S.G_EID] = R
    push(heap, GI, 0.0, S.URGENT, S.EV_ARRIVE, -1, 0)
    if IP[S.P_HASUNTIL]:
        push(heap, GI, FP[S.D_UNTIL], S.URGENT, S.EV_STOP, -1, 0)
    resumed = False
    flush = IP[S.P_FLUSH]
    sercap = IP[S.P_SERCAP]
    interval = FP[S.D_INTERVAL]
    paged = IP[S.P_PAGED]
    while len(heap):
        t, _, _, kind, obj, ver = heapq.heappop(heap)
        GF[S.H_NOW] = t
        if kind == S.EV_END:
            r = obj
            if ver != RS[r, S.R_VER]:
                continue
            # ``Replica._run`` after its step's timeout: apply the epoch, the step, or the copies.
            mode = RS[r, S.R_MODE]
            RS[r, S.R_MODE] = S.MODE_NONE
            if mode == S.MODE_COPY:
                GF[S.H_SWAPCOPY] += RF[r, S.F_COPYING]
            else:
                if mode == S.MODE_EPOCH:
                    m = RS[r, S.R_EPM]
                    RS[r, S.R_INEP] = 0
                    RS[r, S.R_HASENDS] = 0
                    GI[S.G_STEPS] += m
                    GF[S.H_STEPTOT] += ENDS[r, m - 1] - RF[r, S.F_EPSTART]
                    first_end = ENDS[r, 0]
                else:
                    m = 1 if RS[r, S.R_STEPND] else 0
                    first_end = t
                    RF[r, S.F_STEPEND] = t
                if m:
                    # ``ReplicaApply._decode_fast``: the gaps since each group's last
                    # token, then the epoch's later steps' gaps, one per decoder.
                    ndc = RS[r, S.R_ND]
                    for i in range(RS[r, S.R_NLT]):
                        c = LT_C[r, i]
                        if c:
                            itl_add(GI, ITL, first_end - LT_T[r, i], c, flush)
                    if m > 1:
                        itl_add_gaps(GI, ITL, ENDS[r], m, ndc, flush)
                    RS[r, S.R_NLT] = 1
                    LT_T[r, 0] = t
                    LT_C[r, 0] = ndc
                    RF[r, S.F_LASTDEC] = t
                    RS[r, S.R_TICKS] += m
                    RS[r, S.R_KV] += m * ndc
                    RS[r, S.R_OUT] -= m * ndc
                if mode == S.MODE_EPOCH:
                    if paged:
                        catch_up_growth(r, RS[r, S.R_TICKS] - m, RS, IP, PHASE, PFX)
                else:
                    prefill(r, t, GI, FH, RS, RQ, RQF, IP, FP, TS, DEC, PRE, CHR, CHN, PHASE,
                            LT_T, LT_C, ITL, prompt, output, clients, IDL, ILEN, PFX)
                finish_due(r, t, FH, RS, RQ, IP, FP, TS, DEC, PHASE, LT_T, LT_C, prompt,
                           output, clients, IDL, ILEN, PFX)
                if t - RF[r, S.F_LASTSAMPLE] >= interval:
                    sample(r, t, RS, RF, IP, SER, PFX)
                    if RS[r, S.R_NSER] >= sercap:
                        yield S.Y_SERIES
            if GI[S.G_NFL]:
                yield S.Y_ITL
        elif kind == S.EV_WAKE:
            r = obj
            RS[r, S.R_IDLE] = 0
            RS[r, S.R_WAKE] = 0
        elif kind == S.EV_DELIVER:
            deliver(obj, t, heap, GI, RS, RQ, IP, FP, TS, ENDS, LOAD, WQ, cls, picks, prompt,
                    output, clients, IDL, ILEN, PFX)
            continue
        elif kind == S.EV_ARRIVE:
            arrivals(t, resumed, heap, GI, GF, IP, FP, RQ, TS, arrival, clients, send, IDL, ILEN,
                     OPEN)
            resumed = True
            continue
        elif kind == S.EV_INTERRUPT:
            interrupted(obj, t, heap, GI, RS, ENDS)
            continue
        else:
            break
        # After a step's end or a wake-up: plan the replica's next step.
        status = plan(r, t, heap, FH, GI, GF, RS, RF, RQ, RQF, IP, FP, WQ, cls, prio, DEC, PRE,
                      CHR, CHN, CHP, CHF, PHASE, ENDS, LT_T, LT_C, TS, prompt, output, COST,
                      PFX)
        if status:
            yield status
            return
    yield S.Y_DONE
