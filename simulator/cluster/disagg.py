"""Disaggregated prefill and decode (DistServe, Zhong et al. OSDI 2024; Splitwise, Patel
et al. ISCA 2024): separate pools of prefill and decode replicas (``cluster.pools[].role``)
with a KV link between them (``cluster.kv_transfer``).

A request's way: the gateway routes it among the prefill replicas (the cluster's
router); there it is prefilled, whole or in chunks as the engine's policy does, and
emits its first token (TTFT ends at the prefill replica, as in DistServe). The cluster's
router (its own instance) then picks a decode replica among those whose cache can hold
it; the request waits there to be taken in (``decode_queue_s``: a batch slot and its KV
blocks), and only then is its KV sent (pulled into the reserved blocks): ``prompt tokens
x KV bytes per token`` (the prefill pool's model and KV format,
``kv_bytes_per_token``), taking ``latency + bytes / bandwidth``. Each prefill replica has
one outgoing link and its transfers queue on it first come first served: a transfer
occupies the link for ``bytes / bandwidth`` and lands ``latency`` after that
(``kv_transfer_s`` counts from the decode side's admission: the wait for the link, the
bytes, the latency). The prefill replica holds the request's blocks until it lands, so a
decode pool that cannot keep up fills the prefill pool's memory (DistServe's
backpressure). It then decodes its remaining tokens on the decode replica, which never
runs a prefill chunk for it (replica side: ``loops.simpy.handoff``).

The breakdown still adds up: the hand-off, the wait to be taken in and the transfer lie
between the first token and the last, in ``T_decode``, and are reported apart
(``requests.csv`` ``decode_queue_s``, ``kv_transfer_s``, ``kv_bytes``,
``decode_replica``; ``summary.json`` ``disaggregation``). A request of one output token
ends at the prefill replica. Refused (413) when a prefill replica or a decode replica
cannot hold its whole length (conservative for a prefill replica, which holds only the
prompt). SimPy traffic model only (``loops.traffic``); the compiled loop does not model
pools and ``loop: auto`` says so.
"""
from __future__ import annotations

import math

import numpy as np

from simulator.deploy.replica import kv_bytes_per_token
from simulator.report.percentile import pct_ms


class Disaggregation:
    """The coordinator of a disaggregated run (see module doc): routes hand-offs to
    decode replicas, times each transfer on its prefill replica's link and records
    it, per attempt (``n`` of them). ``pools``: the run's ``cluster.pools.Pool`` list;
    ``router``: a router over the decode replicas; ``link``: ``KVTransferConfig``."""

    def __init__(self, env, scenario, pools, router, link, n: int) -> None:
        from simulator.cluster.pools import pool_scenario
        self.env, self.router = env, router
        self.bps = link.gbs * 1e9
        self.latency = link.latency_us * 1e-6
        self.link = link
        self.fleet = None
        self.prefill = [s for p in pools if p.role == "prefill" for s in p.slots]
        self.decode = [s for p in pools if p.role == "decode" for s in p.slots]
        by_name = {p.name: p for p in scenario.cluster.pools}
        bpt = {p.name: kv_bytes_per_token(pool_scenario(scenario, by_name[p.name]))
               for p in pools}
        self.bpt = {s: bpt[p.name] for p in pools for s in p.slots}
        self.free_at = {s: 0.0 for s in self.prefill}
        self.src: dict = {}
        self.handed = np.full(n, np.nan)      # first token, hand-off
        self.taken = np.full(n, np.nan)       # taken in by the decode replica
        self.sent = np.full(n, np.nan)        # the link started sending
        self.landed = np.full(n, np.nan)
        self.nbytes = np.zeros(n)
        self.d_slot = np.full(n, -1, dtype=np.int64)

    def attach(self, fleet) -> None:
        self.fleet = fleet

    def _decoders(self, seq) -> list:
        """The decode replicas that can take ``seq`` (ready, their cache can hold it)."""
        f = self.fleet
        return [f.replicas[i] for i in f.holding(self.decode, seq)]

    def entry(self, ready: list, seq) -> list:
        """The ready prefill slots among ``ready`` that can hold ``seq``; none when no
        decode replica can (the gateway then refuses it as too large)."""
        ok = self.fleet.holding([i for i in ready if i in self.free_at], seq)
        return ok if ok and self._decoders(seq) else []

    # -- a request's way --------------------------------------------------------------------
    def hand_off(self, prep, seq, t: float) -> None:
        """Prefill replica ``prep`` emitted the first token of ``seq`` at ``t``."""
        aid = seq.rid
        self.handed[aid] = t
        self.src[aid] = prep
        cands = self._decoders(seq)
        drep = cands[self.router.pick(cands, seq)]
        self.d_slot[aid] = drep.index
        drep.receive(seq)

    def admitted(self, drep, seq, now: float) -> None:
        """Decode replica ``drep`` took ``seq`` in now: its KV is sent over the prefill
        replica's link, behind the transfers already on it."""
        aid = seq.rid
        prep = self.src[aid]
        slot = prep.index
        nbytes = seq.prompt_tokens * self.bpt[slot]
        start = max(now, self.free_at[slot])
        self.free_at[slot] = start + nbytes / self.bps
        done = self.free_at[slot] + self.latency
        self.taken[aid], self.sent[aid], self.nbytes[aid] = now, start, nbytes
        self.env.timeout(done - now).callbacks.append(
            lambda _e: self._land(prep, drep, seq))

    def _land(self, prep, drep, seq) -> None:
        aid = seq.rid
        self.landed[aid] = self.env.now
        del self.src[aid]
        prep.release_sent(seq)
        drep.land(seq)

    # -- what the run reports -----------------------------------------------------------------
    def columns(self, final: np.ndarray) -> dict:
        """Per request (its final attempt ``final``): ``decode_queue_s``, ``kv_transfer_s``,
        ``kv_bytes``, ``decode_replica`` (NaN / 0 / -1 where it never got that far)."""
        return {"decode_queue_s": (self.taken - self.handed)[final],
                "kv_transfer_s": (self.landed - self.taken)[final],
                "kv_bytes": self.nbytes[final], "decode_replica": self.d_slot[final]}

    def summary(self) -> dict:
        """``summary.json`` ``disaggregation``: the link, and transfers (ms percentiles,
        GB moved), the time they waited for the link, and the decode admission wait."""
        done = ~np.isnan(self.landed)
        xfer = (self.landed - self.taken)[done]
        wait = (self.sent - self.taken)[done]
        queue = (self.taken - self.handed)[~np.isnan(self.taken)]

        def ms(x: np.ndarray) -> dict:
            if not len(x):
                # No such wait: NaN, as every other empty statistic of the summary.
                return dict.fromkeys(("mean", "median", "p99", "max"), math.nan)
            return {"mean": float(x.mean()) * 1e3, "median": float(np.median(x)) * 1e3,
                    "p99": pct_ms(x, 99), "max": float(x.max()) * 1e3}
        return {"kv_link_gbs": self.link.gbs, "kv_link_latency_us": self.link.latency_us,
                "prefill_replicas": len(self.prefill), "decode_replicas": len(self.decode),
                "handed_off": int((~np.isnan(self.handed)).sum()),
                "transfers": int(done.sum()), "kv_gb": float(self.nbytes[done].sum()) / 1e9,
                "kv_transfer_ms": ms(xfer), "kv_link_wait_ms": ms(wait),
                "decode_queue_ms": ms(queue)}
