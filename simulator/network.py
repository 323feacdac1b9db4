"""The client-to-server half of the wire: RTT, connection set-up, upload.

RTT = ``base_rtt`` + 2 x distance / fibre speed (light in fibre ~200,000 km/s).
A request on a new connection pays a TCP handshake (1 RTT) plus the TLS handshake
(TLS 1.2: 2 RTT, TLS 1.3: 1 RTT, 0-RTT resumption: 0) before it can be sent; a
request that finds an idle keep-alive connection in its client's pool pays none.
Then it travels one way (RTT/2), is uploaded at the client's uplink bandwidth,
and crosses the gateway. That total is ``T_net``.

Each client has a pool of at most ``pool_size`` keep-alive connections. A
connection is busy from the request's send until its response has been
delivered; afterwards it sits idle and is reused if the next request comes within
``keepalive_s``. When every pooled connection is busy the request opens a
one-off connection (not kept), paying the handshake - as an HTTP client with a
bounded keep-alive pool does.
"""
from __future__ import annotations

from dataclasses import dataclass

TLS_RTTS = {"none": 0, "1.2": 2, "1.3": 1, "0rtt": 0}


@dataclass(frozen=True)
class NetworkTiming:
    """Fixed timings derived from the network config (seconds)."""

    rtt: float
    handshake: float       # TCP + TLS on a new connection
    gateway: float
    uplink_bps: float
    overhead_bytes: int
    bytes_per_token: float

    @classmethod
    def from_config(cls, cfg) -> "NetworkTiming":
        rtt = cfg.base_rtt_ms / 1000.0 + 2.0 * cfg.distance_km / cfg.fibre_km_per_s
        tls = TLS_RTTS[cfg.tls]
        return cls(rtt=rtt, handshake=(1 + tls) * rtt, gateway=cfg.gateway_ms / 1000.0,
                   uplink_bps=cfg.uplink_mbps * 1e6, overhead_bytes=cfg.request_overhead_bytes,
                   bytes_per_token=cfg.bytes_per_prompt_token)

    @property
    def one_way(self) -> float:
        return self.rtt / 2.0

    def send_time(self, prompt_tokens: int) -> float:
        """One-way travel + upload + gateway for a request on an open connection."""
        nbytes = self.overhead_bytes + prompt_tokens * self.bytes_per_token
        return self.one_way + nbytes * 8.0 / self.uplink_bps + self.gateway


class ConnectionPools:
    """Per-client keep-alive pools. Pure bookkeeping: callers pass the clock."""

    __slots__ = ("reuse", "size", "keepalive", "_idle", "_open", "new_connections",
                 "reused_connections")

    def __init__(self, n_clients: int, pool_size: int, keepalive_s: float, reuse: bool) -> None:
        self.reuse = reuse
        self.size = pool_size
        self.keepalive = keepalive_s
        # Per client: list of times at which a pooled connection becomes idle.
        self._idle: list[list[float]] = [[] for _ in range(n_clients)]
        self._open = [0] * n_clients
        self.new_connections = 0
        self.reused_connections = 0

    def acquire(self, client: int, now: float) -> tuple[bool, bool]:
        """Take a connection at ``now``: returns (is_new, pooled)."""
        if not self.reuse:
            self.new_connections += 1
            return True, False
        idle = self._idle[client]
        best = -1
        i = 0
        while i < len(idle):
            t = idle[i]
            if t <= now and now - t > self.keepalive:
                # Expired while idle: the server closed it.
                idle.pop(i)
                self._open[client] -= 1
                continue
            if t <= now and (best < 0 or t > idle[best]):
                best = i   # most recently used idle connection (warmest)
            i += 1
        if best >= 0:
            idle.pop(best)
            self.reused_connections += 1
            return False, True
        self.new_connections += 1
        if self._open[client] < self.size:
            self._open[client] += 1
            return True, True
        return True, False

    def release(self, client: int, free_at: float, pooled: bool) -> None:
        """The connection is idle again from ``free_at`` (its response delivered)."""
        if pooled and self.reuse:
            self._idle[client].append(free_at)
