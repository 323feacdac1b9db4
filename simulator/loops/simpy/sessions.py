"""The closed loop of ``kind: sessions`` on the SimPy driver: each user sends a turn,
waits for its last byte, waits the turn's think or tool time, and sends the next
(``workload.sessions`` says what each user does; this module when).

The driver hands over ``send(rid)`` (the client sends request ``rid`` now: connection,
network, routing) and calls ``finished(rid, delivered_at)`` when a request's last byte
reaches its client and ``ended(rid, heard_at)`` when it was turned away (too large for
the KV cache): that session ends there, its later requests are never sent, and the
user goes on to its next session. Send times go to the recorder's ``arrival`` (NaN for
a request never sent); nothing else is drawn here, so a run is as deterministic as
the plan. With prefix caching the driver also asks each request's ``answer_keys``:
what its finished blocks are named by, so that the next turn hits on its answer.
"""
from __future__ import annotations

import numpy as np

from simulator.model.kv.prefixkeys import keys_from_hash_ids
from simulator.workload.sessions import SessionPlan


class SessionClients:
    """The users of a ``SessionPlan`` on a SimPy clock."""

    def __init__(self, env, plan: SessionPlan, rec, send, workload, block_size: int) -> None:
        self.env, self.plan, self.rec, self._send = env, plan, rec, send
        self.wl, self.bs = workload, block_size
        n_s = plan.n_sessions
        self.last_rid = plan.s_first + plan.s_requests - 1
        # Each user's sessions in order: the next session of the same user.
        self.next_session = np.full(n_s, -1, dtype=np.int64)
        idx = np.arange(n_s)
        later = idx + plan.users
        self.next_session[later < n_s] = later[later < n_s]
        self.aborted = np.zeros(n_s, dtype=bool)
        rec.arrival[:] = np.nan
        for s in range(min(plan.users, n_s)):
            self._start(s, float(env.now))

    def _at(self, t: float, rid: int) -> None:
        """Send ``rid`` at time ``t`` (>= now)."""
        self.env.timeout(max(t - self.env.now, 0.0)).callbacks.append(
            lambda _e, r=rid: self._go(r))

    def _go(self, rid: int) -> None:
        self.rec.arrival[rid] = self.env.now
        self._send(rid)

    def _start(self, s: int, after: float) -> None:
        self._at(after + float(self.plan.start_gap_s[s]), int(self.plan.s_first[s]))

    def _session_over(self, s: int, at: float) -> None:
        nxt = int(self.next_session[s])
        if nxt >= 0:
            self._start(nxt, at)

    def finished(self, rid: int, delivered_at: float) -> None:
        """Request ``rid``'s last byte reached its user at ``delivered_at``."""
        s = int(self.plan.session[rid])
        if rid < self.last_rid[s]:
            self._at(delivered_at + float(self.plan.gap_s[rid + 1]), rid + 1)
        else:
            self._session_over(s, delivered_at)

    def ended(self, rid: int, heard_at: float) -> None:
        """Request ``rid`` was turned away; its user hears so at ``heard_at``."""
        s = int(self.plan.session[rid])
        self.aborted[s] = True
        self._session_over(s, heard_at)

    def answer_keys(self, rid: int):
        """Prefix-cache keys of request ``rid``'s prompt and output blocks, named as the
        next prompt of its session names them (the same rule, ``model.kv.prefixkeys``):
        vLLM caches a block of generated tokens once it is full, so the next turn hits
        on the previous prompt and answer. The replica registers them as the request
        finishes (``loops.simpy.apply``; the next turn is sent after that). None where
        no later prompt holds the output as generated (the session's last request, or
        reasoning the history drops)."""
        wl, plan = self.wl, self.plan
        nxt = rid + 1
        if (nxt >= len(plan.session) or plan.session[nxt] != plan.session[rid]
                or plan.kept[rid] != wl.output_tokens[rid]):
            return None
        return keys_from_hash_ids(wl.hash_ids[nxt], int(wl.prompt_tokens[rid]
                                                         + wl.output_tokens[rid]),
                                  self.bs, int(wl.meta["hash_block_tokens"]))
