"""The server-to-client half of the wire: from the ``stream`` config to timings.

Each generated token leaves as one SSE frame of ``frame_overhead_bytes`` (the
``data: {...}\\n\\n`` JSON envelope, 50-100 B; ``data/README.md``, *Facts from two
design articles*) plus the token text.
A frame takes ``c = bytes x 8 / downlink`` to transmit; frames of one request
queue on its connection, so frame k departs at ``D_k = max(t_k, D_{k-1}) + c``
where ``t_k`` is when the engine produced token k, and arrives one-way latency
later. ``T_stream`` = last arrival - last token. When the client reads slower
than the engine writes, the queue grows and so does ``T_stream``.

``StreamTiming`` is that default model's two numbers (the replica's fast path).
The rest of this module turns the richer settings into per-client and
per-request inputs of ``clientstream.ClientStream``: each client's downlink
drawn from a distribution, the ``StreamParams`` of a request, and the seeded
draws of which clients disconnect, when, and whether they say so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from simulator.wire.clientstream import StreamParams
from simulator.wire.reconnect import drop_draws


@dataclass(frozen=True)
class StreamTiming:
    """Per-frame transmit time and one-way latency (seconds)."""

    frame_time: float
    one_way: float

    @classmethod
    def from_config(cls, cfg, one_way: float) -> "StreamTiming":
        nbytes = cfg.frame_overhead_bytes + cfg.bytes_per_token
        return cls(frame_time=nbytes * 8.0 / (cfg.downlink_mbps * 1e6), one_way=one_way)


def client_downlinks_bps(cfg, n_clients: int, rng: np.random.Generator) -> np.ndarray:
    """Each client's downlink (bits/s), drawn once per run from ``cfg.downlink``
    (``fixed``, ``lognormal`` floored at ``min_mbps``, or ``tiers`` by share); without
    it every client has ``downlink_mbps``. Draws nothing for a fixed downlink."""
    d = cfg.downlink
    if d is None or d.kind == "fixed":
        mbps = cfg.downlink_mbps if d is None else d.mbps
        return np.full(n_clients, mbps * 1e6)
    if d.kind == "lognormal":
        x = rng.lognormal(np.log(d.median_mbps), d.sigma, size=n_clients)
        return np.maximum(x, d.min_mbps) * 1e6
    shares = np.array([t.share for t in d.tiers], dtype=np.float64)
    idx = rng.choice(len(d.tiers), size=n_clients, p=shares / shares.sum())
    return np.array([t.mbps for t in d.tiers])[idx] * 1e6


def stream_params(cfg, downlink_bps: float, one_way: float) -> StreamParams:
    """The ``StreamParams`` of a request of a client with this downlink and latency."""
    return StreamParams(
        frame_overhead_bytes=float(cfg.frame_overhead_bytes),
        bytes_per_token=float(cfg.bytes_per_token),
        downlink_bps=float(downlink_bps),
        every_tokens=cfg.every_tokens,
        every_ms=cfg.every_ms,
        heartbeat_s=cfg.heartbeat_s,
        heartbeat_bytes=float(cfg.heartbeat_bytes),
        buffer_bytes=None if cfg.buffer_bytes is None else float(cfg.buffer_bytes),
        backpressure=cfg.backpressure,
        one_way=float(one_way),
        target_tpot_s=None if cfg.target_tpot_ms is None else cfg.target_tpot_ms / 1000.0,
        write_timeout_s=cfg.write_timeout_s,
        framing=cfg.framing,
    )


def sample_durations(dist, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` draws (seconds) from a ``DurationDist`` config."""
    if dist.kind == "constant":
        return np.full(n, float(dist.s))
    if dist.kind == "uniform":
        return rng.uniform(dist.low_s, dist.high_s, size=n)
    if dist.kind == "exponential":
        return rng.exponential(dist.mean_s, size=n)
    return rng.lognormal(np.log(dist.median_s), dist.sigma, size=n)


@dataclass(frozen=True)
class DisconnectDraws:
    """Per request: whether its client leaves mid-stream, how long after receiving
    the first token, and whether it signals it (a clean close)."""

    leaves: np.ndarray       # bool
    after_s: np.ndarray      # seconds after the first token's arrival
    signalled: np.ndarray    # bool
    drops: Optional[np.ndarray] = None   # seconds of streaming to each drop (``reconnect``)

    @classmethod
    def sample(cls, cfg, n: int, rng: np.random.Generator,
               reconnect=None) -> "DisconnectDraws":
        """Draw all three for ``n`` requests up front, so the run's event order cannot
        change them (``cfg``: a ``DisconnectConfig``); then, with ``reconnect`` (a
        ``ReconnectConfig``) asking for drawn drops, the gaps between connection drops
        (``reconnect.drop_draws``; after the others, which stay as they were)."""
        leaves = rng.random(n) < cfg.probability
        after = sample_durations(cfg.after_first_token, n, rng)
        signalled = rng.random(n) < cfg.signalled
        drops = drop_draws(reconnect, n, rng) if reconnect is not None else None
        return cls(leaves=leaves, after_s=after, signalled=signalled, drops=drops)
