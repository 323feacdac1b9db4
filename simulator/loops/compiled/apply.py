"""A step's effects, compiled: the SimPy replica's ``ReplicaApply`` (``loops/simpy/apply.py``) on arrays (inter-token gaps,
prefill progress and first tokens, joining the decoders, paged growth caught up after
an epoch, finishes, time-series samples).

Inter-token gaps go to a buffer Python drains into the ``ItlHistogram``; where the
histogram would flush (after the ``add``/``add_many`` call that fills it) the buffer
marks a flush (``ITL[2]``), so Python bins and sums exactly the same groups."""
from __future__ import annotations

import heapq

from simulator.loops.compiled import state as S
from simulator.kernel import kernel as jit
from simulator.loops.compiled.prefix import computed, release, shared_refs, take
from simulator.wire.frontend import first_token_wait_s
from simulator.wire.keepalive import pool_release
from simulator.model.kv.rules import ceil_blocks, growth_tick, held_tokens
from simulator.model.scheduling.progress import (emit_tokens, finish_tick, prefill_progress,
                                                 tick_key)


@jit
def itl_add(GI, ITL, gap, weight, flush):
    """``ItlHistogram.add``."""
    j = GI[S.G_ITL]
    ITL[0][j] = gap
    ITL[1][j] = weight
    GI[S.G_ITL] = j + 1
    if j + 1 - GI[S.G_ITLSEG] >= flush:
        ITL[2][GI[S.G_NFL]] = j + 1
        GI[S.G_NFL] += 1
        GI[S.G_ITLSEG] = j + 1


@jit
def itl_add_gaps(GI, ITL, ends, m, weight, flush):
    """``ItlHistogram.add_many`` of the gaps between ``ends[:m]``, each ``weight`` times."""
    j = GI[S.G_ITL]
    for i in range(m - 1):
        ITL[0][j + i] = ends[i + 1] - ends[i]
        ITL[1][j + i] = weight
    j += m - 1
    GI[S.G_ITL] = j
    if j - GI[S.G_ITLSEG] >= flush:
        ITL[2][GI[S.G_NFL]] = j
        GI[S.G_NFL] += 1
        GI[S.G_ITLSEG] = j


@jit
def lt_add(r, t, delta, RS, LT_T, LT_C):
    """``_last_tok[t] += delta`` (entries in insertion order, as a dict's)."""
    n = RS[r, S.R_NLT]
    for i in range(n):
        if LT_T[r, i] == t:
            LT_C[r, i] += delta
            return
    LT_T[r, n] = t
    LT_C[r, n] = delta
    RS[r, S.R_NLT] = n + 1


@jit
def finish(r, rid, t, depart, RS, RQ, IP, FP, TS, prompt, clients, IDL, ILEN, PFX):
    """``ReplicaApply._finish``."""
    TS[S.T_LAST][rid] = t
    arrived = depart + FP[S.D_ONEWAY]
    TS[S.T_LASTDEL][rid] = arrived
    TS[S.T_GEN][rid] = RQ[rid, S.Q_GENERATED]
    if IP[S.P_PREFIX]:
        release(r, rid, RQ[rid, S.Q_HELD], RS, PFX)
    else:
        RS[r, S.R_FREE] += RQ[rid, S.Q_HELD]
    RQ[rid, S.Q_HELD] = 0
    RS[r, S.R_KV] -= held_tokens(True, prompt[rid], RQ[rid, S.Q_GENERATED], 0)
    pool_release(IDL, ILEN, clients[rid], arrived, RQ[rid, S.Q_POOLED] != 0, IP[S.P_REUSE] != 0)


@jit
def join(r, rid, t, swapped_in, FH, RS, RQ, RQF, IP, DEC, PHASE, LT_T, LT_C, prompt, output):
    """``ReplicaMemory._join_fast``: ``rid`` decodes from now on, its last token left at ``t``."""
    ticks = RS[r, S.R_TICKS]
    gen = RQ[rid, S.Q_GENERATED]
    key = tick_key(prompt[rid], gen, ticks)
    RQ[rid, S.Q_KEY] = key
    fkey = (finish_tick(ticks, output[rid], gen) << 32) | rid
    RQ[rid, S.Q_FKEY] = fkey
    heapq.heappush(FH[r], fkey)
    RQ[rid, S.Q_JOIN] = ticks
    RQF[rid, S.QF_LAST_T] = t
    RQ[rid, S.Q_DECODING] = 1
    nd = RS[r, S.R_ND]
    DEC[r, nd] = rid
    RQ[rid, S.Q_DPOS] = nd
    RS[r, S.R_ND] = nd + 1
    RS[r, S.R_KEYSUM] += key
    if nd == 0 or key > RS[r, S.R_KEYMAX]:
        RS[r, S.R_KEYMAX] = key
    lt_add(r, t, 1, RS, LT_T, LT_C)
    if IP[S.P_PAGED]:
        bs = IP[S.P_BS]
        ph = growth_tick(0, key, bs) % bs     # the ticks (mod bs) at which it grows
        RQ[rid, S.Q_PHASE] = ph
        PHASE[r, ph] += 1
        # Back from swap it holds the blocks of its whole context: no growth this tick.
        if ticks == RS[r, S.R_GROWN] and ticks % bs == ph and not swapped_in:
            RS[r, S.R_LATE] += 1
            RQ[rid, S.Q_LATE] = ticks


@jit
def dec_remove(r, rid, RS, RQ, DEC):
    """Take ``rid`` out of the decoder set."""
    pos = RQ[rid, S.Q_DPOS]
    nd = RS[r, S.R_ND] - 1
    last = DEC[r, nd]
    DEC[r, pos] = last
    RQ[last, S.Q_DPOS] = pos
    RS[r, S.R_ND] = nd
    RQ[rid, S.Q_DECODING] = 0


@jit
def pre_remove(r, rid, RS, PRE):
    """``prefilling.remove``: order kept."""
    npre = RS[r, S.R_NP]
    j = 0
    while PRE[r, j] != rid:
        j += 1
    for q in range(j, npre - 1):
        PRE[r, q] = PRE[r, q + 1]
    RS[r, S.R_NP] = npre - 1


@jit
def prefill(r, t, GI, FH, RS, RQ, RQF, IP, FP, TS, DEC, PRE, CHR, CHN, PHASE, LT_T, LT_C, ITL,
            prompt, output, clients, IDL, ILEN, PFX):
    """``ReplicaApply._prefill``: the step's chunks; a completed prefill yields a token
    (the first, or, recomputing after a preemption, the next: one more ITL gap)."""
    ft = FP[S.D_FT]
    flush = IP[S.P_FLUSH]
    tokens = 0
    for i in range(RS[r, S.R_NCH]):
        rid = CHR[r, i]
        n = CHN[r, i]
        RQ[rid, S.Q_PREFILLED], done = prefill_progress(RQ[rid, S.Q_PREFILLED], n,
                                                        RQ[rid, S.Q_PLEN])
        tokens += n + (1 if done else 0)
        if IP[S.P_PREFIX]:
            computed(r, rid, RQ, IP, PFX)
        if not done:
            continue
        pre_remove(r, rid, RS, PRE)
        resumed = RQ[rid, S.Q_GENERATED] > 0
        RQ[rid, S.Q_GENERATED], last = emit_tokens(RQ[rid, S.Q_GENERATED], 1, output[rid])
        wait = 0.0
        if not resumed:
            TS[S.T_FIRST][rid] = t
            # The API server handles the step's outputs ahead of it first (the decoders).
            wait = first_token_wait_s(FP[S.D_FIRSTOUT], RS[r, S.R_ND])
            TS[S.T_FIRSTDEL][rid] = t + ft + FP[S.D_ONEWAY] + wait
        else:
            itl_add(GI, ITL, t - RQF[rid, S.QF_LAST_T], 1, flush)
        if last:
            RS[r, S.R_KV] += tokens
            RS[r, S.R_OUT] -= tokens
            tokens = 0
            # A one-token answer leaves after its first token's wait (``_prefill``).
            finish(r, rid, t, t + ft + wait, RS, RQ, IP, FP, TS, prompt, clients, IDL, ILEN, PFX)
            continue
        join(r, rid, t, False, FH, RS, RQ, RQF, IP, DEC, PHASE, LT_T, LT_C, prompt, output)
    RS[r, S.R_KV] += tokens
    RS[r, S.R_OUT] -= tokens


@jit
def catch_up_growth(r, start, RS, IP, PHASE, PFX):
    """``ReplicaMemory._catch_up_growth``: the blocks an epoch's later steps took."""
    last = RS[r, S.R_TICKS] - 1
    if last <= start:
        return
    bs = IP[S.P_BS]
    span = last - start
    due = (span // bs) * RS[r, S.R_ND]
    for t in range(start + 1, start + 1 + span % bs):
        due += PHASE[r, t % bs]
    if IP[S.P_PREFIX]:
        take(r, due, RS, PFX)
    else:
        RS[r, S.R_FREE] -= due
    RS[r, S.R_GROWN] = last


@jit
def clean_top(heap, RQ):
    """Drop finish-heap entries a preemption made stale (not the request's live one)."""
    while len(heap) and RQ[heap[0] & 0xFFFFFFFF, S.Q_FKEY] != heap[0]:
        heapq.heappop(heap)


@jit
def finish_due(r, t, FH, RS, RQ, IP, FP, TS, DEC, PHASE, LT_T, LT_C, prompt, output,
               clients, IDL, ILEN, PFX):
    """``ReplicaApply._finish_due``: decoders whose last token came at ``t``, in the
    heap's (tick, rid) order."""
    heap = FH[r]
    clean_top(heap, RQ)
    ticks = RS[r, S.R_TICKS]
    if len(heap) == 0 or (heap[0] >> 32) > ticks:
        return
    done = []
    while len(heap) and (heap[0] >> 32) <= ticks:
        key = heapq.heappop(heap)
        rid = key & 0xFFFFFFFF
        if RQ[rid, S.Q_FKEY] == key:
            RQ[rid, S.Q_FKEY] = -1
            done.append(rid)
    if len(done) == 0:
        return
    # Out of the decoder set first, then ``_last_tok[t]`` loses them all, then each
    # one finishes (the connection pool sees them in this order).
    for rid in done:
        dec_remove(r, rid, RS, RQ, DEC)
    lt_add(r, t, -len(done), RS, LT_T, LT_C)
    recompute = False
    ft = FP[S.D_FT]
    paged = IP[S.P_PAGED]
    bs = IP[S.P_BS]
    for rid in done:
        RQ[rid, S.Q_GENERATED] = output[rid]
        key = RQ[rid, S.Q_KEY]
        RS[r, S.R_KEYSUM] -= key
        recompute |= key == RS[r, S.R_KEYMAX]
        if paged:
            PHASE[r, RQ[rid, S.Q_PHASE]] -= 1
            # It wrote the KV of all but its last token.
            held = ceil_blocks(prompt[rid] + output[rid] - 1, bs)
            if held > RQ[rid, S.Q_HELD]:
                RQ[rid, S.Q_HELD] = held
        finish(r, rid, t, t + ft, RS, RQ, IP, FP, TS, prompt, clients, IDL, ILEN, PFX)
    if recompute:
        key_max(r, -1, RS, RQ, DEC)


@jit
def key_max(r, skip, RS, RQ, DEC):
    """The largest key among the decoders but ``skip`` (0 when none)."""
    m = 0
    first = True
    for i in range(RS[r, S.R_ND]):
        rid = DEC[r, i]
        if rid == skip:
            continue
        k = RQ[rid, S.Q_KEY]
        if first or k > m:
            m = k
            first = False
    RS[r, S.R_KEYMAX] = m


@jit
def sample(r, t, RS, RF, IP, SER, PFX):
    """``ReplicaApply._sample`` into the replica's buffer (``R_NSER`` rows so far)."""
    i = RS[r, S.R_NSER]
    SER[r, 0, i] = t
    SER[r, 1, i] = RS[r, S.R_WLEN] + RS[r, S.R_ILEN] + RS[r, S.R_SLEN]
    SER[r, 2, i] = RS[r, S.R_ND] + RS[r, S.R_NP]
    SER[r, 3, i] = IP[S.P_CAPACITY] - RS[r, S.R_FREE]
    SER[r, 4, i] = RS[r, S.R_KV]
    SER[r, 5, i] = shared_refs(r, PFX) if IP[S.P_PREFIX] else 0
    RS[r, S.R_NSER] = i + 1
    RF[r, S.F_LASTSAMPLE] = t
