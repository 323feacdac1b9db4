"""The policies and waiting queues of the compiled loop.

The policies' own kernels (their fill rules and order keys, ``simulator.model.policies``)
are called here by number: ``FILLS`` and ``ORDERS`` list the kernels the compiled loop
knows, and a policy runs compiled when its kernels are among them (``policy_ids``). No
decision is re-expressed here; this module only keeps the waiting queue on arrays: per
replica and class a FIFO linked through ``Q_NEXT`` (head, tail, length; a class new to a
replica goes last in its class order, as ``WaitingQueue``'s dict), and the "resumed"
requests of an order that depends on progress (also through ``Q_NEXT``: a request is in
one queue at a time), and offers candidates in the order's sequence, a few at a time.
"""
from __future__ import annotations

from simulator.kernel import kernel as jit
from simulator.loops.compiled import state as S
from simulator.model.policies.chunked import fill_chunked
from simulator.model.policies.edf import edf_key
from simulator.model.policies.fair_score import fair_key
from simulator.model.policies.fifo import fill_whole_prompts
from simulator.model.policies.priority_aging import aging_key
from simulator.model.policies.static import fill_static
from simulator.model.scheduling.policy import REQUEUE_ARRIVAL, REQUEUE_FRONT
from simulator.model.scheduling.queues import goes_before, heads_suffice, progress

FILLS = (fill_whole_prompts, fill_chunked, fill_static)
ORDERS = (None, aging_key, fair_key, edf_key)  # None: arrival order (one FIFO)


def policy_ids(policy):
    """``(fill id, order id)`` of a policy whose kernels the compiled loop knows, or None
    (also for one whose order is not followed by the classes' heads: ``heads_suffice``)."""
    if not heads_suffice(policy):
        return None
    fill = next((i for i, k in enumerate(FILLS) if k is policy.fill_kernel), None)
    order = next((i for i, k in enumerate(ORDERS) if k is policy.order_kernel), None)
    return None if fill is None or order is None else (fill, order)


@jit
def fill(fill_id, budget, chunk, max_seqs, n_running, free, n_dec, pre_rem, n_pre, cand_rem,
         cand_need, n_cand, out_pre, out_cand):
    """The policy's fill rule, by its number in ``FILLS``."""
    if fill_id == 0:
        return fill_whole_prompts(budget, chunk, max_seqs, n_running, free, n_dec, pre_rem,
                                  n_pre, cand_rem, cand_need, n_cand, out_pre, out_cand)
    if fill_id == 2:
        return fill_static(budget, chunk, max_seqs, n_running, free, n_dec, pre_rem, n_pre,
                           cand_rem, cand_need, n_cand, out_pre, out_cand)
    return fill_chunked(budget, chunk, max_seqs, n_running, free, n_dec, pre_rem, n_pre,
                        cand_rem, cand_need, n_cand, out_pre, out_cand)


@jit
def order_key(order_id, prio, enq, progress, now, p):
    """The policy's order key, by its number in ``ORDERS``."""
    if order_id == 1:
        return aging_key(prio, enq, progress, now, p)
    if order_id == 2:
        return fair_key(prio, enq, progress, now, p)
    if order_id == 3:
        return edf_key(prio, enq, progress, now, p)
    return 0.0


@jit
def _seen(r, c, RS, WQ):
    """A class this replica's queue has not held before goes last in its order."""
    if WQ[S.W_TAIL][r, c] == -2:
        WQ[S.W_ORDER][r, RS[r, S.R_NCLS]] = c
        RS[r, S.R_NCLS] += 1
        WQ[S.W_TAIL][r, c] = -1


@jit
def waiting_append(r, rid, c, RS, RQ, WQ):
    """``WaitingQueue.push``."""
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
def waiting_requeue(r, rid, RS, RQ, WQ, TS, cls, requeue):
    """``WaitingQueue.requeue``: a request preempted by recompute waits again at the
    queue's front, in its class after every request that arrived no later, or among the
    resumed requests."""
    RS[r, S.R_WLEN] += 1
    if requeue != REQUEUE_FRONT and requeue != REQUEUE_ARRIVAL:
        RQ[rid, S.Q_NEXT] = RS[r, S.R_RHEAD] if RS[r, S.R_RLEN] else -1
        RS[r, S.R_RHEAD] = rid
        RS[r, S.R_RLEN] += 1
        RQ[rid, S.Q_RESUMED] = 1
        return
    c = cls[rid]
    _seen(r, c, RS, WQ)
    prev = -1
    cur = WQ[S.W_HEAD][r, c] if WQ[S.W_LEN][r, c] else -1
    if requeue == REQUEUE_ARRIVAL:
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


@jit
def begin_candidates(r, GI, RS, WQ):
    """Start offering this replica's waiting requests in order: each class from its head,
    no resumed request taken yet (a new round number marks the ones taken)."""
    cur = WQ[S.W_CUR]
    for i in range(RS[r, S.R_NCLS]):
        c = WQ[S.W_ORDER][r, i]
        cur[c] = WQ[S.W_HEAD][r, c] if WQ[S.W_LEN][r, c] else -1
    GI[S.G_ROUND] += 1


@jit
def next_candidate(r, now, order_id, GI, RS, RQ, WQ, TS, prio, output, OP):
    """The next waiting request in the order's sequence (``WaitingQueue.candidates``),
    or -1: the lowest (key, arrival) among the classes' next requests and the resumed
    requests not yet offered, ties to the earlier class, then to a class over a resumed
    request."""
    cur = WQ[S.W_CUR]
    if RS[r, S.R_NCLS] <= 1 and RS[r, S.R_RLEN] == 0:
        # One FIFO: its order is the key's order.
        c = WQ[S.W_ORDER][r, 0] if RS[r, S.R_NCLS] else -1
        if c < 0 or cur[c] < 0:
            return -1
        rid = cur[c]
        cur[c] = RQ[rid, S.Q_NEXT]
        return rid
    best = -1
    best_c = -1
    best_k = 0.0
    best_e = 0.0
    for i in range(RS[r, S.R_NCLS]):
        c = WQ[S.W_ORDER][r, i]
        rid = cur[c]
        if rid < 0:
            continue
        e = TS[S.T_ENQ][rid]
        k = order_key(order_id, prio[rid], e, progress(RQ[rid, S.Q_GENERATED], output[rid]),
                      now, OP)
        if best < 0 or goes_before(k, e, best_k, best_e):
            best, best_c, best_k, best_e = rid, c, k, e
    m = RS[r, S.R_RHEAD] if RS[r, S.R_RLEN] else -1
    while m >= 0:
        if RQ[m, S.Q_ROUND] != GI[S.G_ROUND]:
            e = TS[S.T_ENQ][m]
            k = order_key(order_id, prio[m], e, progress(RQ[m, S.Q_GENERATED], output[m]),
                          now, OP)
            if best < 0 or goes_before(k, e, best_k, best_e):
                best, best_c, best_k, best_e = m, -1, k, e
        m = RQ[m, S.Q_NEXT]
    if best < 0:
        return -1
    if best_c >= 0:
        cur[best_c] = RQ[best, S.Q_NEXT]
    else:
        RQ[best, S.Q_ROUND] = GI[S.G_ROUND]
    return best


@jit
def waiting_remove(r, rid, RS, RQ, WQ, cls):
    """An admitted request leaves the queue: its class's head (a class's candidates come
    in its FIFO order), or one of the resumed requests."""
    RS[r, S.R_WLEN] -= 1
    if RQ[rid, S.Q_RESUMED]:
        RQ[rid, S.Q_RESUMED] = 0
        RS[r, S.R_RLEN] -= 1
        prev = -1
        m = RS[r, S.R_RHEAD]
        while m != rid:
            prev = m
            m = RQ[m, S.Q_NEXT]
        if prev < 0:
            RS[r, S.R_RHEAD] = RQ[rid, S.Q_NEXT]
        else:
            RQ[prev, S.Q_NEXT] = RQ[rid, S.Q_NEXT]
        return
    c = cls[rid]
    WQ[S.W_HEAD][r, c] = RQ[rid, S.Q_NEXT]
    WQ[S.W_LEN][r, c] -= 1
