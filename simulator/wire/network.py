"""The client-to-server half of the wire: RTT, connection set-up, upload.

RTT = ``base_rtt`` + 2 x distance / fibre speed (light in fibre ~200,000 km/s).
A request on a new connection pays a TCP handshake (1 RTT) plus the TLS handshake
(TLS 1.2: 2 RTT, TLS 1.3: 1 RTT, 0-RTT resumption: 0) before it can be sent, and the
software's own cost of opening it (``connect_ms``: the client's connector, the socket
connect, the server's accept; ``dns_ms``: a name lookup, for a client that caches none);
a request that finds an idle keep-alive connection in its client's pool pays none of it.
Then it travels one way (RTT/2), is uploaded at the client's uplink bandwidth,
and crosses the gateway. That total is ``T_net``.

Each client has a pool of at most ``pool_size`` keep-alive connections. A
connection is busy from the request's send until its response has been
delivered; afterwards it sits idle and is reused if the next request comes within
``keepalive_s``. When every pooled connection is busy the request opens a
one-off connection (not kept), paying the handshake - as an HTTP client with a
bounded keep-alive pool does.

HTTP/2 (``H2Connections``): one connection per client carries all its concurrent
streams (up to ``h2_max_streams``; beyond that a one-off connection is opened). It
pays the handshake when opened, is shared at once (a request arriving while the
handshake is still in progress waits for the rest of it), and expires after
``keepalive_s`` with no open stream. Its streams also share the client's downlink
(``clientstream.Link``): under HTTP/1.1 each connection is its own TCP flow with the
whole ``downlink_mbps``; under HTTP/2 they are one flow.

Regions (``Topology``): clients sit in client regions, replicas in serving regions;
every (client region, serving region) pair has its own distance, hence RTT,
handshake and one-way latency.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.kernel import python_of
from simulator.wire.frontend import FrontendTiming
from simulator.wire.keepalive import (NEW_POOLED, REUSED, pool_acquire, pool_discard,
                                      pool_release, request_net_s)

# A pool's rules run once per request from Python: their plain functions (a compiled
# call's dispatch costs more than the few comparisons they make).
_acquire, _release, _discard = (python_of(f) for f in (pool_acquire, pool_release,
                                                        pool_discard))
net_time = python_of(request_net_s)

TLS_RTTS = {"none": 0, "1.2": 2, "1.3": 1, "0rtt": 0}


@dataclass(frozen=True)
class NetworkTiming:
    """Fixed timings derived from the network config (seconds)."""

    rtt: float
    handshake: float       # TCP + TLS round trips and set-up on a new connection
    gateway: float
    uplink_bps: float
    overhead_bytes: int
    bytes_per_token: float
    frontend: FrontendTiming = FrontendTiming()   # the server's API process (``frontend``)

    @classmethod
    def from_config(cls, cfg, distance_km: float | None = None,
                    frontend: FrontendTiming | None = None) -> "NetworkTiming":
        """Timings over ``distance_km`` (default: the config's ``distance_km``), with
        the engine's front end (``frontend.FrontendTiming``; default: none)."""
        dist = cfg.distance_km if distance_km is None else distance_km
        rtt = cfg.base_rtt_ms / 1000.0 + 2.0 * dist / cfg.fibre_km_per_s
        tls = TLS_RTTS[cfg.tls]
        setup = (cfg.connect_ms + cfg.dns_ms) / 1000.0
        return cls(rtt=rtt, handshake=(1 + tls) * rtt + setup, gateway=cfg.gateway_ms / 1000.0,
                   uplink_bps=cfg.uplink_mbps * 1e6, overhead_bytes=cfg.request_overhead_bytes,
                   bytes_per_token=cfg.bytes_per_prompt_token,
                   frontend=frontend if frontend is not None else FrontendTiming())

    @property
    def one_way(self) -> float:
        return self.rtt / 2.0

    @property
    def deliver_s(self) -> float:
        """From a frame leaving the engine's front end to the client: one way, plus
        the front end's response side (``frontend``)."""
        return self.one_way + self.frontend.response_s

    def send_time(self, prompt_tokens: int) -> float:
        """One-way travel + upload + gateway for a request on an open connection, then
        the front end's request side (``frontend``: HTTP, tokenising, the IPC hop)."""
        nbytes = self.overhead_bytes + prompt_tokens * self.bytes_per_token
        return (self.one_way + nbytes * 8.0 / self.uplink_bps + self.gateway
                + self.frontend.request_s(prompt_tokens))


class ConnectionPools:
    """Per-client keep-alive pools (the rules: ``keepalive``, on this object's arrays,
    which the compiled loop runs on too). Pure bookkeeping: callers pass the clock."""

    __slots__ = ("reuse", "size", "keepalive", "idle", "n_idle", "n_open", "new_connections",
                 "reused_connections")

    def __init__(self, n_clients: int, pool_size: int, keepalive_s: float, reuse: bool) -> None:
        self.reuse = reuse
        self.size = pool_size
        self.keepalive = keepalive_s
        # Per client: when each idle pooled connection became idle; how many are idle;
        # how many pooled connections are open (``keepalive``'s module doc).
        self.idle = np.zeros((n_clients, max(pool_size, 1) if reuse else 1))
        self.n_idle = np.zeros(n_clients, dtype=np.int64)
        self.n_open = np.zeros(n_clients, dtype=np.int64)
        self.new_connections = 0
        self.reused_connections = 0

    def acquire(self, client: int, now: float, handshake: float = 0.0) -> tuple[bool, bool]:
        """Take a connection at ``now``: returns (is_new, pooled). ``handshake``: unused
        here (a reused HTTP/1.1 connection is idle, hence set up)."""
        got = _acquire(self.idle, self.n_idle, self.n_open, client, now, self.keepalive,
                       self.size, self.reuse)
        if got == REUSED:
            self.reused_connections += 1
            return False, True
        self.new_connections += 1
        return True, got == NEW_POOLED

    def release(self, client: int, free_at: float, pooled: bool) -> None:
        """The connection is idle again from ``free_at`` (its response delivered)."""
        _release(self.idle, self.n_idle, client, free_at, pooled, self.reuse)

    def setup_wait(self, client: int, now: float, handshake: float) -> float:
        """Extra wait of a request that reused a connection: none, it was idle and open."""
        return 0.0

    def discard(self, client: int, idle_at: float | None = None) -> None:
        """The client closed one of its pooled connections (it disconnected): it leaves
        the pool. ``idle_at``: the idle time it was released with, if it was."""
        if self.reuse:
            _discard(self.idle, self.n_idle, self.n_open, client,
                     0.0 if idle_at is None else idle_at, idle_at is not None)


class H2Connections:
    """HTTP/2: one multiplexed connection per client (see the module docstring).
    Same interface as ``ConnectionPools``; pure bookkeeping, callers pass the clock."""

    __slots__ = ("reuse", "max_streams", "keepalive", "_active", "_free_at", "_ready",
                 "new_connections", "reused_connections")

    def __init__(self, n_clients: int, max_streams: int, keepalive_s: float,
                 reuse: bool) -> None:
        self.reuse = reuse
        self.max_streams = max_streams
        self.keepalive = keepalive_s
        self._active = [0] * n_clients                   # open streams on the connection
        self._free_at = [-float("inf")] * n_clients      # when its last stream ended
        self._ready = [None] * n_clients                 # handshake done (None: closed)
        self.new_connections = 0
        self.reused_connections = 0

    def acquire(self, client: int, now: float, handshake: float = 0.0) -> tuple[bool, bool]:
        """Open a stream at ``now``: returns (is_new connection, on the shared one).
        ``handshake``: how long a connection opened now takes to set up."""
        if not self.reuse:
            self.new_connections += 1
            return True, False
        ready = self._ready[client]
        open_ = ready is not None and (self._active[client] > 0
                                       or now - self._free_at[client] <= self.keepalive)
        if open_ and self._active[client] >= self.max_streams:
            self.new_connections += 1   # stream limit reached: a one-off extra connection
            return True, False
        self._active[client] += 1
        if open_:
            self.reused_connections += 1
            return False, True
        self.new_connections += 1
        self._ready[client] = now + handshake
        return True, True

    def setup_wait(self, client: int, now: float, handshake: float) -> float:
        """What is left of the shared connection's handshake for a stream opened now."""
        ready = self._ready[client]
        return ready - now if ready is not None and ready > now else 0.0

    def release(self, client: int, free_at: float, pooled: bool) -> None:
        """A stream on the shared connection ended; its last byte reached the client at
        ``free_at`` (the connection's idle clock starts at the latest such time)."""
        if pooled and self.reuse:
            self._active[client] -= 1
            if free_at > self._free_at[client]:
                self._free_at[client] = free_at

    def discard(self, client: int, idle_at: float | None = None) -> None:
        """A client's disconnect resets one stream (RST_STREAM); the connection stays."""


@dataclass(frozen=True)
class Topology:
    """Client regions, serving regions and the network between them.

    ``client_region[c]``: the region of client ``c`` (clients split in index order by
    the regions' shares, largest remainder); ``replica_region[k]``: the serving region
    of replica ``k``; ``rtt[i, j]``: RTT (s) from client region ``i`` to serving region
    ``j``; ``timing[i][j]``: the ``NetworkTiming`` of that pair."""

    serving_names: tuple
    client_names: tuple
    client_region: np.ndarray
    replica_region: np.ndarray
    region_replicas: tuple
    rtt: np.ndarray
    timing: tuple
    rtt_penalty_tokens_per_ms: float = 0.0

    @classmethod
    def from_config(cls, cfg, n_clients: int, n_replicas: int,
                    frontend: FrontendTiming | None = None) -> "Topology":
        """From a ``NetworkConfig`` with ``regions``; the serving regions' replica counts
        must add up to ``n_replicas``; ``frontend``: the engine's front end."""
        reg = cfg.regions
        counts = [r.replicas for r in reg.serving]
        if sum(counts) != n_replicas:
            from simulator.errors import LatsimError
            raise LatsimError(f"serving regions hold {sum(counts)} replicas but the cluster "
                              f"has {n_replicas}", field="network.regions.serving",
                              value=counts, has_value=True)
        replica_region = np.repeat(np.arange(len(counts)), counts)
        region_replicas = tuple(tuple(int(k) for k in np.flatnonzero(replica_region == j))
                                for j in range(len(counts)))
        shares = np.array([c.share for c in reg.clients], dtype=np.float64)
        client_region = np.repeat(np.arange(len(shares)), split_by_shares(n_clients, shares))
        names = [r.name for r in reg.serving]
        timing = tuple(tuple(NetworkTiming.from_config(cfg, c.distance_km[nm], frontend)
                             for nm in names)
                       for c in reg.clients)
        rtt = np.array([[t.rtt for t in row] for row in timing])
        return cls(serving_names=tuple(names), client_names=tuple(c.name for c in reg.clients),
                   client_region=client_region, replica_region=replica_region,
                   region_replicas=region_replicas, rtt=rtt, timing=timing,
                   rtt_penalty_tokens_per_ms=reg.rtt_penalty_tokens_per_ms)

    @classmethod
    def single(cls, n_replicas: int, n_clients: int = 1) -> "Topology":
        """Everything in one region, zero distance (region routers without regions)."""
        return cls(serving_names=("default",), client_names=("default",),
                   client_region=np.zeros(n_clients, dtype=np.int64),
                   replica_region=np.zeros(n_replicas, dtype=np.int64),
                   region_replicas=(tuple(range(n_replicas)),), rtt=np.zeros((1, 1)),
                   timing=((None,),))


def split_by_shares(n: int, shares: np.ndarray) -> np.ndarray:
    """``n`` items split in proportion to ``shares`` (largest remainder, ties to the first)."""
    q = n * shares / shares.sum()
    counts = np.floor(q).astype(np.int64)
    rest = n - int(counts.sum())
    order = np.argsort(-(q - counts), kind="stable")
    counts[order[:rest]] += 1
    return counts
