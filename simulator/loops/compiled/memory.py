"""KV memory under pressure, compiled: the SimPy replica's ``_make_room``, ``_preempt`` and
``_swap_in`` (fast bookkeeping) on the arrays of ``state``, by the rules of
``simulator.model.kv.rules``: victims by the scenario's rule, preemption by recompute or,
for a decoder when the CPU swap space has room, by swap, and swapped requests coming
back oldest first while their blocks fit."""
from __future__ import annotations

from simulator.loops.compiled import state as S
from simulator.kernel import kernel as jit
from simulator.loops.compiled.apply import dec_remove, join, key_max, lt_add, pre_remove
from simulator.loops.compiled.prefix import release, swap_back
from simulator.loops.compiled.queue import waiting_requeue
from simulator.loops.compiled.replica import swapped_append
from simulator.model.scheduling.progress import admission_times, generated_by, last_token_at
from simulator.model.kv.rules import (ceil_blocks, later_victim, recompute_loss, swap_copy,
                                      swap_in_fits, swaps_out)


@jit
def victim(r, RS, IP, DEC, PRE, TS, prio):
    """``kv.space.select_victim`` over the running requests (``rules.later_victim``)."""
    best = -1
    by_priority = IP[S.P_VICTIM] != 0
    enq = TS[S.T_ENQ]
    for i in range(RS[r, S.R_ND] + RS[r, S.R_NP]):
        rid = DEC[r, i] if i < RS[r, S.R_ND] else PRE[r, i - RS[r, S.R_ND]]
        if best < 0 or later_victim(prio[rid], enq[rid], rid, prio[best], enq[best], best,
                                    by_priority):
            best = rid
    return best


@jit
def preempt(r, rid, now, RS, RF, RQ, RQF, IP, FP, TS, WQ, cls, DEC, PRE, PHASE, LT_T, LT_C,
            prompt, output, PFX):
    """``ReplicaMemory._preempt``: ``rid`` loses its blocks; a decoder whose context fits
    the swap space is copied out, anything else recomputes from the queue."""
    TS[S.T_PREEMPTIONS][rid] += 1
    swap = False
    if RQ[rid, S.Q_DECODING]:
        # ``_leave_fast``: what it generated so far, and when its last token left.
        ticks = RS[r, S.R_TICKS]
        gen = generated_by(output[rid], RQ[rid, S.Q_FKEY] >> 32, ticks)
        RQ[rid, S.Q_GENERATED] = gen
        tl = last_token_at(ticks, RQ[rid, S.Q_JOIN], RF[r, S.F_LASTDEC], RQF[rid, S.QF_LAST_T])
        lt_add(r, tl, -1, RS, LT_T, LT_C)
        RQF[rid, S.QF_LAST_T] = tl
        RQ[rid, S.Q_FKEY] = -1
        key = RQ[rid, S.Q_KEY]
        RS[r, S.R_KEYSUM] -= key
        if key == RS[r, S.R_KEYMAX]:
            key_max(r, rid, RS, RQ, DEC)
        dec_remove(r, rid, RS, RQ, DEC)
        PHASE[r, RQ[rid, S.Q_PHASE]] -= 1
        lost = recompute_loss(True, prompt[rid], gen, RQ[rid, S.Q_PREFILLED])
        # Its context took a block at each boundary up to the last step's.
        held = ceil_blocks(key + ticks - 1, IP[S.P_BS])
        if RQ[rid, S.Q_HELD] > held:
            held = RQ[rid, S.Q_HELD]
        swap = swaps_out(True, IP[S.P_SWAP] != 0, RS[r, S.R_CPU], held, IP[S.P_CPUBLOCKS])
    else:
        pre_remove(r, rid, RS, PRE)
        lost = recompute_loss(False, prompt[rid], RQ[rid, S.Q_GENERATED], RQ[rid, S.Q_PREFILLED])
        held = RQ[rid, S.Q_HELD]
    RS[r, S.R_KV] -= lost
    RQF[rid, S.QF_PREEMPTED_AT] = now
    if IP[S.P_PREFIX]:
        release(r, rid, held, RS, PFX)
    else:
        RS[r, S.R_FREE] += held
    RQ[rid, S.Q_HELD] = 0
    if swap:
        RQ[rid, S.Q_SWAPBLK] = held
        RS[r, S.R_CPU] += held
        nbytes, copy_s = swap_copy(held, FP[S.D_BLOCKBYTES], FP[S.D_SWAPBPS])
        TS[S.T_SWAPPED][rid] += nbytes
        RF[r, S.F_COPY] += copy_s
        swapped_append(r, rid, RS, RQ)
        return
    TS[S.T_RECOMPUTED][rid] += lost
    RQ[rid, S.Q_DROPPED] = lost
    RS[r, S.R_OUT] += lost
    RQ[rid, S.Q_PLEN] = prompt[rid] + RQ[rid, S.Q_GENERATED]
    RQ[rid, S.Q_PREFILLED] = 0
    waiting_requeue(r, rid, RS, RQ, WQ, TS, cls, IP[S.P_REQUEUE])


@jit
def make_room(r, due, fresh, now, RS, RF, RQ, RQF, IP, FP, TS, WQ, cls, prio, DEC, PRE, PHASE,
              LT_T, LT_C, prompt, output, PFX):
    """``ReplicaMemory._make_room``: ``due`` decoders need a block and fewer are free:
    preempt victims until the rest fit; returns how many are still due."""
    ticks = RS[r, S.R_TICKS]
    ph = ticks % IP[S.P_BS]
    while due > RS[r, S.R_FREE]:
        v = victim(r, RS, IP, DEC, PRE, TS, prio)
        if RQ[v, S.Q_DECODING] and RQ[v, S.Q_PHASE] == ph and (fresh or RQ[v, S.Q_LATE] == ticks):
            due -= 1
        preempt(r, v, now, RS, RF, RQ, RQF, IP, FP, TS, WQ, cls, DEC, PRE, PHASE, LT_T, LT_C,
                prompt, output, PFX)
    return due


@jit
def swap_in(r, now, FH, RS, RF, RQ, RQF, IP, FP, TS, DEC, PHASE, LT_T, LT_C, prompt, output,
            PFX):
    """``ReplicaMemory._swap_in``: swapped requests back, oldest first, while they fit."""
    bs = IP[S.P_BS]
    while RS[r, S.R_SLEN] and RS[r, S.R_ND] + RS[r, S.R_NP] < IP[S.P_MAXSEQS]:
        rid = RS[r, S.R_SHEAD]
        tokens = prompt[rid] + RQ[rid, S.Q_GENERATED]
        if not swap_in_fits(tokens, bs, IP[S.P_WATERMARK], RS[r, S.R_FREE]):
            break
        need = ceil_blocks(tokens, bs)
        RS[r, S.R_SHEAD] = RQ[rid, S.Q_NEXT]
        RS[r, S.R_SLEN] -= 1
        if IP[S.P_PREFIX]:
            swap_back(r, rid, tokens, RS, IP, PFX)
        else:
            RS[r, S.R_FREE] -= need
        RQ[rid, S.Q_HELD] = need
        RS[r, S.R_ADMISSIONS] += 1
        RS[r, S.R_QUERIED] += tokens
        RS[r, S.R_CPU] -= RQ[rid, S.Q_SWAPBLK]
        nbytes, copy_s = swap_copy(RQ[rid, S.Q_SWAPBLK], FP[S.D_BLOCKBYTES], FP[S.D_SWAPBPS])
        TS[S.T_SWAPPED][rid] += nbytes
        RF[r, S.F_COPY] += copy_s
        TS[S.T_PREEMPTED_S][rid] += admission_times(TS[S.T_SCHED][rid],
                                                    RQF[rid, S.QF_PREEMPTED_AT], now)[1]
        RS[r, S.R_KV] += tokens
        join(r, rid, RQF[rid, S.QF_LAST_T], True, FH, RS, RQ, RQF, IP, DEC, PHASE, LT_T, LT_C,
             prompt, output)
