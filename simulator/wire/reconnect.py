"""SSE auto-reconnect over a run (``stream.reconnect``): the wire's side of the streams'
drops (``streamdrop`` has a stream's side).

Per stream, a ``StreamPlan``: the mode, the client's drop detection, the gap from its
noticing a drop to the server getting the reconnection (``retry_ms`` + the new
connection's handshake, none under HTTP/2, whose connection outlives a stream's reset,
+ one way: ``network``'s timings of the request's region pair), the drawn gaps between
drops (``drop_draws``: exponential, ``1 / drop_per_s`` mean, drawn up front from the
disconnect stream after its own draws, so a run without drops draws nothing more) and
the scheduled drops.

``Reconnects`` pokes every open stream at each scheduled drop (so a request waiting in a
queue sees it then: ``streamdrop`` on when drops are seen), and acts on each drop:

- ``resume``: the dropped connection leaves its pool; the reconnection is a new
  connection (counted in ``connections.new`` under HTTP/1.1). The request runs on, the
  gap is part of its ``T_stream`` (last delivery - last token), and the breakdown still
  adds up: its timestamps are the one attempt's.
- ``restart``: the server cancels the attempt when the reset reaches it (one way after
  the drop; at once for its own write timeout). The client sends the request again
  ``retry_ms`` after noticing the drop, on a new connection (HTTP/1.1: the handshake in
  its ``T_net``; HTTP/2: a new stream of the client's connection), with the same prompt
  (so with prefix caching its blocks may still be cached), once the old attempt has left
  its replica. Its row is its last attempt's, ``arrival`` its first send: what came
  before the last attempt reached the server (the earlier attempts, the drops, the retry
  delays) is in its ``T_net`` and ``retry_s``, as for a client's retries
  (``report.metrics``); ``attempts`` counts the sends. The tokens the dropped attempts
  had generated are reported as re-generated.
- ``none`` or no reconnection left: the request is cancelled as a disconnect is, and
  ends ``cancelled``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from simulator.wire.network import net_time


@dataclass(frozen=True)
class StreamPlan:
    """What one stream needs to play its drops (seconds)."""

    mode: str                     # resume | restart | none
    detect_s: float               # network drop -> the client notices
    gap_s: float                  # the client notices -> the server gets the reconnection
    max_reconnects: int
    draws: Optional[np.ndarray]   # seconds of streaming before each of the request's drops
    scheduled: tuple              # the scheduled drop times, sorted
    prior: int = 0                # the request's drops before this stream (restarts)


def drop_draws(cfg, n: int, rng: np.random.Generator) -> Optional[np.ndarray]:
    """Per request, the seconds of streaming before each possible drop (``cfg``: a
    ``ReconnectConfig``); None without ``drop_per_s`` (nothing drawn)."""
    if cfg.drop_per_s <= 0:
        return None
    return rng.exponential(1.0 / cfg.drop_per_s, size=(n, cfg.max_reconnects + 1))


def reconnects_on(scfg) -> bool:
    """Whether a run's streams get a plan: something can drop them."""
    rc = scfg.reconnect
    return rc.drops or (rc.mode != "none" and scfg.write_timeout_s is not None)


class Reconnects:
    """The run's drops and reconnections (module doc); one per ``per_request.Wire``."""

    def __init__(self, wire, cfg, draws: Optional[np.ndarray]) -> None:
        self.wire, self.cfg, self.draws = wire, cfg, draws
        self.env = wire.env
        self.scheduled = tuple(cfg.drops_at_s)
        self.prior: dict[int, int] = {}    # rid -> drops of its earlier attempts
        self.open: dict[int, object] = {}  # rid -> its stream (for the scheduled drops)
        self.drops = self.resumed = self.restarted = self.given_up = 0
        self.regenerated = 0
        for t in sorted(set(self.scheduled)):
            self.env.timeout(t).callbacks.append(lambda _e, t=t: self._poke_all(t))

    def attach(self, seq, stream) -> None:
        """Give ``seq``'s new stream its plan."""
        w, rid = self.wire, seq.rid
        tm = w._timing(rid)
        gap = self.cfg.retry_ms / 1000.0 + (0.0 if w.h2 else tm.handshake) + tm.one_way
        plan = StreamPlan(self.cfg.mode, self.cfg.detect_ms / 1000.0, gap,
                          self.cfg.max_reconnects,
                          self.draws[rid] if self.draws is not None else None,
                          self.scheduled, self.prior.get(rid, 0))
        stream.attach_reconnect(
            plan, on_drop=lambda cut, notice, resumed, closed, k, s=seq:
            self._dropped(s, cut, notice, resumed, closed, k))
        if self.scheduled and self.scheduled[-1] >= self.env.now:
            self.open[rid] = stream   # poked at the scheduled drops

    def _at(self, t: float, fn) -> None:
        """Call ``fn(t)`` at ``t`` (now if ``t`` has passed)."""
        self.env.timeout(max(t - self.env.now, 0.0)).callbacks.append(
            lambda _e: fn(max(t, self.env.now)))

    def _poke_all(self, t: float) -> None:
        for rid, st in list(self.open.items()):
            if st.result is not None:
                del self.open[rid]
            else:
                st.poke(t)

    def _dropped(self, seq, cut: float, notice: float, resumed: bool,
                 closed_at: Optional[float], k: int) -> None:
        """``seq``'s connection dropped at ``cut`` (its ``k``-th drop)."""
        w, rid = self.wire, seq.rid
        self.drops += 1
        if seq.pooled and not w.h2:
            # The connection is gone: it can serve none of the client's later requests.
            w.pools.discard(int(w.key[rid]), None)
            seq.pooled = False
        if resumed:
            self.resumed += 1
            if not w.h2:
                w.pools.new_connections += 1
            return
        # The server cancels the attempt when it learns: its own close, or the reset.
        t_cancel = closed_at if closed_at is not None else cut + w._timing(rid).one_way
        self._at(t_cancel, lambda _t: w._notice(seq))
        if self.cfg.mode == "restart" and k <= self.cfg.max_reconnects:
            self.restarted += 1
            self.prior[rid] = k
            self._at(notice + self.cfg.retry_ms / 1000.0, lambda _t: self._resend(seq))
        else:
            self.given_up += 1
            # Closed before its end reached the client: cancelled (``Wire.summary``).
            w.timed_out[rid] = seq

    def _resend(self, old) -> None:
        """The client sends ``old``'s request again now, as a new attempt (unless it
        has left meanwhile: ``stream.disconnect``)."""
        w, rid, now = self.wire, old.rid, self.env.now
        if rid in w.left:
            return
        new = type(old)(rid, 0.0, old.prompt_tokens, old.output_tokens, old.priority,
                        old.blocks_needed, old.client, False)
        new.keys, new.keys_out = old.keys, old.keys_out
        rec = w.rec
        rec.attempts[rid] += 1
        rec.retry_s[rid] = now - rec.arrival[rid]
        if w.h2:
            w.released[rid] = False
            t_net = w.send(new, now)        # a new stream on the client's connection
        else:
            tm = w._timing(rid)
            w.pools.new_connections += 1
            rec.new_connection[rid] = True
            t_net = net_time(tm.send_time(new.prompt_tokens), tm.handshake, True, 0.0)
        self.env.timeout(t_net).callbacks.append(lambda _e: self._arrive(old, new))

    def _arrive(self, old, new) -> None:
        """The new attempt reaches the server: it joins a replica once the old one has
        left its own (a cancel takes effect at the replica's next step boundary)."""
        if old.where != "x":
            old.stream.on_closed = lambda: self.env.timeout(0.0).callbacks.append(
                lambda _e: self._arrive(old, new))
            return
        w, rid, rec = self.wire, old.rid, self.wire.rec
        w._count(old)
        w.counted[rid] = False
        w.released[rid] = False
        self.regenerated += int(old.generated)
        for a in ("scheduled", "first_token", "last_token", "first_delivered",
                  "last_delivered", "cancelled_at"):
            getattr(rec, a)[rid] = math.nan
        rec.cancelled[rid] = False
        w.deliver(new)

    def summary(self, stats) -> dict:
        """``meta["stream"]["reconnect"]``: drops, reconnections (resumed, restarted),
        drops that lost the stream, tokens generated again (restart) and written again
        (resume), and the resumed streams' time from drops to reconnections (``stats``:
        the run's ``StreamStats``)."""
        return {"drops": self.drops, "reconnects": self.resumed + self.restarted,
                "resumed": self.resumed, "restarted": self.restarted,
                "given_up": self.given_up, "tokens_regenerated": self.regenerated,
                "tokens_replayed": stats.replayed_tokens,
                "reconnect_gap_s": float(stats.reconnect_s)}
