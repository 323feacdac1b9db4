"""One replica's bookkeeping, compiled: events, admission sizes, the swapped queue,
arrivals and epoch cuts (the SimPy replica's ``enqueue`` and epoch interrupts,
``KVSpace.fits``/``admission``), on the arrays of ``state``; the waiting queues are
``queue``'s, the connection pools ``wire.keepalive``'s.

Orders that matter are kept: the swapped queue (linked through ``Q_NEXT``: a request is
in one queue at a time), the prefilling list (``PRE``, shifted on removal), the finish
heap ``(tick, rid)`` and the ``_last_tok`` entries (``LT_T``/``LT_C``, insertion order).
The decoders (``DEC``) are a set: nothing reads their order (victims are chosen by a
key that ends in the request id)."""
from __future__ import annotations

import heapq

from simulator.loops.compiled import state as S
from simulator.kernel import kernel as jit
from simulator.model.scheduling.epoch import (IF_FITS, YES, arrival_interrupts, fits_now,
                                              steps_ended, steps_run)
from simulator.loops.compiled.queue import waiting_append
from simulator.model.scheduling.asyncsched import sees
from simulator.loops.compiled.prefix import adm_price
from simulator.model.kv.rules import FITS, never_fits, policy_blocks


@jit
def push(heap, GI, t, prio, kind, obj, ver):
    """Schedule an event; SimPy's order is (time, priority, insertion)."""
    heapq.heappush(heap, (t, prio, GI[S.G_EID], kind, obj, ver))
    GI[S.G_EID] += 1


@jit
def rejects(rid, IP, RQ, prompt, output):
    """``KVSpace.fits``: True when ``rid`` can never run here."""
    return never_fits(IP[S.P_PAGED] != 0, prompt[rid], output[rid], IP[S.P_MAXLEN],
                      IP[S.P_BS], IP[S.P_CAPACITY], IP[S.P_WATERMARK]) != FITS


@jit
def outstanding(r, now, RS, ENDS):
    """``Replica.outstanding_tokens`` (``loops/simpy/replica.py``)."""
    if RS[r, S.R_HASENDS] == 0:
        return RS[r, S.R_OUT]
    return RS[r, S.R_OUT] - steps_ended(ENDS[r], RS[r, S.R_EPK], now) * RS[r, S.R_ND]


@jit(inline=True)
def _fifo_append(r, rid, RS, RQ, HEAD, TAIL, LEN):
    """Append ``rid`` to replica ``r``'s FIFO threaded through ``RQ[:, Q_NEXT]``, whose
    head, tail and length are the ``RS`` columns ``HEAD``, ``TAIL``, ``LEN``."""
    RQ[rid, S.Q_NEXT] = -1
    if RS[r, LEN]:
        RQ[RS[r, TAIL], S.Q_NEXT] = rid
    else:
        RS[r, HEAD] = rid
    RS[r, TAIL] = rid
    RS[r, LEN] += 1


@jit
def swapped_append(r, rid, RS, RQ):
    """The swapped queue: ``deque.append``."""
    _fifo_append(r, rid, RS, RQ, S.R_SHEAD, S.R_STAIL, S.R_SLEN)


@jit
def inbox_append(r, rid, RS, RQ):
    """Async scheduling's inbox: ``list.append``."""
    _fifo_append(r, rid, RS, RQ, S.R_IHEAD, S.R_ITAIL, S.R_ILEN)


@jit
def see_arrivals(r, now, RS, RF, RQ, WQ, TS, cls):
    """``Replica._see_arrivals``: move into the waiting queue the arrivals this decision
    sees (``asyncsched.sees``), in arrival order (the inbox is in arrival order, so
    they are its head)."""
    idle = (now != RF[r, S.F_STEPEND]
            or not (RS[r, S.R_ND] or RS[r, S.R_NP] or RS[r, S.R_WLEN] or RS[r, S.R_SLEN]))
    while RS[r, S.R_ILEN]:
        rid = RS[r, S.R_IHEAD]
        if not sees(TS[S.T_ENQ][rid], RF[r, S.F_DECIDED], idle):
            break
        RS[r, S.R_IHEAD] = RQ[rid, S.Q_NEXT]
        RS[r, S.R_ILEN] -= 1
        waiting_append(r, rid, cls[rid], RS, RQ, WQ)


@jit
def enqueue(r, rid, now, heap, GI, RS, RQ, IP, WQ, cls, prompt, output, PFX):
    """``Replica.enqueue``: join the queue; wake an idle engine, or end an epoch
    when the arrival could be admitted at its next step (with aging: any arrival, the
    queue's order changes with time alone)."""
    was_empty = RS[r, S.R_WLEN] == 0
    if IP[S.P_ASYNC]:
        inbox_append(r, rid, RS, RQ)    # seen by a later decision (``see_arrivals``)
    else:
        waiting_append(r, rid, cls[rid], RS, RQ, WQ)
    RS[r, S.R_OUT] += prompt[rid] + output[rid]
    if RS[r, S.R_IDLE]:
        if not RS[r, S.R_WAKE]:
            RS[r, S.R_WAKE] = 1
            push(heap, GI, now, S.NORMAL, S.EV_WAKE, r, 0)
    elif RS[r, S.R_INEP]:
        c = arrival_interrupts(IP[S.P_TIMEDEP] != 0, was_empty, RS[r, S.R_ND] + RS[r, S.R_NP],
                               IP[S.P_MAXSEQS])
        if c == YES or (c == IF_FITS and fits_now(
                adm_price(r, rid, IP, RQ, prompt, output, PFX)[2],
                policy_blocks(False, RS[r, S.R_FREE], IP[S.P_WATERMARK]))):
            RS[r, S.R_INEP] = 0
            push(heap, GI, now, S.URGENT, S.EV_INTERRUPT, r, 0)


@jit
def interrupted(r, now, heap, GI, RS, ENDS):
    """``Replica._epoch`` on ``simpy.Interrupt``: the step in progress completes."""
    m = steps_run(ENDS[r], RS[r, S.R_EPK], now)
    RS[r, S.R_EPM] = m
    RS[r, S.R_INEP] = 0
    d = ENDS[r, m - 1] - now
    RS[r, S.R_VER] += 1
    push(heap, GI, now + (d if d > 0.0 else 0.0), S.NORMAL, S.EV_END, r, RS[r, S.R_VER])
