"""Clients that act on the wait estimate the gateway publishes (``client.wait_patience_s``).

When the estimate for the replica a request was routed to (``cluster.waitest``, the
``work`` estimate by default) exceeds the client's patience, the client, hearing it one
way later, does what ``client.on_long_wait`` says:

- ``give_up``: it leaves at once (the request ends ``timed_out``; the attempt's outcome
  is ``balked``), sparing the queue a request it would have abandoned anyway;
- ``elsewhere``: it goes to the ready replica (another region, another replica) with
  the least estimate, if that one is within its patience (the gateway publishes every
  replica's estimate, so this costs no extra round trip), else it gives up;
- ``later``: it comes back after ``come_back_s`` (default: the estimate it was told) as
  a new attempt, at most ``max_come_backs`` times and within its deadline, else it
  gives up.

``summary.json`` ``traffic`` counts them (``balked``, ``moved_elsewhere``,
``came_back``).
"""
from __future__ import annotations

from simulator.wire import clients as C

__all__ = ["long_wait"]


def long_wait(gw, seq, ready, slot: int, now: float, est: float, est99: float):
    """The client of ``seq`` is told ``est`` (past its patience) for replica ``slot``:
    ``(slot, replica, waiting, est, est99)`` where it goes instead, or None when it
    balks (gives up, or will come back later)."""
    cl = gw.clients
    if cl.cfg.on_long_wait == "elsewhere":
        best = None
        for s in ready:
            if s == slot:
                continue
            rep = gw.fleet.replicas[s]
            waiting = [q for q in rep.queued() if q.rid not in gw.leaving]
            e, e99 = gw.estimator.estimate(rep, waiting, now)
            if best is None or e < best[3]:
                best = (s, rep, waiting, e, e99)
        if best is not None and best[3] <= cl.patience:
            cl.moved += 1
            return best
    aid = seq.rid
    gw.a_est[aid], gw.a_est99[aid] = est, est99
    gw.a_out[aid] = C.BALKED
    t = now + gw.net.one_way
    gw.a_end[aid] = t
    rid = int(gw.a_rid[aid])
    gw.pools.release(int(gw.client_ids[rid]), t, bool(gw.a_pooled[aid]))
    cl.balked += 1
    gw.env.timeout(gw.net.one_way).callbacks.append(lambda _e: _decide(gw, aid, rid, est))
    return None


def _decide(gw, aid: int, rid: int, est: float) -> None:
    """The client of attempt ``aid`` heard the estimate now: come back later, or leave."""
    from simulator.cluster.outcomes import TIMED_OUT, UNFINISHED
    if gw.outcome[rid] != UNFINISHED or gw.cur[rid] != aid:
        return
    cl = gw.clients
    cfg = cl.cfg
    now = gw.env.now
    if cfg.on_long_wait == "later" and gw.attempts[rid] < cl.max_attempts:
        d = cfg.come_back_s if cfg.come_back_s is not None else est
        if now + d < float(gw.wl.arrival_s[rid]) + cl.deadline:
            cl.came_back += 1
            aid2 = gw.next_aid
            gw.next_aid += 1
            gw.cur[rid] = aid2
            gw.env.timeout(d).callbacks.append(lambda _e: gw.send(rid, aid2))
            return
    gw._resolve(rid, TIMED_OUT)
