"""A replica's next step, compiled: the top of the SimPy replica's loop (paged growth and
the preemptions it forces, swap-ins, the policy's fill rule and its admissions, then a
decode epoch, one step, or an iteration that only copies swapped blocks)."""
from __future__ import annotations

from simulator.loops.compiled import state as S
from simulator.cost.decodectx import epoch_context, tick_contexts
from simulator.kernel import kernel as jit
from simulator.loops.compiled.apply import clean_top
from simulator.loops.compiled.cost import decode_ends, step_time
from simulator.loops.compiled.memory import make_room, swap_in
from simulator.loops.compiled.queue import begin_candidates, fill, next_candidate, waiting_remove
from simulator.loops.compiled.prefix import adm_price, admit, take
from simulator.loops.compiled.replica import push, see_arrivals
from simulator.model.kv.rules import ceil_blocks, policy_blocks, recovered_by_hit
from simulator.model.scheduling.epoch import epoch_length, may_start
from simulator.model.scheduling.policy import next_offer
from simulator.model.scheduling.progress import admission_times, prefill_progress


@jit
def plan(r, now, heap, FH, GI, GF, RS, RF, RQ, RQF, IP, FP, WQ, cls, prio, DEC, PRE, CHR, CHN,
         CHP, CHF, PHASE, ENDS, LT_T, LT_C, TS, prompt, output, COST, PFX):
    """The top of the SimPy replica's loop: plan the next step at ``now`` (or go idle) and
    schedule its end. In order: memory (a block for each decoder crossing a boundary,
    preempting victims while blocks are short; swapped requests back before anyone new);
    the policy's fill rule, offered the waiting requests in its order a few at a time
    (the protocol of ``simulator.model.scheduling.policy``), and its admissions; then a
    decode epoch, one step, or an iteration that only copies swapped blocks. Returns 0,
    or ``Y_EMPTY`` when the plan is empty (the run is then handed back).

    One kernel, not three: numba passes the state's tuples of arrays by value on every
    call, and the split version of this, the hottest function, ran the speed benchmark
    at half the speed."""
    KIND, CF, A, X, Y, N, TO, G, YB, BEY, PC, CL, EBUF, Z, F = COST
    if RS[r, S.R_ILEN]:
        see_arrivals(r, now, RS, RF, RQ, WQ, TS, cls)
    if (RS[r, S.R_ND] == 0 and RS[r, S.R_NP] == 0 and RS[r, S.R_WLEN] == 0
            and RS[r, S.R_SLEN] == 0):
        RS[r, S.R_IDLE] = 1
        return 0
    ticks = RS[r, S.R_TICKS]
    bs = IP[S.P_BS]
    RF[r, S.F_COPY] = 0.0
    RF[r, S.F_LOAD] = 0.0
    hold = False
    prefix = IP[S.P_PREFIX] != 0
    if IP[S.P_PAGED]:
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
                                DEC, PRE, PHASE, LT_T, LT_C, prompt, output, PFX)
            if prefix:
                take(r, due, RS, PFX)
            else:
                RS[r, S.R_FREE] -= due
    if RS[r, S.R_SLEN] and not hold:
        swap_in(r, now, FH, RS, RF, RQ, RQF, IP, FP, TS, DEC, PHASE, LT_T, LT_C, prompt, output,
                PFX)
    hold = hold or RS[r, S.R_SLEN] > 0
    free = policy_blocks(hold, RS[r, S.R_FREE], IP[S.P_WATERMARK])
    nd0 = RS[r, S.R_ND]
    npre = RS[r, S.R_NP]
    CAND, CREM, CNEED, COUT = WQ[S.W_CAND], WQ[S.W_CREM], WQ[S.W_CNEED], WQ[S.W_COUT]
    PREM, POUT = WQ[S.W_PREM], WQ[S.W_POUT]
    for i in range(npre):
        rid = PRE[r, i]
        PREM[i] = RQ[rid, S.Q_PLEN] - RQ[rid, S.Q_PREFILLED]
    n_wait = RS[r, S.R_WLEN]
    if n_wait:
        begin_candidates(r, GI, RS, WQ)
    cap = CAND.shape[0]
    k = 1 if n_wait else 0
    nc = 0
    while True:
        while nc < k:
            rid = next_candidate(r, now, IP[S.P_ORDER], GI, RS, RQ, WQ, TS, prio, output,
                                 WQ[S.W_OP])
            CAND[nc] = rid
            _, cached, CNEED[nc] = adm_price(r, rid, IP, RQ, prompt, output, PFX)
            CREM[nc] = RQ[rid, S.Q_PLEN] - RQ[rid, S.Q_PREFILLED] - cached
            nc += 1
        nd, nch, nadm, more = fill(IP[S.P_FILL], IP[S.P_FILLBUDGET], IP[S.P_CHUNK],
                                   IP[S.P_FILLSEQS], nd0 + npre, free, nd0, PREM, npre, CREM,
                                   CNEED, nc, POUT, COUT)
        k = next_offer(k, n_wait, more, cap)
        if not k:
            break
    for i in range(nch):
        CHR[r, i] = PRE[r, i]
        CHN[r, i] = POUT[i]
    for i in range(nadm):
        # ``_admit`` (``KVSpace.admit_plan``): allocate its blocks, move it to the
        # prefilling set; with prefix caching an earlier admission may have evicted part
        # of the hit it was priced with: admitted with what is left, or, when its blocks
        # no longer fit, left waiting and its chunk dropped.
        rid = CAND[i]
        tokens, cached, need = adm_price(r, rid, IP, RQ, prompt, output, PFX)
        if prefix:
            if need > RS[r, S.R_FREE]:
                continue
            cached = admit(r, rid, tokens, RS, RF, IP, FP, PFX)
            RQ[rid, S.Q_HELD] = ceil_blocks(tokens, bs)
        else:
            RS[r, S.R_FREE] -= need
            RQ[rid, S.Q_HELD] = need
        waiting_remove(r, rid, RS, RQ, WQ, cls)
        RS[r, S.R_ADMISSIONS] += 1
        RS[r, S.R_QUERIED] += tokens
        if cached:
            RQ[rid, S.Q_PREFILLED] = cached
            TS[S.T_CACHED][rid] += cached
            RS[r, S.R_KV] += cached
            RS[r, S.R_OUT] -= cached
        TS[S.T_SCHED][rid], waited, again = admission_times(TS[S.T_SCHED][rid],
                                                            RQF[rid, S.QF_PREEMPTED_AT], now)
        if again:
            TS[S.T_PREEMPTED_S][rid] += waited
            if cached:
                TS[S.T_RECOMPUTED][rid] -= recovered_by_hit(cached, RQ[rid, S.Q_DROPPED])
        PRE[r, RS[r, S.R_NP]] = rid
        RS[r, S.R_NP] += 1
        CHR[r, nch] = rid
        CHN[r, nch] = COUT[i]
        nch += 1
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
    RF[r, S.F_DECIDED] = now
    # No epochs under async scheduling (its arrivals wait for a decision, not a cut).
    if IP[S.P_ASYNC] == 0 and may_start(nd, nch, hold, copy_s, IP[S.P_TIMEDEP] != 0, RS[r, S.R_WLEN]):
        # A decode epoch up to the next finish (``model.scheduling.epoch``).
        fh = FH[r]
        clean_top(fh, RQ)
        k = epoch_length(fh[0] >> 32, ticks, IP[S.P_PAGED] != 0, nd, bs, RS[r, S.R_FREE])
        if k > 1:
            ctx0 = epoch_context(IP[S.P_PADDED] != 0, nd, RS[r, S.R_KEYMAX], RS[r, S.R_KEYSUM],
                                 ticks)
            decode_ends(KIND, CF, A, X, Y, N, TO, G, YB, BEY, PC, CL[r], nd, ctx0, k, now,
                        ENDS[r], EBUF, Z, F)
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
        ctx_max, ctx_sum = tick_contexts(nd, RS[r, S.R_KEYMAX], RS[r, S.R_KEYSUM], ticks)
    else:
        ctx_max = ctx_sum = 0
    for i in range(nch):
        rid = CHR[r, i]
        CHP[i] = RQ[rid, S.Q_PREFILLED]
        CHF[i] = prefill_progress(RQ[rid, S.Q_PREFILLED], CHN[r, i], RQ[rid, S.Q_PLEN])[1]
    dt = step_time(KIND, CF, A, X, Y, N, TO, G, YB, BEY, PC, CL[r], nd, ctx_max, ctx_sum,
                   CHN[r], CHP, CHF, nch) + copy_s
    if RF[r, S.F_LOAD]:
        dt += RF[r, S.F_LOAD]     # the admissions' KV loaded from the CPU tier first
    GI[S.G_STEPS] += 1
    GF[S.H_STEPTOT] += dt
    GF[S.H_SWAPCOPY] += copy_s
    RS[r, S.R_MODE] = S.MODE_STEP
    RS[r, S.R_STEPND] = nd
    RS[r, S.R_NCH] = nch
    RS[r, S.R_VER] += 1
    push(heap, GI, now + dt, S.NORMAL, S.EV_END, r, RS[r, S.R_VER])
    return 0
