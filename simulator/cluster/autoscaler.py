"""A fleet of replicas that changes over time, and the autoscaler that changes it.

``Fleet`` holds up to ``max_replicas`` slots, each ``off``, ``provisioning`` (the GPU is
held and billed while the model loads and warms up), ``ready`` (the router sends it
requests) or ``draining`` (no new requests; the ones it holds finish; then ``off``).
Without an autoscaler every slot is ready for the whole run.

``Autoscaler`` is the Kubernetes Horizontal Pod Autoscaler's rule (kubernetes.io,
"Horizontal Pod Autoscaling", algorithm details): every ``interval_s`` it computes
``desired = ceil(ready x metric / target)``, does nothing while ``metric / target`` is
within ``tolerance`` of 1, and clamps to ``[min_replicas, max_replicas]``. The metric is
averaged over the last ``window_s`` of samples taken every ``sample_s``: ``queue``
(requests waiting, ready and draining replicas together, per ready replica), ``kv``
(blocks reserved / capacity, mean over ready replicas) or ``p99_ttft`` (ms: P99 of the
TTFTs of first tokens delivered in the window together with the ages of requests still
waiting for theirs, so a stalled queue counts before its first tokens come out).

Scaling up starts ``desired - ready - provisioning`` replicas: each is ready exactly
``model_load_s + warmup_s`` after the decision, with an empty KV cache. Scaling down
waits ``scale_down_cooldown_s`` after the last scaling (up or down) and for nothing to
be provisioning, then goes to the highest count desired over that window (the HPA's
scale-down stabilisation), draining the ready replicas with the fewest outstanding
tokens. A draining replica is removed (``off``) once it holds no request; nothing it
held is dropped.

The fleet's record (``events``: time and the count in each state) gives replicas
over time, and GPU-hours = the integral of (provisioning + ready + draining) x
``gpus_per_replica`` over the run.

A mixed fleet (``cluster.pools``): the autoscaler scales one pool (its slots are the
fleet's ``scalable`` ones; the other pools' replicas are ready throughout). The metric
is the whole fleet's (the ``kv`` one as the mean of each ready replica's own
reserved fraction), ``desired`` is the fleet's size, and the scaled pool is set to
``desired`` less the other pools' ready replicas, within its ``[min_replicas,
max_replicas]``. ``Fleet.held_s`` gives each slot's held seconds, hence GPU-hours
per pool.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from simulator.report.percentile import pct_ms

OFF, PROVISIONING, READY, DRAINING = "off", "provisioning", "ready", "draining"


def has_work(rep) -> bool:
    """Whether a replica holds any request (waiting, running, swapped, being cancelled)."""
    return bool(rep.n_queued() or rep.decoding or rep.prefilling or rep.swapped
                or rep._cancels)


class Fleet:
    """Replica slots and their states (see module doc). ``make_replica(slot)`` builds a
    fresh replica for a slot (at the start, and whenever a slot comes up again).
    ``ready_slots``: the slots ready at the start (default the first ``n_ready``);
    ``scalable``: the slots the autoscaler may start or drain (default all)."""

    def __init__(self, env, make_replica, n_ready: int, n_slots: int,
                 ready_slots=None, scalable=None) -> None:
        self.env = env
        self.make_replica = make_replica
        start = set(range(n_ready) if ready_slots is None else ready_slots)
        self.replicas = [make_replica(i) if i in start else None for i in range(n_slots)]
        self.built = [r for r in self.replicas if r is not None]
        self.state = [READY if i in start else OFF for i in range(n_slots)]
        self.ready = sorted(start)
        self.scalable = list(range(n_slots)) if scalable is None else list(scalable)
        self.events: list[tuple[float, int, int, int]] = [(0.0, len(start), 0, 0)]
        self.slot_log: list[tuple[float, int, bool]] = [(0.0, i, True) for i in sorted(start)]
        self.scale_ups = 0
        self.scale_downs = 0
        self.mixed = False    # pools of different replicas (``cluster.pools``)

    def holding(self, slots, seq) -> list:
        """The ready slots among ``slots`` whose replica can hold ``seq`` (its KV cache is
        large enough, ``Replica.rejects``): where a fleet of pools may route it."""
        return [i for i in slots if self.state[i] == READY and not self.replicas[i].rejects(seq)]

    def count(self, state: str) -> int:
        return sum(1 for s in self.state if s == state)

    def _record(self) -> None:
        ev = (float(self.env.now), self.count(READY), self.count(PROVISIONING),
              self.count(DRAINING))
        if self.events and self.events[-1][0] == ev[0]:
            self.events[-1] = ev
        else:
            self.events.append(ev)

    def _set(self, slot: int, state: str) -> None:
        held = self.state[slot] != OFF
        self.state[slot] = state
        if held != (state != OFF):
            self.slot_log.append((float(self.env.now), slot, state != OFF))
        self.ready = [i for i, s in enumerate(self.state) if s == READY]
        self._record()

    def provision(self, delay: float) -> int:
        """Start a replica in the lowest free slot; it is ready ``delay`` from now."""
        slot = next(i for i in self.scalable if self.state[i] == OFF)
        self._set(slot, PROVISIONING)
        self.scale_ups += 1
        self.env.timeout(delay).callbacks.append(lambda _e, s=slot: self._up(s))
        return slot

    def _up(self, slot: int) -> None:
        rep = self.make_replica(slot)
        self.replicas[slot] = rep
        self.built.append(rep)
        self._set(slot, READY)

    def drain(self, slot: int) -> None:
        """Stop routing to ``slot``; it goes ``off`` once it holds nothing."""
        self._set(slot, DRAINING)
        self.scale_downs += 1
        self.check_drained(slot)

    def check_drained(self, slot: int) -> None:
        if self.state[slot] == DRAINING and not has_work(self.replicas[slot]):
            self._set(slot, OFF)

    def gpu_hours(self, end: float, gpus_per_replica: int) -> float:
        """GPU-hours from 0 to ``end``: every slot provisioning, ready or draining."""
        ev = self.events
        total = 0.0
        for (t, r, p, d), nxt in zip(ev, ev[1:] + [(end, 0, 0, 0)]):
            total += (r + p + d) * max(0.0, min(nxt[0], end) - t)
        return total * gpus_per_replica / 3600.0

    def held_s(self, end: float) -> np.ndarray:
        """Seconds each slot was held (provisioning, ready or draining) from 0 to ``end``."""
        out = np.zeros(len(self.state))
        since: dict[int, float] = {}
        for t, slot, on in self.slot_log:
            if on:
                since[slot] = t
            elif slot in since:
                out[slot] += max(0.0, min(t, end) - since.pop(slot))
        for slot, t in since.items():
            out[slot] += max(0.0, end - t)
        return out

    def timeline(self) -> np.ndarray:
        """``(time, ready, provisioning, draining)`` rows, one per change."""
        return np.array(self.events, dtype=np.float64).reshape(-1, 4)


class Autoscaler:
    """The HPA rule over a ``Fleet`` (see module doc); ``capacity_blocks``: KV blocks per
    replica (None: each replica's own, a mixed fleet). ``ttft_values(now, window)``:
    the gateway's TTFT observations (s) for the ``p99_ttft`` metric. The process stops
    once ``done()`` is true (every request resolved)."""

    def __init__(self, env, cfg, fleet: Fleet, capacity_blocks: int, ttft_values, done) -> None:
        self.env, self.cfg, self.fleet = env, cfg, fleet
        self.capacity = capacity_blocks
        self.ttft_values = ttft_values
        self.done = done
        self.samples: deque = deque()
        self.decisions: list[tuple[float, float, int]] = []   # (time, metric, desired)
        self.last_scale = 0.0
        self._scalable = set(fleet.scalable)
        env.process(self._run())

    def _sample(self, now: float) -> None:
        f = self.fleet
        live = [f.replicas[i] for i, s in enumerate(f.state) if s in (READY, DRAINING)]
        ready = [f.replicas[i] for i in f.ready]
        if self.cfg.metric == "queue":
            v = sum(r.n_queued() + len(r.swapped) for r in live) / max(1, len(ready))
        elif self.cfg.metric == "kv" and self.capacity is None:
            # A mixed fleet: each replica's own capacity.
            v = (sum(r.kv.manager.num_used / r.capacity for r in ready) / len(ready)
                 if ready else 0.0)
        elif self.cfg.metric == "kv":
            v = (sum(r.kv.manager.num_used for r in ready) / (self.capacity * len(ready))
                 if ready else 0.0)
        else:
            v = math.nan   # read over the window at decision time
        self.samples.append((now, v))
        while self.samples and self.samples[0][0] <= now - self.cfg.window_s:
            self.samples.popleft()
        for slot, s in enumerate(f.state):
            if s == DRAINING:
                f.check_drained(slot)

    def metric(self, now: float) -> float:
        """The metric over the last window (see module doc)."""
        if self.cfg.metric == "p99_ttft":
            vals = self.ttft_values(now, self.cfg.window_s)
            return pct_ms(vals, 99, empty=0.0)
        vals = [v for _, v in self.samples]
        return float(np.mean(vals)) if vals else 0.0

    def _decide(self, now: float) -> None:
        cfg, f = self.cfg, self.fleet
        m = self.metric(now)
        mine = [i for i in f.ready if i in self._scalable]
        fixed = len(f.ready) - len(mine)      # other pools' (0 without pools)
        ready = len(mine)
        prov = f.count(PROVISIONING)
        ratio = m / cfg.target
        total = len(f.ready)
        desired = total if abs(ratio - 1.0) <= cfg.tolerance else math.ceil(total * ratio)
        desired = min(cfg.max_replicas, max(cfg.min_replicas, desired - fixed))
        self.decisions.append((now, m, desired))
        # A draining slot still holds its GPUs until it empties: only slots that are off
        # can be started (the pool's slots are its max_replicas).
        free = sum(1 for i in self._scalable if f.state[i] == OFF)
        if desired > ready + prov and free:
            for _ in range(min(desired - ready - prov, free)):
                f.provision(cfg.scale_up_delay_s)
            self.last_scale = now
        elif (desired < ready and prov == 0
              and now - self.last_scale >= cfg.scale_down_cooldown_s):
            # HPA's scale-down stabilisation: the highest count wanted over the window.
            lo = now - cfg.scale_down_cooldown_s
            keep = max(d for t, _m, d in self.decisions if t > lo)
            order = sorted(mine, key=lambda i: (f.replicas[i].outstanding_tokens, -i))
            for slot in order[:max(0, ready - keep)]:
                f.drain(slot)
            if keep < ready:
                self.last_scale = now

    def _run(self):
        cfg = self.cfg
        env = self.env
        step = cfg.sample_s
        next_decision = cfg.interval_s
        while not self.done():
            # Samples and decisions on fixed grids (k x sample_s, k x interval_s).
            t_next = min((math.floor(env.now / step + 1e-9) + 1) * step, next_decision)
            yield env.timeout(t_next - env.now)
            now = env.now
            self._sample(now)
            if now >= next_decision - 1e-9:
                self._decide(now)
                next_decision += cfg.interval_s
