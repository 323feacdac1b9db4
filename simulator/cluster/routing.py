"""Where the gateway sends an attempt that reached it: the routing decision, in the
order a gateway takes it.

1. The *ready* replicas (``cluster.autoscaler.Fleet``), narrowed to the ones it may
   enter by (disaggregated serving: the prefill replicas) or, with pools of different KV
   capacity, to those that can hold it; what fits none (or, with one pool, fits no
   replica's KV cache) is refused (413, never retried).
2. Replica faults and circuit breakers (``cluster.faults``, ``cluster.breaker``): of
   those, the ones not known to be down and whose breaker lets a request through; with
   none, the attempt waits at the gateway until one is.
3. Degradation under overload (``cluster.degrade``): the degrade pool, and an output cap.
4. The router picks one, and the gateway computes the wait estimate it publishes.
5. A client that acts on that estimate (``cluster.patience``) may go elsewhere among
   the same routable replicas, or balk.
6. Only then is the attempt sent to the replica it ends up on: the fault model learns
   of it (``Faults.refused``: a replica that is down but not yet detected fails it; a
   half-open breaker counts its probe). Doing this last matters: a client that moved
   elsewhere must meet the fault checks of the replica it moved to (it would otherwise
   wait forever on a stopped replica), and a probe counted on a replica the request
   never reached would never resolve, keeping that breaker half-open for good.
"""
from __future__ import annotations

import math

from simulator.cluster.admission import TOO_LARGE, Decision
from simulator.cluster.patience import long_wait

__all__ = ["route"]


def route(gw, seq, now: float):
    """Route attempt ``seq`` of gateway ``gw`` now (module doc): ``(slot, replica,
    waiting, est, est99)``, or None when it was refused, held, balked or failed here
    (each already handled)."""
    fleet = gw.fleet
    ready = fleet.ready
    if gw.entry is not None:
        ready = gw.entry(ready, seq)
    elif fleet.mixed:
        ready = fleet.holding(ready, seq)
    if (not ready) if fleet.mixed else fleet.built[0].rejects(seq):
        gw.arec.rejected[seq.rid] = True
        gw._refuse(seq.rid, Decision(TOO_LARGE, math.inf), now)
        return None
    faults = gw.faults
    if faults is not None:
        ready = faults.routable(ready, seq)
        if not ready:
            faults.hold(seq)            # routed again when a replica is routable
            return None
    if gw.degrade is not None:
        ready = gw.degrade.route(ready, seq, fleet.replicas)
    slot = ready[gw.router.pick([fleet.replicas[i] for i in ready], seq)]
    rep = fleet.replicas[slot]
    waiting = [s for s in rep.queued() if s.rid not in gw.leaving]
    est, est99 = gw.estimator.estimate(rep, waiting, now)
    if est > gw.clients.patience:
        moved = long_wait(gw, seq, ready, slot, now, est, est99)
        if moved is None:
            return None
        slot, rep, waiting, est, est99 = moved
    if faults is not None and faults.refused(slot, seq):
        return None                     # it was down: failed there (retried or lost)
    return slot, rep, waiting, est, est99
