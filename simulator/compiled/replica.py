"""One replica's operations, compiled: ``fastreplica.FastReplica`` and
``fastapply.FastApply`` on arrays (state layout in ``state``), for the configurations
``compiled`` runs (no prefix cache, no preemption: a growth that
finds too few free blocks makes ``plan`` return ``Y_PREEMPT`` and the run is handed
back). Each function names the method it is; the comments there say why.

Orders that matter are kept: the waiting queues (per class, linked through ``Q_NEXT``),
the prefilling list (``PRE``, shifted on removal), the finish heap ``(tick, rid)`` and
the ``_last_tok`` entries (``LT_T``/``LT_C`` in insertion order). The decoders
(``DEC``) are a set: without preemption nothing reads their order."""
from __future__ import annotations

import heapq

import numpy as np
from numba import njit

from .cost import bisect_left, bisect_right, decode_ends, step_time
from .state import (
    D_AGING,
    D_KEEPALIVE,
    EV_END,
    EV_INTERRUPT,
    EV_WAKE,
    F_EPSTART,
    G_EID,
    G_NEWC,
    G_REUSEDC,
    G_STEPS,
    H_STEPTOT,
    MODE_EPOCH,
    MODE_STEP,
    NORMAL,
    P_BS,
    P_BUDGET,
    P_CAPACITY,
    P_CHUNK,
    P_FIFO,
    P_MAXEPOCH,
    P_MAXLEN,
    P_MAXSEQS,
    P_PAGED,
    P_POOLSIZE,
    P_REUSE,
    P_WATERMARK,
    P_AGING,
    Q_HELD,
    Q_NEXT,
    Q_PREFILLED,
    R_ADMISSIONS,
    R_EPK,
    R_EPM,
    R_EPND,
    R_FREE,
    R_GROWN,
    R_HASENDS,
    R_IDLE,
    R_INEP,
    R_KEYMAX,
    R_KEYSUM,
    R_LATE,
    R_MODE,
    R_NCH,
    R_ND,
    R_NP,
    R_OUT,
    R_QUERIED,
    R_STEPND,
    R_TICKS,
    R_VER,
    R_WAKE,
    R_NCLS,
    R_WLEN,
    T_ENQ,
    T_SCHED,
    URGENT,
    W_ADM,
    W_CUR,
    W_HEAD,
    W_LEN,
    W_ORDER,
    W_TAIL,
)


@njit(cache=True)
def push(heap, GI, t, prio, kind, obj, ver):
    """``FastLoop.push``: SimPy's order is (time, priority, insertion)."""
    heapq.heappush(heap, (t, prio, GI[G_EID], kind, obj, ver))
    GI[G_EID] += 1


@njit(cache=True)
def acquire(c, now, IP, FP, GI, IDL, ILEN, OPEN):
    """``ConnectionPools.acquire``: (is_new, pooled)."""
    if IP[P_REUSE] == 0:
        GI[G_NEWC] += 1
        return True, False
    keepalive = FP[D_KEEPALIVE]
    best = -1
    i = 0
    while i < ILEN[c]:
        t = IDL[c, i]
        if t <= now and now - t > keepalive:
            for j in range(i, ILEN[c] - 1):
                IDL[c, j] = IDL[c, j + 1]
            ILEN[c] -= 1
            OPEN[c] -= 1
            continue
        if t <= now and (best < 0 or t > IDL[c, best]):
            best = i
        i += 1
    if best >= 0:
        for j in range(best, ILEN[c] - 1):
            IDL[c, j] = IDL[c, j + 1]
        ILEN[c] -= 1
        GI[G_REUSEDC] += 1
        return False, True
    GI[G_NEWC] += 1
    if OPEN[c] < IP[P_POOLSIZE]:
        OPEN[c] += 1
        return True, True
    return True, False


@njit(cache=True)
def release(c, free_at, pooled, IP, IDL, ILEN):
    """``ConnectionPools.release``."""
    if pooled and IP[P_REUSE] != 0:
        IDL[c, ILEN[c]] = free_at
        ILEN[c] += 1


@njit(cache=True)
def adm_blocks(rid, IP, prompt, output):
    """``FastReplica.adm_blocks`` without a prefix cache (and ``adm_tokens``)."""
    if IP[P_PAGED]:
        tokens = prompt[rid]
    elif IP[P_MAXLEN] >= 0:
        tokens = IP[P_MAXLEN]
    else:
        tokens = prompt[rid] + output[rid]
    return tokens, -(-tokens // IP[P_BS])


@njit(cache=True)
def rejects(rid, IP, prompt, output):
    """``FastReplica.rejects``."""
    total = prompt[rid] + output[rid]
    if IP[P_MAXLEN] >= 0 and total > IP[P_MAXLEN]:
        return True
    if IP[P_PAGED]:
        need = -(-total // IP[P_BS])
    else:
        need = adm_blocks(rid, IP, prompt, output)[1]
    return need > IP[P_CAPACITY] - IP[P_WATERMARK]


@njit(cache=True)
def outstanding(r, now, RS, ENDS):
    """``FastReplica.outstanding_tokens``."""
    if RS[r, R_HASENDS] == 0:
        return RS[r, R_OUT]
    return RS[r, R_OUT] - bisect_right(ENDS[r], RS[r, R_EPK], now) * RS[r, R_ND]


@njit(cache=True)
def enqueue(r, rid, now, heap, GI, RS, RQ, IP, WQ, cls, prompt, output):
    """``FastReplica.enqueue`` (``AgingPriorityQueue.push``: a class new to this replica
    goes last in its class order)."""
    was_empty = RS[r, R_WLEN] == 0
    c = cls[rid]
    head, tail, length, order = WQ[W_HEAD], WQ[W_TAIL], WQ[W_LEN], WQ[W_ORDER]
    RQ[rid, Q_NEXT] = -1
    if length[r, c] == 0:
        if tail[r, c] == -2:
            order[r, RS[r, R_NCLS]] = c
            RS[r, R_NCLS] += 1
        head[r, c] = rid
    else:
        RQ[tail[r, c], Q_NEXT] = rid
    tail[r, c] = rid
    length[r, c] += 1
    RS[r, R_WLEN] += 1
    RS[r, R_OUT] += prompt[rid] + output[rid]
    if RS[r, R_IDLE]:
        if not RS[r, R_WAKE]:
            RS[r, R_WAKE] = 1
            push(heap, GI, now, NORMAL, EV_WAKE, r, 0)
    elif RS[r, R_INEP] and (IP[P_AGING] or (
            was_empty and RS[r, R_ND] + RS[r, R_NP] < IP[P_MAXSEQS]
            and adm_blocks(rid, IP, prompt, output)[1] <= RS[r, R_FREE] - IP[P_WATERMARK])):
        # With aging the queue's order changes with time alone: any arrival ends it.
        RS[r, R_INEP] = 0
        push(heap, GI, now, URGENT, EV_INTERRUPT, r, 0)


@njit(cache=True)
def interrupted(r, now, heap, GI, RS, ENDS):
    """``FastReplica.interrupted``: the step in progress completes."""
    k = RS[r, R_EPK]
    j = min(bisect_left(ENDS[r], k, now), k - 1)
    RS[r, R_EPM] = j + 1
    RS[r, R_INEP] = 0
    d = ENDS[r, j] - now
    RS[r, R_VER] += 1
    push(heap, GI, now + (d if d > 0.0 else 0.0), NORMAL, EV_END, r, RS[r, R_VER])


@njit(cache=True)
def _candidate(r, now, RS, RQ, FP, WQ, TS, prio, aging):
    """``AgingPriorityQueue.candidates``' next one: the class whose next request has the
    lowest (priority - floor(wait / aging_s), enqueued), ties to the earlier class in
    the order; -1 when none is left. Without aging: the one queue's next."""
    order, cur = WQ[W_ORDER], WQ[W_CUR]
    if not aging:
        return 0 if cur[0] >= 0 else -1
    best = -1
    best_k = 0.0
    best_e = 0.0
    a = FP[D_AGING]
    for i in range(RS[r, R_NCLS]):
        c = order[r, i]
        rid = cur[c]
        if rid < 0:
            continue
        e = TS[T_ENQ][rid]
        wait = now - e
        if not wait > 0.0:
            wait = 0.0
        k = prio[rid] - np.floor(wait / a)
        if best < 0 or k < best_k or (k == best_k and e < best_e):
            best, best_k, best_e = c, k, e
    return best


@njit(cache=True)
def plan(r, now, heap, FH, GI, GF, RS, RF, RQ, IP, FP, WQ, cls, prio, DEC, PRE, CHR, CHN, CHP,
         CHF, PHASE, ENDS, TS, prompt, output, CF, PT, DT, ET, G, YB, SL, BEY, CL):
    """``FastReplica.iterate``: growth, the plan, admissions, then an epoch or a step.
    Returns 0, or ``Y_PREEMPT``/``Y_EMPTY`` (3/4) when the run must be handed back."""
    nd0 = RS[r, R_ND]
    npre = RS[r, R_NP]
    if nd0 == 0 and npre == 0 and RS[r, R_WLEN] == 0:
        RS[r, R_IDLE] = 1
        return 0
    ticks = RS[r, R_TICKS]
    bs = IP[P_BS]
    if IP[P_PAGED]:
        fresh = ticks > RS[r, R_GROWN]
        due = RS[r, R_LATE]
        if fresh:
            due += PHASE[r, ticks % bs]
            RS[r, R_GROWN] = ticks
        if due:
            RS[r, R_LATE] = 0
            if due > RS[r, R_FREE]:
                return 3
            RS[r, R_FREE] -= due
    free = RS[r, R_FREE] - IP[P_WATERMARK]
    budget = IP[P_BUDGET]
    maxseqs = IP[P_MAXSEQS]
    nch = 0
    nadm = 0
    adm = WQ[W_ADM]
    if IP[P_FIFO]:
        nd = 0
        used = 0
        for i in range(npre):
            rid = PRE[r, i]
            n = prompt[rid] - RQ[rid, Q_PREFILLED]
            if nch and used + n > budget:
                break
            CHR[r, nch] = rid
            CHN[r, nch] = n
            nch += 1
            used += n
        running = nd0 + npre
        rid = WQ[W_HEAD][r, 0] if RS[r, R_WLEN] else -1
        while rid >= 0:
            if running >= maxseqs:
                break
            need = adm_blocks(rid, IP, prompt, output)[1]
            n = prompt[rid] - RQ[rid, Q_PREFILLED]
            if (nch and used + n > budget) or need > free:
                break
            CHR[r, nch] = rid
            CHN[r, nch] = n
            adm[nadm] = rid
            nch += 1
            nadm += 1
            used += n
            running += 1
            free -= need
            rid = RQ[rid, Q_NEXT]
        if nch == 0:
            nd = nd0
    else:
        nd = nd0
        left = budget - nd
        cs = IP[P_CHUNK]
        for i in range(npre):
            if left <= 0:
                break
            rid = PRE[r, i]
            n = prompt[rid] - RQ[rid, Q_PREFILLED]
            n = n if n < cs else cs
            n = n if n < left else left
            CHR[r, nch] = rid
            CHN[r, nch] = n
            nch += 1
            left -= n
        if left > 0 and RS[r, R_WLEN]:
            running = nd + npre
            aging = IP[P_AGING] != 0
            cur = WQ[W_CUR]
            for i in range(RS[r, R_NCLS] if aging else 1):
                c = WQ[W_ORDER][r, i] if aging else 0
                cur[c] = WQ[W_HEAD][r, c] if WQ[W_LEN][r, c] else -1
            while True:
                c = _candidate(r, now, RS, RQ, FP, WQ, TS, prio, aging)
                if c < 0:
                    break
                rid = cur[c]
                if left <= 0 or running >= maxseqs:
                    break
                need = adm_blocks(rid, IP, prompt, output)[1]
                if need > free:
                    break
                n = prompt[rid] - RQ[rid, Q_PREFILLED]
                n = n if n < cs else cs
                n = n if n < left else left
                CHR[r, nch] = rid
                CHN[r, nch] = n
                adm[nadm] = rid
                nch += 1
                nadm += 1
                left -= n
                running += 1
                free -= need
                cur[c] = RQ[rid, Q_NEXT]
    if nadm:
        # ``_admit``: each admission is its class's head when it leaves (a class's
        # candidates come in its FIFO order).
        for i in range(nadm):
            rid = adm[i]
            c = cls[rid]
            WQ[W_HEAD][r, c] = RQ[rid, Q_NEXT]
            WQ[W_LEN][r, c] -= 1
            tokens, need = adm_blocks(rid, IP, prompt, output)
            RS[r, R_FREE] -= need
            RQ[rid, Q_HELD] = need
            RS[r, R_ADMISSIONS] += 1
            RS[r, R_QUERIED] += tokens
            RS[r, R_WLEN] -= 1
            TS[T_SCHED][rid] = now
            PRE[r, RS[r, R_NP]] = rid
            RS[r, R_NP] += 1
    if nd == 0 and nch == 0:
        return 4
    if nd and nch == 0 and not (IP[P_AGING] and RS[r, R_WLEN]):
        # Aging reorders the queue as time passes: epochs only while nobody waits.
        fh = FH[r]
        k = (fh[0] >> 32) - ticks
        if k > IP[P_MAXEPOCH]:
            k = IP[P_MAXEPOCH]
        if IP[P_PAGED]:
            free_b = RS[r, R_FREE]
            if nd * (-(-k // bs)) > free_b:
                k = min(k, bs * (free_b // nd))
        if k > 1:
            if CF[6] != 0.0:
                ctx0 = float(RS[r, R_KEYMAX] + ticks)
            else:
                ctx0 = (RS[r, R_KEYSUM] + nd * ticks) / nd
            decode_ends(CF, G, YB, SL, BEY, CL[r], nd, ctx0, k, now, ENDS[r])
            RS[r, R_INEP] = 1
            RS[r, R_HASENDS] = 1
            RS[r, R_MODE] = MODE_EPOCH
            RS[r, R_EPND] = nd
            RS[r, R_EPK] = k
            RS[r, R_EPM] = k
            RF[r, F_EPSTART] = now
            RS[r, R_VER] += 1
            push(heap, GI, now + (ENDS[r, k - 1] - now), NORMAL, EV_END, r, RS[r, R_VER])
            return 0
    if nd:
        ctx_max = RS[r, R_KEYMAX] + ticks
        ctx_sum = RS[r, R_KEYSUM] + nd * ticks
    else:
        ctx_max = ctx_sum = 0
    for i in range(nch):
        rid = CHR[r, i]
        CHP[i] = RQ[rid, Q_PREFILLED]
        CHF[i] = RQ[rid, Q_PREFILLED] + CHN[r, i] >= prompt[rid]
    dt = step_time(CF, PT, DT, ET, CL[r], nd, ctx_max, ctx_sum, CHN[r], CHP, CHF, nch) + 0.0
    GI[G_STEPS] += 1
    GF[H_STEPTOT] += dt
    RS[r, R_MODE] = MODE_STEP
    RS[r, R_STEPND] = nd
    RS[r, R_NCH] = nch
    RS[r, R_VER] += 1
    push(heap, GI, now + dt, NORMAL, EV_END, r, RS[r, R_VER])
    return 0
