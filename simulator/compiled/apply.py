"""A step's effects, compiled: ``fastapply.FastApply`` on arrays (prefill progress
and first tokens, joining the decoders, paged growth caught up after an epoch,
finishes, time-series samples). Decode progress and its inter-token gaps are in
``loop`` itself, since recording a gap may have to hand the buffer to Python."""
from __future__ import annotations

import heapq

from numba import njit

from .replica import release
from .state import (
    D_FT,
    D_ONEWAY,
    F_LASTSAMPLE,
    P_BS,
    P_CAPACITY,
    P_PAGED,
    Q_DPOS,
    Q_GENERATED,
    Q_HELD,
    Q_KEY,
    Q_PHASE,
    Q_POOLED,
    Q_PREFILLED,
    R_FREE,
    R_GROWN,
    R_KEYMAX,
    R_KEYSUM,
    R_KV,
    R_LATE,
    R_NCH,
    R_ND,
    R_NLT,
    R_NP,
    R_NSER,
    R_OUT,
    R_TICKS,
    R_WLEN,
    T_FIRST,
    T_FIRSTDEL,
    T_GEN,
    T_LAST,
    T_LASTDEL,
)


@njit(cache=True)
def finish(r, rid, t, depart, RS, RQ, IP, FP, TS, prompt, clients, IDL, ILEN):
    """``FastApply._finish``."""
    TS[T_LAST][rid] = t
    arrived = depart + FP[D_ONEWAY]
    TS[T_LASTDEL][rid] = arrived
    TS[T_GEN][rid] = RQ[rid, Q_GENERATED]
    RS[r, R_FREE] += RQ[rid, Q_HELD]
    RQ[rid, Q_HELD] = 0
    RS[r, R_KV] -= prompt[rid] + RQ[rid, Q_GENERATED]
    release(clients[rid], arrived, RQ[rid, Q_POOLED] != 0, IP, IDL, ILEN)


@njit(cache=True)
def _lt_add(r, t, RS, LT_T, LT_C):
    """``_last_tok[t] += 1`` (entries in insertion order, as a dict's)."""
    n = RS[r, R_NLT]
    for i in range(n):
        if LT_T[r, i] == t:
            LT_C[r, i] += 1
            return
    LT_T[r, n] = t
    LT_C[r, n] = 1
    RS[r, R_NLT] = n + 1


@njit(cache=True)
def join(r, rid, t, FH, RS, RQ, IP, DEC, PHASE, LT_T, LT_C, prompt, output):
    """``FastApply._join``: ``rid`` starts decoding after its token at ``t``."""
    ticks = RS[r, R_TICKS]
    gen = RQ[rid, Q_GENERATED]
    key = prompt[rid] + gen - ticks
    RQ[rid, Q_KEY] = key
    finish_tick = ticks + output[rid] - gen
    heapq.heappush(FH[r], (finish_tick << 32) | rid)
    nd = RS[r, R_ND]
    DEC[r, nd] = rid
    RQ[rid, Q_DPOS] = nd
    RS[r, R_ND] = nd + 1
    RS[r, R_KEYSUM] += key
    if nd + 1 == 1 or key > RS[r, R_KEYMAX]:
        RS[r, R_KEYMAX] = key
    _lt_add(r, t, RS, LT_T, LT_C)
    if IP[P_PAGED]:
        bs = IP[P_BS]
        ph = (1 - key) % bs
        RQ[rid, Q_PHASE] = ph
        PHASE[r, ph] += 1
        if ticks == RS[r, R_GROWN] and ticks % bs == ph:
            RS[r, R_LATE] += 1


@njit(cache=True)
def prefill(r, t, FH, RS, RQ, IP, FP, TS, DEC, PRE, CHR, CHN, PHASE, LT_T, LT_C,
            prompt, output, clients, IDL, ILEN):
    """``FastApply._prefill``: the step's chunks; a completed prompt yields its first
    token (no request here ever resumes after a preemption)."""
    ft = FP[D_FT]
    tokens = 0
    for i in range(RS[r, R_NCH]):
        rid = CHR[r, i]
        n = CHN[r, i]
        RQ[rid, Q_PREFILLED] += n
        done = RQ[rid, Q_PREFILLED] >= prompt[rid]
        tokens += n + (1 if done else 0)
        if not done:
            continue
        npre = RS[r, R_NP]
        j = 0
        while PRE[r, j] != rid:
            j += 1
        for q in range(j, npre - 1):
            PRE[r, q] = PRE[r, q + 1]
        RS[r, R_NP] = npre - 1
        RQ[rid, Q_GENERATED] += 1
        TS[T_FIRST][rid] = t
        TS[T_FIRSTDEL][rid] = t + ft + FP[D_ONEWAY]
        if RQ[rid, Q_GENERATED] >= output[rid]:
            RS[r, R_KV] += tokens
            RS[r, R_OUT] -= tokens
            tokens = 0
            finish(r, rid, t, t + ft, RS, RQ, IP, FP, TS, prompt, clients, IDL, ILEN)
            continue
        join(r, rid, t, FH, RS, RQ, IP, DEC, PHASE, LT_T, LT_C, prompt, output)
    RS[r, R_KV] += tokens
    RS[r, R_OUT] -= tokens


@njit(cache=True)
def catch_up_growth(r, start, RS, IP, PHASE):
    """``FastApply._catch_up_growth``: the blocks an epoch's later steps took."""
    last = RS[r, R_TICKS] - 1
    if last <= start:
        return
    bs = IP[P_BS]
    span = last - start
    due = (span // bs) * RS[r, R_ND]
    for t in range(start + 1, start + 1 + span % bs):
        due += PHASE[r, t % bs]
    RS[r, R_FREE] -= due
    RS[r, R_GROWN] = last


@njit(cache=True)
def finish_due(r, t, FH, RS, RQ, IP, FP, TS, DEC, PHASE, LT_T, LT_C, prompt, output,
               clients, IDL, ILEN):
    """``FastApply._finish_due``: decoders whose last token came at ``t``, in the
    heap's (tick, rid) order."""
    heap = FH[r]
    ticks = RS[r, R_TICKS]
    if len(heap) == 0 or (heap[0] >> 32) > ticks:
        return
    # Which finish: popped in order, taken out of the decoder set first (as the list
    # comprehension), then ``_last_tok[t]`` loses them all, then each one finishes.
    done = []
    while len(heap) and (heap[0] >> 32) <= ticks:
        done.append(heapq.heappop(heap) & 0xFFFFFFFF)
    for rid in done:
        pos = RQ[rid, Q_DPOS]
        nd = RS[r, R_ND] - 1
        last = DEC[r, nd]
        DEC[r, pos] = last
        RQ[last, Q_DPOS] = pos
        RS[r, R_ND] = nd
    for i in range(RS[r, R_NLT]):
        if LT_T[r, i] == t:
            LT_C[r, i] -= len(done)
            break
    recompute = False
    ft = FP[D_FT]
    paged = IP[P_PAGED]
    bs = IP[P_BS]
    for rid in done:
        RQ[rid, Q_GENERATED] = output[rid]
        key = RQ[rid, Q_KEY]
        RS[r, R_KEYSUM] -= key
        recompute |= key == RS[r, R_KEYMAX]
        if paged:
            PHASE[r, RQ[rid, Q_PHASE]] -= 1
            held = -(-(prompt[rid] + output[rid] - 1) // bs)
            if held > RQ[rid, Q_HELD]:
                RQ[rid, Q_HELD] = held
        finish(r, rid, t, t + ft, RS, RQ, IP, FP, TS, prompt, clients, IDL, ILEN)
    if recompute:
        m = 0
        for i in range(RS[r, R_ND]):
            k = RQ[DEC[r, i], Q_KEY]
            if i == 0 or k > m:
                m = k
        RS[r, R_KEYMAX] = m


@njit(cache=True)
def sample(r, t, RS, RF, IP, SER):
    """``FastApply._sample`` into the replica's buffer (``R_NSER`` rows so far)."""
    i = RS[r, R_NSER]
    SER[r, 0, i] = t
    SER[r, 1, i] = RS[r, R_WLEN]
    SER[r, 2, i] = RS[r, R_ND] + RS[r, R_NP]
    SER[r, 3, i] = IP[P_CAPACITY] - RS[r, R_FREE]
    SER[r, 4, i] = RS[r, R_KV]
    SER[r, 5, i] = 0.0
    RS[r, R_NSER] = i + 1
    RF[r, F_LASTSAMPLE] = t
