"""Replicas that fail and recover, and what the gateway does about it (容错).

A replica fails at the times of its scheduled ``outages`` and, with ``mtbf_s`` /
``mttr_s``, after exponential up times of mean MTBF, each failure lasting an
exponential time of mean MTTR (an alternating renewal process: over a long run the
replica is up a fraction MTBF / (MTBF + MTTR) of the time). Failing, it loses
everything it held: its engine loop stops, its KV cache (prefix cache included) is
dropped, and each request in it - waiting, running or swapped - fails. It comes back
at the end of the outage as a fresh replica (an empty cache) in the same slot.

What the gateway knows: it stops routing to a failed replica ``detect_s`` after the
failure (its health check); until then a request routed there fails ``refuse_s``
later (a refused connection, or a connect timeout). A failed request - in flight on
the replica, or refused by it - counts as a failure for the replica's circuit breaker
(``cluster.breaker``) and then, with ``in_flight: lost``, fails (its client hears a 502
one way later, and does not retry it); with ``retry`` it re-enters the gateway at once
as a new attempt (its own row in the attempts table, outcome ``failed`` for the one
that failed) routed to another replica, up to ``max_retries`` times per request, after
which it fails.

A retried request starts over on its new replica (prefill included; its stream starts
again, and its TTFT is the retry's). Routing avoids replicas known to be down and
those whose breaker is open (or half-open with its probes out), and a retry avoids the
replica it failed on while that outage lasts. When no replica is routable the request
waits at the gateway and is routed again as soon as one is (a recovery, a breaker
half-opening): so with one replica and ``detect_s`` 0, a request arriving during an
outage waits exactly until the recovery.

Per request: ``fault_retries`` (gateway retries after faults) and ``fault_lost_s``
(time lost to faults: on attempts that failed, from their routing to their failure, and
waiting at the gateway for a routable replica; a client's own backoff is not in it).
``timeline``: every failure, detection, recovery and breaker transition.
"""
from __future__ import annotations

import numpy as np

from simulator.cluster.breaker import Breakers
from simulator.cluster.outcomes import FAILED, UNFINISHED
from simulator.loops.simpy.replica import SimSeq
from simulator.model.kv.blocks import request_blocks
from simulator.wire import clients as C

FAIL, DETECTED, RECOVER = "fail", "detected", "recover"


def up_down_times(rng, mtbf: float, mttr: float):
    """``(fails at, recovers at)`` of one replica, forever: up for Exp(mtbf) from 0,
    down for Exp(mttr), and so on (alternating exponential times)."""
    t = 0.0
    while True:
        t += float(rng.exponential(mtbf))
        f = t
        t += float(rng.exponential(mttr))
        yield f, t


def down_intervals(timeline, n_slots: int, end: float) -> list[list[tuple[float, float]]]:
    """Each slot's ``(down from, up at)`` intervals from a timeline (an outage still on
    at ``end`` closes there)."""
    out: list[list] = [[] for _ in range(n_slots)]
    since: dict[int, float] = {}
    for t, slot, ev in timeline:
        if ev == FAIL:
            since[slot] = t
        elif ev == RECOVER and slot in since:
            out[slot].append((since.pop(slot), t))
    for slot, t in since.items():
        out[slot].append((t, max(t, end)))
    return out


class Faults:
    """The fault model of one run (module doc): ``cfg`` ``config.faults.FaultsConfig``,
    ``breaker_cfg`` a ``BreakerConfig`` or None, ``rng`` its own stream (one child per
    replica). ``attach(gateway)`` starts it."""

    def __init__(self, env, cfg, breaker_cfg, n_requests: int, n_slots: int, rng,
                 block_size: int) -> None:
        if cfg is None:
            # A breaker alone (it opens on latency): no replica ever fails.
            from simulator.config.faults import FaultsConfig
            cfg = FaultsConfig.model_construct(max_retries=0)   # (defaults: no outages)
        self.env, self.cfg = env, cfg
        self.bs = block_size
        self.down = [False] * n_slots
        self.known = [False] * n_slots       # the gateway knows it is down
        self.outage = [0] * n_slots          # outages so far (which one is on)
        self.recover_at = [0.0] * n_slots
        self.breakers = (Breakers(env, breaker_cfg, n_slots, self._log, self.release,
                                  self._abandoned) if breaker_cfg is not None else None)
        self.rngs = rng.spawn(n_slots)
        self.timeline: list[tuple[float, int, str]] = []
        self.held: list[SimSeq] = []
        self.forward: dict[int, int] = {}    # failed attempt -> the retry that replaced it
        self.avoid: dict[int, tuple[int, int]] = {}   # request -> (slot, outage) it failed on
        self.fault_retries = np.zeros(n_requests, dtype=np.int32)
        self.lost_s = np.zeros(n_requests)   # time lost to faults, per request
        self.held_since: dict[int, float] = {}   # attempt -> when it was first held
        self.routed_t: dict[int, float] = {}     # attempt -> when it was routed
        self.tally = {"failures": 0, "in_flight_failed": 0, "refused_while_down": 0,
                      "retried": 0, "lost": 0, "held": 0}
        self.gw = None

    def attach(self, gateway) -> None:
        """Start the failures (the scheduled ones and each replica's MTBF process)."""
        self.gw = gateway
        env, cfg = self.env, self.cfg
        for o in cfg.outages:
            if o.replica < len(self.down):
                env.timeout(o.start_s).callbacks.append(
                    lambda _e, s=o.replica, d=o.duration_s: self.fail(s, self.env.now + d))
        if cfg.mtbf_s is not None:
            for slot in range(len(self.down)):
                env.process(self._renewals(slot))

    def _renewals(self, slot: int):
        """Replica ``slot``'s exponential failures, until every request has ended."""
        for f, r in up_down_times(self.rngs[slot], self.cfg.mtbf_s, self.cfg.mttr_s):
            if f > self.env.now:
                yield self.env.timeout(f - self.env.now)
            if self.gw.all_resolved:
                return
            self.fail(slot, r)

    # -- a replica's life -----------------------------------------------------------------
    def _log(self, slot: int, ev: str) -> None:
        self.timeline.append((float(self.env.now), slot, ev))

    def fail(self, slot: int, until: float) -> None:
        """Replica ``slot`` fails now and stays down until ``until`` (an outage already on
        is extended)."""
        env = self.env
        self.recover_at[slot] = max(self.recover_at[slot], until)
        env.timeout(max(until - env.now, 0.0)).callbacks.append(lambda _e: self._up(slot))
        if self.down[slot]:
            return
        self.down[slot] = True
        self.outage[slot] += 1
        self.tally["failures"] += 1
        self._log(slot, FAIL)
        gw = self.gw
        rep = gw.fleet.replicas[slot]
        if rep is not None:
            _stop(rep)
        victims = sorted(a for a, s in gw.seqs.items() if int(gw.a_slot[a]) == slot)
        if self.cfg.detect_s > 0:
            k = self.outage[slot]
            env.timeout(self.cfg.detect_s).callbacks.append(lambda _e: self._detect(slot, k))
        else:
            self._detect(slot, self.outage[slot])
        for aid in victims:
            self.tally["in_flight_failed"] += 1
            self._failed(aid, slot)

    def _detect(self, slot: int, k: int) -> None:
        if self.down[slot] and self.outage[slot] == k and not self.known[slot]:
            self.known[slot] = True
            self._log(slot, DETECTED)

    def _up(self, slot: int) -> None:
        if not self.down[slot] or self.env.now < self.recover_at[slot]:
            return
        self.down[slot] = self.known[slot] = False
        fleet = self.gw.fleet
        rep = fleet.make_replica(slot)     # a fresh replica: its KV cache empty
        fleet.replicas[slot] = rep
        fleet.built.append(rep)
        self._log(slot, RECOVER)
        self.release()

    # -- the gateway's hooks ----------------------------------------------------------------
    def routable(self, slots, seq: SimSeq) -> list:
        """Of the ready ``slots``, those a request may be routed to now (module doc)."""
        rid = int(self.gw.a_rid[seq.rid])
        now = self.env.now
        avoid = self.avoid.get(rid)
        br = self.breakers
        out = []
        for s in slots:
            if self.known[s] or (br is not None and not br.allows(s, now)):
                continue
            if avoid is not None and avoid == (s, self.outage[s]) and self.down[s]:
                continue
            out.append(s)
        return out

    def hold(self, seq: SimSeq) -> None:
        """No replica is routable: ``seq`` waits at the gateway (``release``)."""
        self.tally["held"] += 1
        self.held_since.setdefault(seq.rid, self.env.now)
        self.held.append(seq)

    def release(self) -> None:
        """Something became routable: the held requests enter the gateway again."""
        held, self.held = self.held, []
        for seq in held:
            if self.gw.a_out[seq.rid] != C.OPEN:
                self._held_until_left(seq.rid)     # its client gave up while it waited
                continue
            self.gw.reach(seq)

    def _held_until_left(self, aid: int) -> None:
        """Attempt ``aid`` waited at the gateway until its client left: time lost."""
        t0 = self.held_since.pop(aid, None)
        if t0 is not None:
            self.lost_s[int(self.gw.a_rid[aid])] += float(self.gw.a_end[aid]) - t0

    def refused(self, slot: int, seq: SimSeq) -> bool:
        """``seq`` was routed to ``slot`` now: True when the replica is down (the request
        failed there, connection refused); else it is taken (a breaker probe, perhaps)."""
        now = self.env.now
        aid = seq.rid
        rid = int(self.gw.a_rid[aid])
        if aid in self.held_since:
            self.lost_s[rid] += now - self.held_since.pop(aid)
        self.routed_t[aid] = now
        if self.down[slot]:
            self.tally["refused_while_down"] += 1
            gw = self.gw
            gw.a_slot[aid] = slot
            gw.seqs[aid] = seq
            if self.cfg.refuse_s > 0:
                # The gateway learns of it when its connect fails (a timeout).
                self.env.timeout(self.cfg.refuse_s).callbacks.append(
                    lambda _e: self._failed(aid, slot))
            else:
                self._failed(aid, slot)
            return True
        if self.breakers is not None:
            self.breakers.routed(slot, aid, now)
        return False

    def succeeded(self, slot: int, aid: int) -> None:
        """Attempt ``aid`` completed on ``slot`` (the breaker hears of it)."""
        if self.breakers is None:
            return
        gw = self.gw
        self.breakers.success(slot, aid, self.env.now,
                              float(gw.arec.first_token[aid] - gw.a_admit[aid]))

    def follow(self, aid: int) -> int:
        """The attempt a client's timer on ``aid`` now watches: its gateway retry, and
        that one's, unless one of them already sent the client its first byte (that
        attempt, then: its read timer was met; the restarted stream is the same wait)."""
        fd = self.gw.arec.first_delivered
        now = self.env.now
        while aid in self.forward and not fd[aid] <= now:
            aid = self.forward[aid]
        return aid

    # -- a failed attempt ---------------------------------------------------------------------
    def _abandoned(self, aid: int) -> bool:
        """Attempt ``aid``'s client left before it succeeded or failed (a breaker probe
        that will never resolve)."""
        return int(self.gw.a_out[aid]) not in (C.OPEN, C.COMPLETED, C.FAILED)

    def _failed(self, aid: int, slot: int) -> None:
        """Attempt ``aid`` on ``slot`` failed now: the breaker counts it; retry or lose."""
        gw, env = self.gw, self.env
        now = env.now
        if gw.a_out[aid] == C.FAILED:
            return       # (refused, then caught in a new failure before it learned so)
        gw.seqs.pop(aid, None)
        rid = int(gw.a_rid[aid])
        self.lost_s[rid] += now - self.routed_t.pop(aid, now)
        if self.breakers is not None:
            self.breakers.failure(slot, now)
        if gw.a_out[aid] != C.OPEN or gw.outcome[rid] != UNFINISHED:
            return       # its client had already left: its own outcome stands
        gw.a_out[aid] = C.FAILED
        gw.a_end[aid] = now
        if self.cfg.in_flight == "retry" and self.fault_retries[rid] < self.cfg.max_retries:
            self.fault_retries[rid] += 1
            self.tally["retried"] += 1
            self.avoid[rid] = (slot, self.outage[slot])
            gw.reach(self._retry(aid, rid, now))
            return
        self.tally["lost"] += 1
        t = now + gw.net.one_way
        gw.pools.release(int(gw.client_ids[rid]), t, bool(gw.a_pooled[aid]))
        gw.a_end[aid] = t
        gw._resolve(rid, FAILED)

    def _retry(self, aid: int, rid: int, now: float) -> SimSeq:
        """A new attempt of request ``rid`` replacing ``aid``, entering the gateway now."""
        gw = self.gw
        wl = gw.wl
        aid2 = gw.next_aid
        gw.next_aid += 1
        p, o = int(wl.prompt_tokens[rid]), int(wl.output_tokens[rid])
        seq = SimSeq(aid2, 0.0, p, o, int(wl.priority[rid]), request_blocks(p, o, self.bs),
                     int(gw.client_ids[rid]), bool(gw.a_pooled[aid]))
        if gw.keys_of is not None:
            seq.keys = gw.keys_of(rid)
        gw.arec.arrival[aid2] = now
        gw.a_rid[aid2] = rid
        gw.a_pooled[aid2] = gw.a_pooled[aid]
        gw.cur[rid] = aid2
        gw.last_sent[rid] = aid2
        self.forward[aid] = aid2
        return seq

    # -- what the run reports ------------------------------------------------------------------
    def columns(self) -> dict:
        """Per-request columns: gateway retries after faults, and the time lost to them
        (module doc; an attempt still held when the run ended counts until its client
        left, one never left counts nothing)."""
        for aid in [a for a in self.held_since if self.gw.a_out[a] != C.OPEN]:
            self._held_until_left(aid)
        return {"fault_retries": self.fault_retries.copy(), "fault_lost_s": self.lost_s.copy()}

    def meta(self, end: float) -> dict:
        """``summary.json``'s ``faults`` raw parts (``report.faults`` adds the phases)."""
        n = len(self.down)
        iv = down_intervals(self.timeline, n, end)
        down_s = [sum(b - a for a, b in x) for x in iv]
        out = {**self.tally, "in_flight": self.cfg.in_flight, "detect_s": self.cfg.detect_s,
               "down_s": down_s,
               "availability": [1.0 - d / end if end > 0 else 1.0 for d in down_s],
               "timeline": [{"time_s": t, "replica": s, "event": e}
                            for t, s, e in self.timeline]}
        if self.breakers is not None:
            out["breaker_opens"] = self.breakers.opens
        return out


def _stop(rep) -> None:
    """Stop a failed replica: its engine loop never resumes (its SimPy process is
    detached from the event it waits on) and it holds nothing any more, so nothing
    it held finishes, is delivered or counts as work."""
    proc = rep.process
    target = getattr(proc, "_target", None)
    if target is not None and target.callbacks is not None and proc._resume in target.callbacks:
        target.callbacks.remove(proc._resume)
    rep.waiting = rep.policy.new_queue()
    rep.decoding, rep.prefilling, rep._inbox, rep._cancels = [], [], [], []
    rep.swapped.clear()
    rep.by_id = {}
    rep._wakeup = None
    rep._in_epoch = False
    # Its time series (shared by the slot's next replica) shows it empty while down.
    for col, v in zip(rep._series, (float(rep.env.now), 0, 0, 0, 0, 0)):
        col.append(v)
