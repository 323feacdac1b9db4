"""The serving gateway of a run with traffic control: clients' attempts, admission,
routing over a fleet that changes, timeouts, cancellations and retries.

Each request of the workload is one logical request (one row of the run's table);
each time its client sends it is an *attempt*. Attempts are what the replicas see:
each is its own ``SimSeq`` with its own id (a request's first attempt has the request's
id; retries take ids from ``n`` on), recorded in an attempt recorder, and folded into
the request's row at the end (``fold``): the final attempt's timestamps, the sum of
every attempt's KV work, the attempt count, and how the request ended.

An attempt's way, as in the plain model: the client takes a connection (its keep-alive
pool) and sends; after ``T_net`` it reaches the gateway, which routes it
(``cluster.routing``: what can never fit a KV cache is refused there, 413, never
retried; faults, breakers, degradation and clients acting on the wait estimate act
there) and asks admission control; admitted, it joins the replica's queue (a shed
victim is cancelled and answered 503). A refusal
reaches the client one way later (429/503 with Retry-After); the connection is then
free again. Client timers (``wire.clients``): connect, read (the response's first
byte) and the deadline; a client that gives up closes its connection, and the server
cancels the attempt one way later (dropped from the queue, or its KV freed at the next
step boundary); a request that reaches the gateway after its client gave up is
dropped there. After a refusal or a timeout the client may retry after a backoff.

With nothing of this configured (no admission, patient clients, a fixed fleet) the
events are exactly the plain model's: the same results, bit for bit (tested).
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from simulator.cluster.admission import SHED, TOO_LARGE, Decision
from simulator.cluster.autoscaler import DRAINING
from simulator.cluster.outcomes import (  # noqa: F401  (re-exported: the codes' old home)
    CANCELLED, DONE, FAILED, OUTCOMES, REJECTED, TIMED_OUT, UNFINISHED)
from simulator.cluster.routing import route
from simulator.loops.simpy.replica import SimSeq
from simulator.model.kv.blocks import request_blocks
from simulator.wire import clients as C
from simulator.wire.network import net_time


class Gateway:
    """See module doc. ``fleet``: the replicas (``cluster.autoscaler.Fleet``);
    ``admission``: ``cluster.admission.Admission`` or None; ``clients``:
    ``wire.clients.Clients``; ``estimator``: ``cluster.admission.WaitEstimator``."""

    def __init__(self, env, workload, arec, fleet, router, pools, net, clients, admission,
                 estimator, keys_of, block_size: int, client_ids,
                 track_ttft: bool = False, entry=None, faults=None, degrade=None) -> None:
        self.env, self.wl, self.arec, self.fleet = env, workload, arec, fleet
        self.router, self.pools, self.net = router, pools, net
        self.clients, self.admission, self.estimator = clients, admission, estimator
        self.keys_of, self.bs, self.client_ids = keys_of, block_size, client_ids
        # ``entry(ready, seq)``: the ready slots a request may enter by, that can hold it
        # (disaggregated: the prefill replicas; none: it fits nowhere); None: all ready.
        self.entry = entry
        self.faults = faults     # replicas that fail (``cluster.faults``) or None
        self.degrade = degrade   # degradation under overload (``cluster.degrade``) or None
        n = len(workload)
        self.n = n
        cap = arec.n
        self.attempts = np.zeros(n, dtype=np.int32)
        self.timeout_retries = np.zeros(n, dtype=np.int32)
        self.cur = np.full(n, -1, dtype=np.int64)       # the request's latest attempt
        self.last_sent = np.full(n, -1, dtype=np.int64)  # ... that was sent
        self.outcome = np.full(n, UNFINISHED, dtype=np.int8)
        self.a_rid = np.full(cap, -1, dtype=np.int64)
        self.a_end = np.full(cap, np.nan)                # when the client learned the outcome
        self.a_out = np.full(cap, C.OPEN, dtype=np.int8)
        self.a_reason = np.full(cap, -1, dtype=np.int8)
        self.a_admit = np.full(cap, np.nan)              # admitted into a queue at
        self.a_est = np.full(cap, np.nan)                # published wait estimate (P50, P99)
        self.a_est99 = np.full(cap, np.nan)
        self.a_pooled = np.zeros(cap, dtype=bool)
        self.a_reached = np.zeros(cap, dtype=bool)
        self.a_slot = np.full(cap, -1, dtype=np.int64)
        self.seqs: dict[int, SimSeq] = {}                # attempts in a queue or running
        self.leaving: set[int] = set()                   # attempts being cancelled or shed
        self.gone: list[SimSeq] = []                     # attempts dropped after work began
        self.next_aid = n
        self.resolved = 0
        self.on_all_resolved = None                      # called once every request ended
        self._timers: list = []
        self._timer_wake = None
        self._timer_running = False
        self.track_ttft = track_ttft
        self._first: list = []                           # admitted, first byte not yet seen
        self._ttft: list = []                            # (first byte time, ttft)

    # -- a request's attempts --------------------------------------------------------
    def arrivals(self):
        """The clients' first attempts, each at its request's arrival time."""
        env = self.env
        arrival = self.wl.arrival_s
        t = 0.0
        for rid in range(self.n):
            a = arrival[rid]
            if a > t:
                yield env.timeout(a - t)
                t = a
            self.clients.first_attempt(env.now)
            self.send(rid, rid)

    def send(self, rid: int, aid: int) -> None:
        """Attempt ``aid`` of request ``rid`` leaves its client now."""
        if self.outcome[rid] != UNFINISHED:
            return      # its deadline passed while it waited to retry
        env, net, wl = self.env, self.net, self.wl
        now = env.now
        self.last_sent[rid] = aid
        c = int(self.client_ids[rid])
        is_new, pooled = self.pools.acquire(c, now)
        self.arec.new_connection[aid] = is_new
        self.arec.arrival[aid] = now
        self.a_rid[aid] = rid
        self.a_pooled[aid] = pooled
        self.attempts[rid] += 1
        self.cur[rid] = aid
        p, o = int(wl.prompt_tokens[rid]), int(wl.output_tokens[rid])
        seq = SimSeq(aid, 0.0, p, o, int(wl.priority[rid]), request_blocks(p, o, self.bs),
                     c, pooled)
        if self.keys_of is not None:
            seq.keys = self.keys_of(rid)
        cl = self.clients
        if is_new and net.handshake > cl.connect_timeout:
            # The connection is never set up: the client gives up at its connect timeout.
            self._timer(now + cl.connect_timeout, aid, C.CONNECT_TIMEOUT)
            return
        t_net = net_time(net.send_time(p), net.handshake, is_new, 0.0)
        env.timeout(t_net).callbacks.append(lambda _e, s=seq: self.reach(s))
        if math.isfinite(cl.read_timeout):
            sent = now + t_net - net.one_way - net.gateway - net.frontend.request_s(p)
            self._timer(sent + cl.read_timeout, aid, C.READ_TIMEOUT)
        if aid == rid and math.isfinite(cl.deadline):
            self._timer(now + cl.deadline, rid, C.DEADLINE)

    def reach(self, seq: SimSeq) -> None:
        """Attempt ``seq`` reaches the gateway now (see module doc)."""
        env, aid = self.env, seq.rid
        now = env.now
        if self.a_out[aid] != C.OPEN:
            return          # its client gave up while it was on its way: dropped here
        self.a_reached[aid] = True
        seq.enqueued = now
        self.arec.enqueued[aid] = now
        routed = route(self, seq, now)     # (``cluster.routing``)
        if routed is None:
            return
        slot, rep, waiting, est, est99 = routed
        self.a_est[aid], self.a_est99[aid] = est, est99
        dec = (self.admission.decide(seq, now, waiting, est) if self.admission is not None
               else Decision())
        if dec.reason is not None:
            self._refuse(aid, dec, now)
            return
        if dec.victim is not None:
            self._shed(dec.victim, slot, now, est)
        self.a_admit[aid] = now
        self.a_slot[aid] = slot
        self.arec.replica[aid] = slot
        self.seqs[aid] = seq
        if self.track_ttft:
            self._first.append(aid)
        rep.enqueue(seq)

    def _shed(self, victim: SimSeq, slot: int, now: float, est: float) -> None:
        vid = victim.rid
        self.leaving.add(vid)
        self.seqs.pop(vid, None)
        self.fleet.replicas[slot].cancel(vid)
        after = (self.admission.cfg.retry_after_s if self.admission.cfg.retry_after_s
                 is not None else est)
        self._refuse(vid, Decision(SHED, after), now)

    def _refuse(self, aid: int, dec: Decision, now: float) -> None:
        """The gateway answers ``aid`` with a refusal now; the client hears it one way
        later, its connection then free again, and may retry."""
        self.a_out[aid] = C.REFUSED
        self.a_reason[aid] = dec.reason
        t = now + self.net.one_way
        rid = int(self.a_rid[aid])
        self.pools.release(int(self.client_ids[rid]), t, bool(self.a_pooled[aid]))
        self.a_end[aid] = t
        self.env.timeout(self.net.one_way).callbacks.append(
            lambda _e: self._after_failure(aid, C.failure_of(dec.reason), dec.retry_after))

    # -- the client's side -------------------------------------------------------------
    def _after_failure(self, aid: int, failure: str, retry_after: float) -> None:
        """Attempt ``aid`` failed and its client knows it now: retry, or give up."""
        rid = int(self.a_rid[aid])
        if self.outcome[rid] != UNFINISHED or self.cur[rid] != aid:
            return
        now = self.env.now
        d = self.clients.retry_delay(int(self.attempts[rid]), failure, retry_after, now,
                                     float(self.wl.arrival_s[rid]))
        if d is None:
            self._resolve(rid, REJECTED if self.a_out[aid] == C.REFUSED else TIMED_OUT)
            return
        if failure == "timeout":
            self.timeout_retries[rid] += 1
        aid2 = self.next_aid
        self.next_aid += 1
        self.cur[rid] = aid2
        self.env.timeout(d).callbacks.append(lambda _e: self.send(rid, aid2))

    def _give_up(self, aid: int, kind: int) -> None:
        """The client of attempt ``aid`` stops waiting now (a timeout or its deadline)."""
        now = self.env.now
        self.a_out[aid] = kind
        self.a_end[aid] = now
        rid = int(self.a_rid[aid])
        if self.a_pooled[aid]:
            # It closes its connection: the pool loses it.
            self.pools.discard(int(self.client_ids[rid]))
        if aid in self.seqs:
            self.env.timeout(self.net.one_way).callbacks.append(lambda _e: self._cancel(aid))
        if kind == C.DEADLINE:
            self._resolve(rid, TIMED_OUT)
        else:
            self._after_failure(aid, "timeout", 0.0)

    def _cancel(self, aid: int) -> None:
        """The server learns the client of ``aid`` left: cancel it where it is."""
        seq = self.seqs.pop(aid, None)
        if seq is None:
            return
        slot = int(self.a_slot[aid])
        if self.fleet.replicas[slot].cancel(aid):
            self.leaving.add(aid)
            self.gone.append(seq)

    def finished(self, seq: SimSeq, delivered_at: float) -> None:
        """A replica finished attempt ``seq``; its last byte reaches the client at
        ``delivered_at`` (``Replica.on_finish``)."""
        aid = seq.rid
        slot = int(self.a_slot[aid])
        self.seqs.pop(aid, None)
        self.estimator.completed(slot, self.env.now)
        if self.faults is not None:
            self.faults.succeeded(slot, aid)
        if self.fleet.state[slot] == DRAINING:
            self.fleet.check_drained(slot)
        if self.a_out[aid] != C.OPEN:
            self.gone.append(seq)    # its client had left: the work was for nobody
            return
        rid = int(self.a_rid[aid])
        deadline = float(self.wl.arrival_s[rid]) + self.clients.deadline
        if delivered_at > deadline:
            return    # the client gives up at its deadline, before the last byte (a timer)
        self.a_out[aid] = C.COMPLETED
        self.a_end[aid] = delivered_at
        self.pools.release(seq.client, delivered_at, seq.pooled)
        self._resolve(rid, DONE, delivered_at)

    def _resolve(self, rid: int, outcome: int, at: float | None = None) -> None:
        self.outcome[rid] = outcome
        self.resolved += 1
        if self.resolved == self.n:
            if self._timer_wake is not None and not self._timer_wake.triggered:
                self._timer_wake.succeed()
            if self.on_all_resolved is not None:
                self.on_all_resolved()

    @property
    def all_resolved(self) -> bool:
        return self.resolved >= self.n

    # -- timers ---------------------------------------------------------------------------
    def _timer(self, at: float, key: int, kind: int) -> None:
        """Fire ``kind`` for attempt ``key`` (for a deadline: request ``key``) at ``at``."""
        heapq.heappush(self._timers, (at, kind, key))
        if not self._timer_running:
            self._timer_running = True
            self.env.process(self._timer_loop())
        elif self._timers[0] == (at, kind, key) and self._timer_wake is not None \
                and not self._timer_wake.triggered:
            self._timer_wake.succeed()    # earlier than what the loop sleeps until

    def _timer_loop(self):
        """One process for every client timer: it sleeps until the earliest, woken when
        an earlier one is set, and ends when every request has ended."""
        env = self.env
        heap = self._timers
        while heap and not self.all_resolved:
            at = heap[0][0]
            if at > env.now:
                self._timer_wake = env.event()
                yield env.any_of([env.timeout(at - env.now), self._timer_wake])
                self._timer_wake = None
            while heap and heap[0][0] <= env.now and not self.all_resolved:
                _at, kind, key = heapq.heappop(heap)
                self._fire(kind, key)
        self._timer_running = False

    def _fire(self, kind: int, key: int) -> None:
        now = self.env.now
        if kind == C.DEADLINE:
            rid = key
            if self.outcome[rid] != UNFINISHED:
                return
            aid = int(self.cur[rid])
            if aid >= 0 and self.a_rid[aid] == rid and self.a_out[aid] == C.OPEN:
                self._give_up(aid, C.DEADLINE)
            else:
                self._resolve(rid, TIMED_OUT)   # between attempts: it stops retrying
            return
        aid = key if self.faults is None else self.faults.follow(key)
        if self.a_out[aid] != C.OPEN:
            return
        if kind == C.READ_TIMEOUT and self.arec.first_delivered[aid] <= now:
            return      # its first byte arrived in time
        self._give_up(aid, kind)

    # -- what the autoscaler reads -------------------------------------------------------
    def ttft_values(self, now: float, window: float) -> list:
        """TTFTs (s, from the request's first send) of first bytes delivered in the last
        ``window``, plus the age of every admitted attempt still waiting for one."""
        fd = self.arec.first_delivered
        keep, ages = [], []
        for aid in self._first:
            rid = int(self.a_rid[aid])
            if fd[aid] <= now:
                self._ttft.append((float(fd[aid]), float(fd[aid] - self.wl.arrival_s[rid])))
            elif self.a_out[aid] == C.OPEN:
                keep.append(aid)
                ages.append(now - float(self.wl.arrival_s[rid]))
        self._first = keep
        self._ttft = [(t, v) for t, v in self._ttft if t > now - window]
        return [v for _, v in self._ttft] + ages

    # -- the run's rows ---------------------------------------------------------------------
    def fold(self, rec) -> None:
        """Fill the run's per-request recorder ``rec`` from the attempts (module doc): the
        last attempt's timestamps (a request that did not complete delivered nothing:
        no last byte, and a first byte only if it came before its client left), every
        attempt's KV work summed, and the traffic columns."""
        arec, m = self.arec, self.next_aid
        f = self.final_attempts()
        for name in ("enqueued", "scheduled", "first_token", "last_token", "first_delivered",
                     "last_delivered"):
            getattr(rec, name)[:] = getattr(arec, name)[f]
        rec.replica[:] = arec.replica[f]
        rec.new_connection[:] = arec.new_connection[f]
        rec.generated[:] = arec.generated[f]
        sent = self.a_rid[:m] >= 0
        rids = self.a_rid[:m][sent]
        for name in ("cached_tokens", "preemptions", "recomputed_tokens", "swapped_bytes",
                     "preempted_s"):
            out = getattr(rec, name)
            out[:] = 0
            np.add.at(out, rids, getattr(arec, name)[:m][sent])
        done = self.outcome == DONE
        rec.last_delivered[~done] = np.nan
        left = ~done & ~np.isnan(self.a_end[f])
        late = left & ~(rec.first_delivered <= self.a_end[f])
        rec.first_delivered[late] = np.nan
        refused = self.outcome == REJECTED
        too_large = refused & (self.a_reason[f] == TOO_LARGE)
        rec.rejected[:] = too_large
        rec.refused[:] = refused & ~too_large
        rec.reject_reason[:] = np.where(refused, self.a_reason[f], -1)
        rec.timed_out[:] = self.outcome == TIMED_OUT
        rec.failed[:] = self.outcome == FAILED
        rec.attempts[:] = self.attempts
        rec.timeout_retries[:] = self.timeout_retries
        rec.retry_s[:] = arec.arrival[f] - rec.arrival
        rec.wait_estimate[:] = self.a_est[f]
        rec.wait_estimate_p99[:] = self.a_est99[f]
        rec.itl = arec.itl
        rec.series = arec.series
        rec.steps, rec.step_time_total = arec.steps, arec.step_time_total
        rec.swap_copy_s = arec.swap_copy_s

    def final_attempts(self) -> np.ndarray:
        """Each request's row comes from this attempt: its last one sent (its first when
        none was)."""
        return np.where(self.last_sent >= 0, self.last_sent, np.arange(self.n))

    def attempts_table(self) -> dict:
        """Every attempt sent: its request, whether it is the first, send time, outcome
        (``wire.clients``'s codes), refusal reason, when its client learned it, admitted."""
        m = self.next_aid
        sent = self.a_rid[:m] >= 0
        return {"rid": self.a_rid[:m][sent], "first": np.arange(m)[sent] < self.n,
                "sent": self.arec.arrival[:m][sent],
                "outcome": self.a_out[:m][sent], "reason": self.a_reason[:m][sent],
                "end": self.a_end[:m][sent], "admitted": self.a_admit[:m][sent]}

    def wasted_tokens(self) -> int:
        """Tokens computed for attempts whose client had gone (cancelled after their
        work began, or completed for nobody): prefill past the cached prefix, plus
        decode."""
        total = 0
        for s in self.gone:
            total += max(0, s.prefilled - int(self.arec.cached_tokens[s.rid])) + s.generated
        return total
