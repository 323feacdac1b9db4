"""A replica's next step, compiled: ``fastreplica.FastReplica.iterate`` (paged growth
and the preemptions it forces, swap-ins, the policy's plan and admissions, then a
decode epoch, one step, or an iteration that only copies swapped blocks)."""
from __future__ import annotations

import math

import numpy as np

from simulator.loops.compiled import state as S
from simulator.kernel import kernel as jit
from simulator.loops.compiled.apply import clean_top
from simulator.loops.compiled.cost import decode_ends, step_time
from simulator.loops.compiled.memory import make_room, swap_in
from simulator.loops.compiled.replica import adm_blocks, push


@jit
def _candidate(r, now, RS, FP, WQ, TS, prio, aging):
    """``AgingPriorityQueue.candidates``' next one: the class whose next request has the
    lowest (priority - floor(wait / aging_s), enqueued), ties to the earlier class in
    the order; -1 when none is left. Without aging: the one queue's next."""
    order, cur = WQ[S.W_ORDER], WQ[S.W_CUR]
    if not aging:
        return 0 if cur[0] >= 0 else -1
    best = -1
    best_k = 0.0
    best_e = 0.0
    a = FP[S.D_AGING]
    for i in range(RS[r, S.R_NCLS]):
        c = order[r, i]
        rid = cur[c]
        if rid < 0:
            continue
        e = TS[S.T_ENQ][rid]
        wait = now - e
        if not wait > 0.0:
            wait = 0.0
        k = prio[rid] - np.floor(wait / a)
        if best < 0 or k < best_k or (k == best_k and e < best_e):
            best, best_k, best_e = c, k, e
    return best


@jit
def plan(r, now, heap, FH, GI, GF, RS, RF, RQ, RQF, IP, FP, WQ, cls, prio, DEC, PRE, CHR, CHN,
         CHP, CHF, PHASE, ENDS, LT_T, LT_C, TS, prompt, output, COST):
    """``FastReplica.iterate``: plan the next step at ``now`` (or go idle). Returns 0,
    or ``Y_EMPTY`` when the plan is empty (the run is then handed back)."""
    CF, PT, DT, ET, G, YB, SL, BEY, CL = COST
    if (RS[r, S.R_ND] == 0 and RS[r, S.R_NP] == 0 and RS[r, S.R_WLEN] == 0
            and RS[r, S.R_SLEN] == 0):
        RS[r, S.R_IDLE] = 1
        return 0
    ticks = RS[r, S.R_TICKS]
    bs = IP[S.P_BS]
    hold = False
    RF[r, S.F_COPY] = 0.0
    if IP[S.P_PAGED]:
        # ``_make_room``: a block for each decoder crossing a boundary now, preempting
        # victims while the free blocks are too few.
        fresh = ticks > RS[r, S.R_GROWN]
        due = RS[r, S.R_LATE]
        if fresh:
            due += PHASE[r, ticks % bs]
            RS[r, S.R_GROWN] = ticks
        if due:
            RS[r, S.R_LATE] = 0
            if due > RS[r, S.R_FREE]:
                hold = True
                due = make_room(r, due, fresh, now, RS, RF, RQ, RQF, IP, FP, TS, WQ, cls, prio,
                                DEC, PRE, PHASE, LT_T, LT_C, prompt, output)
            RS[r, S.R_FREE] -= due
    # Swapped requests come back before anyone new; a step that preempted, or that
    # left someone swapped out, admits nobody.
    if RS[r, S.R_SLEN] and not hold:
        swap_in(r, now, FH, RS, RF, RQ, RQF, IP, FP, TS, DEC, PHASE, LT_T, LT_C, prompt, output)
    hold = hold or RS[r, S.R_SLEN] > 0
    free = 0 if hold else RS[r, S.R_FREE] - IP[S.P_WATERMARK]
    nd0 = RS[r, S.R_ND]
    npre = RS[r, S.R_NP]
    budget = IP[S.P_BUDGET]
    maxseqs = IP[S.P_MAXSEQS]
    nch = 0
    nadm = 0
    adm = WQ[S.W_ADM]
    if IP[S.P_FIFO]:
        nd = 0
        used = 0
        for i in range(npre):
            rid = PRE[r, i]
            n = RQ[rid, S.Q_PLEN] - RQ[rid, S.Q_PREFILLED]
            if nch and used + n > budget:
                break
            CHR[r, nch] = rid
            CHN[r, nch] = n
            nch += 1
            used += n
        running = nd0 + npre
        rid = WQ[S.W_HEAD][r, 0] if RS[r, S.R_WLEN] else -1
        while rid >= 0:
            if running >= maxseqs:
                break
            need = adm_blocks(rid, IP, RQ, prompt, output)[1]
            n = RQ[rid, S.Q_PLEN] - RQ[rid, S.Q_PREFILLED]
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
            rid = RQ[rid, S.Q_NEXT]
        if nch == 0:
            nd = nd0
    else:
        nd = nd0
        left = budget - nd
        cs = IP[S.P_CHUNK]
        for i in range(npre):
            if left <= 0:
                break
            rid = PRE[r, i]
            n = RQ[rid, S.Q_PLEN] - RQ[rid, S.Q_PREFILLED]
            n = n if n < cs else cs
            n = n if n < left else left
            CHR[r, nch] = rid
            CHN[r, nch] = n
            nch += 1
            left -= n
        if left > 0 and RS[r, S.R_WLEN]:
            running = nd + npre
            aging = IP[S.P_AGING] != 0
            cur = WQ[S.W_CUR]
            for i in range(RS[r, S.R_NCLS] if aging else 1):
                c = WQ[S.W_ORDER][r, i] if aging else 0
                cur[c] = WQ[S.W_HEAD][r, c] if WQ[S.W_LEN][r, c] else -1
            while True:
                c = _candidate(r, now, RS, FP, WQ, TS, prio, aging)
                if c < 0:
                    break
                rid = cur[c]
                if left <= 0 or running >= maxseqs:
                    break
                need = adm_blocks(rid, IP, RQ, prompt, output)[1]
                if need > free:
                    break
                n = RQ[rid, S.Q_PLEN] - RQ[rid, S.Q_PREFILLED]
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
                cur[c] = RQ[rid, S.Q_NEXT]
    for i in range(nadm):
        # ``_admit``: each admission is its class's head when it leaves (a class's
        # candidates come in its FIFO order).
        rid = adm[i]
        c = cls[rid]
        WQ[S.W_HEAD][r, c] = RQ[rid, S.Q_NEXT]
        WQ[S.W_LEN][r, c] -= 1
        RS[r, S.R_WLEN] -= 1
        tokens, need = adm_blocks(rid, IP, RQ, prompt, output)
        RS[r, S.R_FREE] -= need
        RQ[rid, S.Q_HELD] = need
        RS[r, S.R_ADMISSIONS] += 1
        RS[r, S.R_QUERIED] += tokens
        pre_at = RQF[rid, S.QF_PREEMPTED_AT]
        if math.isnan(pre_at):
            TS[S.T_SCHED][rid] = now
        else:
            TS[S.T_PREEMPTED_S][rid] += now - pre_at
        PRE[r, RS[r, S.R_NP]] = rid
        RS[r, S.R_NP] += 1
    copy_s = RF[r, S.F_COPY]
    if nd == 0 and nch == 0:
        if copy_s and (RS[r, S.R_ND] or RS[r, S.R_NP]):
            # Only swap copies this iteration: charge them, then plan again.
            RF[r, S.F_COPYING] = copy_s
            RS[r, S.R_MODE] = S.MODE_COPY
            RS[r, S.R_VER] += 1
            push(heap, GI, now + copy_s, S.NORMAL, S.EV_END, r, RS[r, S.R_VER])
            return 0
        return S.Y_EMPTY
    if (nd and nch == 0 and not hold and not copy_s
            and not (IP[S.P_AGING] and RS[r, S.R_WLEN])):
        # A decode epoch up to the next finish (aging reorders the queue as time
        # passes: epochs only while nobody waits).
        fh = FH[r]
        clean_top(fh, RQ)
        k = (fh[0] >> 32) - ticks
        if k > IP[S.P_MAXEPOCH]:
            k = IP[S.P_MAXEPOCH]
        if IP[S.P_PAGED]:
            free_b = RS[r, S.R_FREE]
            if nd * (-(-k // bs)) > free_b:
                k = min(k, bs * (free_b // nd))
        if k > 1:
            if CF[6] != 0.0:
                ctx0 = float(RS[r, S.R_KEYMAX] + ticks)
            else:
                ctx0 = (RS[r, S.R_KEYSUM] + nd * ticks) / nd
            decode_ends(CF, G, YB, SL, BEY, CL[r], nd, ctx0, k, now, ENDS[r])
            RS[r, S.R_INEP] = 1
            RS[r, S.R_HASENDS] = 1
            RS[r, S.R_MODE] = S.MODE_EPOCH
            RS[r, S.R_EPK] = k
            RS[r, S.R_EPM] = k
            RF[r, S.F_EPSTART] = now
            RS[r, S.R_VER] += 1
            push(heap, GI, now + (ENDS[r, k - 1] - now), S.NORMAL, S.EV_END, r,
                 RS[r, S.R_VER])
            return 0
    if nd:
        ctx_max = RS[r, S.R_KEYMAX] + ticks
        ctx_sum = RS[r, S.R_KEYSUM] + nd * ticks
    else:
        ctx_max = ctx_sum = 0
    for i in range(nch):
        rid = CHR[r, i]
        CHP[i] = RQ[rid, S.Q_PREFILLED]
        CHF[i] = RQ[rid, S.Q_PREFILLED] + CHN[r, i] >= RQ[rid, S.Q_PLEN]
    dt = step_time(CF, PT, DT, ET, CL[r], nd, ctx_max, ctx_sum, CHN[r], CHP, CHF, nch) + copy_s
    GI[S.G_STEPS] += 1
    GF[S.H_STEPTOT] += dt
    GF[S.H_SWAPCOPY] += copy_s
    RS[r, S.R_MODE] = S.MODE_STEP
    RS[r, S.R_STEPND] = nd
    RS[r, S.R_NCH] = nch
    RS[r, S.R_VER] += 1
    push(heap, GI, now + dt, S.NORMAL, S.EV_END, r, RS[r, S.R_VER])
    return 0
