"""One replica's bookkeeping, compiled: events, connection pools, admission sizes,
the waiting and swapped queues, arrivals and epoch cuts (``fastreplica.FastReplica``'s
``enqueue``/``interrupted``/``rejects``/``adm_blocks``, ``ConnectionPools``,
``AgingPriorityQueue.push``/``requeue``), on the arrays of ``state``.

Orders that matter are kept: the waiting queues (per class, linked through
``Q_NEXT``; a class new to a replica goes last in its class order, as in the aging
queue's dict), the swapped queue (also through ``Q_NEXT``: a request is in one queue at
a time), the prefilling list (``PRE``, shifted on removal), the finish heap
``(tick, rid)`` and the ``_last_tok`` entries (``LT_T``/``LT_C``, insertion order).
The decoders (``DEC``) are a set: nothing reads their order (victims are chosen by a
key that ends in the request id)."""
from __future__ import annotations

import heapq

from simulator.loops.compiled import state as S
from simulator.kernel import kernel as jit
from simulator.loops.compiled.cost import bisect_left, bisect_right


@jit
def push(heap, GI, t, prio, kind, obj, ver):
    """``FastLoop.push``: SimPy's order is (time, priority, insertion)."""
    heapq.heappush(heap, (t, prio, GI[S.G_EID], kind, obj, ver))
    GI[S.G_EID] += 1


@jit
def acquire(c, now, IP, FP, GI, IDL, ILEN, OPEN):
    """``ConnectionPools.acquire``: (is_new, pooled)."""
    if IP[S.P_REUSE] == 0:
        GI[S.G_NEWC] += 1
        return True, False
    keepalive = FP[S.D_KEEPALIVE]
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
        GI[S.G_REUSEDC] += 1
        return False, True
    GI[S.G_NEWC] += 1
    if OPEN[c] < IP[S.P_POOLSIZE]:
        OPEN[c] += 1
        return True, True
    return True, False


@jit
def release(c, free_at, pooled, IP, IDL, ILEN):
    """``ConnectionPools.release``."""
    if pooled and IP[S.P_REUSE] != 0:
        IDL[c, ILEN[c]] = free_at
        ILEN[c] += 1


@jit
def adm_blocks(rid, IP, RQ, prompt, output):
    """``FastReplica.adm_tokens`` and ``adm_blocks`` (no prefix cache): (tokens, blocks)."""
    if IP[S.P_PAGED]:
        tokens = RQ[rid, S.Q_PLEN]
    elif IP[S.P_MAXLEN] >= 0:
        tokens = IP[S.P_MAXLEN]
    else:
        tokens = prompt[rid] + output[rid]
    return tokens, -(-tokens // IP[S.P_BS])


@jit
def rejects(rid, IP, RQ, prompt, output):
    """``FastReplica.rejects``: True when ``rid`` can never run here."""
    total = prompt[rid] + output[rid]
    if IP[S.P_MAXLEN] >= 0 and total > IP[S.P_MAXLEN]:
        return True
    if IP[S.P_PAGED]:
        need = -(-total // IP[S.P_BS])
    else:
        need = adm_blocks(rid, IP, RQ, prompt, output)[1]
    return need > IP[S.P_CAPACITY] - IP[S.P_WATERMARK]


@jit
def outstanding(r, now, RS, ENDS):
    """``FastReplica.outstanding_tokens``."""
    if RS[r, S.R_HASENDS] == 0:
        return RS[r, S.R_OUT]
    return RS[r, S.R_OUT] - bisect_right(ENDS[r], RS[r, S.R_EPK], now) * RS[r, S.R_ND]


@jit
def _seen(r, c, RS, WQ):
    """A class this replica's queue has not held before goes last in its order."""
    if WQ[S.W_TAIL][r, c] == -2:
        WQ[S.W_ORDER][r, RS[r, S.R_NCLS]] = c
        RS[r, S.R_NCLS] += 1
        WQ[S.W_TAIL][r, c] = -1


@jit
def waiting_append(r, rid, c, RS, RQ, WQ):
    """``deque.append`` / ``AgingPriorityQueue.push``."""
    _seen(r, c, RS, WQ)
    RQ[rid, S.Q_NEXT] = -1
    if WQ[S.W_LEN][r, c] == 0:
        WQ[S.W_HEAD][r, c] = rid
    else:
        RQ[WQ[S.W_TAIL][r, c], S.Q_NEXT] = rid
    WQ[S.W_TAIL][r, c] = rid
    WQ[S.W_LEN][r, c] += 1
    RS[r, S.R_WLEN] += 1


@jit
def waiting_requeue(r, rid, RS, RQ, WQ, TS, cls, aging):
    """A request preempted by recompute waits again: at the queue's front
    (``deque.appendleft``), or, with aging, in its class after every request that
    arrived no later (``AgingPriorityQueue.requeue``)."""
    c = cls[rid]
    _seen(r, c, RS, WQ)
    prev = -1
    cur = WQ[S.W_HEAD][r, c] if WQ[S.W_LEN][r, c] else -1
    if aging:
        e = TS[S.T_ENQ][rid]
        while cur >= 0 and TS[S.T_ENQ][cur] <= e:
            prev = cur
            cur = RQ[cur, S.Q_NEXT]
    RQ[rid, S.Q_NEXT] = cur
    if prev < 0:
        WQ[S.W_HEAD][r, c] = rid
    else:
        RQ[prev, S.Q_NEXT] = rid
    if cur < 0:
        WQ[S.W_TAIL][r, c] = rid
    WQ[S.W_LEN][r, c] += 1
    RS[r, S.R_WLEN] += 1


@jit
def swapped_append(r, rid, RS, RQ):
    """The swapped queue: ``deque.append``."""
    RQ[rid, S.Q_NEXT] = -1
    if RS[r, S.R_SLEN]:
        RQ[RS[r, S.R_STAIL], S.Q_NEXT] = rid
    else:
        RS[r, S.R_SHEAD] = rid
    RS[r, S.R_STAIL] = rid
    RS[r, S.R_SLEN] += 1


@jit
def enqueue(r, rid, now, heap, GI, RS, RQ, IP, WQ, cls, prompt, output):
    """``FastReplica.enqueue``: join the queue; wake an idle engine, or end an epoch
    when the arrival could be admitted at its next step (with aging: any arrival, the
    queue's order changes with time alone)."""
    was_empty = RS[r, S.R_WLEN] == 0
    waiting_append(r, rid, cls[rid], RS, RQ, WQ)
    RS[r, S.R_OUT] += prompt[rid] + output[rid]
    if RS[r, S.R_IDLE]:
        if not RS[r, S.R_WAKE]:
            RS[r, S.R_WAKE] = 1
            push(heap, GI, now, S.NORMAL, S.EV_WAKE, r, 0)
    elif RS[r, S.R_INEP] and (IP[S.P_AGING] or (
            was_empty and RS[r, S.R_ND] + RS[r, S.R_NP] < IP[S.P_MAXSEQS]
            and adm_blocks(rid, IP, RQ, prompt, output)[1]
            <= RS[r, S.R_FREE] - IP[S.P_WATERMARK])):
        RS[r, S.R_INEP] = 0
        push(heap, GI, now, S.URGENT, S.EV_INTERRUPT, r, 0)


@jit
def interrupted(r, now, heap, GI, RS, ENDS):
    """``FastReplica.interrupted``: the step in progress completes."""
    k = RS[r, S.R_EPK]
    j = min(bisect_left(ENDS[r], k, now), k - 1)
    RS[r, S.R_EPM] = j + 1
    RS[r, S.R_INEP] = 0
    d = ENDS[r, j] - now
    RS[r, S.R_VER] += 1
    push(heap, GI, now + (d if d > 0.0 else 0.0), S.NORMAL, S.EV_END, r, RS[r, S.R_VER])
