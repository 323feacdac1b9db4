"""The wire's part of the scenario tree: ``network`` (regions, RTT, handshakes,
HTTP/1.1 pools or HTTP/2) and ``stream`` (SSE frames, coalescing, heartbeats,
per-client downlinks, send buffer and backpressure, client disconnects).
``config`` assembles them into ``Scenario``."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from simulator.config.reconnect import ReconnectConfig
from simulator.config.strict import StrictModel



# Bounds that keep the wire's times physical (a link of 1e-300 Mbps or a gateway of 1e300
# ms made every latency 1e300 ms): half the Earth's circumference, a minute of fixed
# delay, a kilobit to ten terabits per second.
EARTH_KM = 20_040.0
MAX_WIRE_MS = 60_000.0
MIN_MBPS, MAX_MBPS = 1e-3, 1e7


class ServingRegion(StrictModel):
    """A serving region and how many of the cluster's replicas run there (in order:
    the first region gets replicas 0..n-1, the next the following ones)."""

    name: str = Field(..., description="the region's name (client regions' distance_km keys)")
    replicas: int = Field(..., ge=1, description="replicas of the cluster running here")


class ClientRegion(StrictModel):
    """Where a share of the clients sits: its distance to every serving region."""

    name: str = Field(..., description="the client region's name")
    share: float = Field(..., gt=0, description="share of the clients (normalised)")
    distance_km: dict[str, float] = Field(..., description="serving region name -> km")

    @field_validator("distance_km")
    @classmethod
    def _distances(cls, v: dict) -> dict:
        bad = {k: d for k, d in v.items() if not d >= 0}
        if bad:
            raise ValueError(f"distances must be >= 0: {bad}")
        return v


class RegionsConfig(StrictModel):
    """Clients in regions at distances from one or more serving regions.

    RTT between a client region and a serving region = ``base_rtt_ms`` + 2 x distance
    / fibre speed. Region-aware routers (``nearest_region``, ``region_load_rtt``)
    choose the serving region when the client sends; ``rtt_penalty_tokens_per_ms``
    is what ``region_load_rtt`` charges a region per ms of RTT, in outstanding
    tokens (its load unit)."""

    serving: list[ServingRegion] = Field(..., min_length=1)
    clients: list[ClientRegion] = Field(..., min_length=1)
    rtt_penalty_tokens_per_ms: float = Field(
        50.0, ge=0, description="region_load_rtt: outstanding tokens one ms of RTT is worth")

    @model_validator(mode="after")
    def _names(self) -> "RegionsConfig":
        names = [r.name for r in self.serving]
        if len(set(names)) != len(names):
            raise ValueError(f"serving region names repeat: {names}")
        cnames = [c.name for c in self.clients]
        if len(set(cnames)) != len(cnames):
            raise ValueError(f"client region names repeat: {cnames}")
        for c in self.clients:
            if set(c.distance_km) != set(names):
                raise ValueError(f"client region {c.name!r} must give distance_km to exactly the "
                                 f"serving regions {names}, got {sorted(c.distance_km)}")
        return self


class NetworkConfig(StrictModel):
    """Client to serving region: RTT, connection set-up (HTTP/1.1 keep-alive pools or
    one multiplexed HTTP/2 connection per client), upload; optionally regions."""

    distance_km: float = Field(500.0, ge=0, le=EARTH_KM, description="client to region distance")
    base_rtt_ms: float = Field(2.0, ge=0, le=MAX_WIRE_MS,
                               description="RTT floor: switching, last mile")
    fibre_km_per_s: float = Field(200_000.0, ge=1_000.0, le=300_000.0,
                                  description="propagation speed in fibre (at most light's)")
    tls: Literal["none", "1.2", "1.3", "0rtt"] = Field(
        "1.3", description="handshake round trips on a new connection: TLS 1.2 two, 1.3 one, "
        "0rtt none (after TCP's one)")
    connection_reuse: bool = Field(True, description="keep-alive: reuse a client's idle "
                                   "connections (false: a new one per request)")
    connect_ms: float = Field(0.0, ge=0, le=MAX_WIRE_MS,
                              description="software cost of opening a connection beyond the "
                              "handshake's round trips: the client's connector, the socket "
                              "connect, the server's accept (wire.network)")
    dns_ms: float = Field(0.0, ge=0, le=MAX_WIRE_MS,
                          description="a name lookup before each new connection (0: the "
                          "client caches lookups)")
    clients: int = Field(64, ge=1, le=10_000_000,
                         description="distinct clients, each with its own pool")
    pool_size: int = Field(8, ge=1, le=100_000, description="keep-alive connections per client")
    keepalive_s: float = Field(300.0, ge=0, description="idle connection expiry")
    uplink_mbps: float = Field(100.0, ge=MIN_MBPS, le=MAX_MBPS,
                               description="client upload bandwidth (the request body)")
    request_overhead_bytes: int = Field(400, ge=0, description="HTTP headers + JSON envelope")
    bytes_per_prompt_token: float = Field(4.0, ge=0, description="prompt text bytes per token")
    gateway_ms: float = Field(0.5, ge=0, le=MAX_WIRE_MS,
                              description="gateway/proxy/routing processing")
    protocol: Literal["http1.1", "http2"] = Field(
        "http1.1", description="http2: one connection per client multiplexing its streams")
    h2_max_streams: int = Field(100, ge=1, description="http2 concurrent streams per connection")
    regions: Optional[RegionsConfig] = Field(None, description="replaces distance_km")

    @field_validator("tls", mode="before")
    @classmethod
    def _tls_version(cls, v):
        # YAML reads an unquoted 1.2 as a number; a TLS version is meant.
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v in (1.2, 1.3):
            return f"{float(v):.1f}"
        return v

    @model_validator(mode="after")
    def _pools(self) -> "NetworkConfig":
        # One slot per possible pooled connection is kept for every client.
        if self.clients * self.pool_size > 10**7:
            raise ValueError(f"clients x pool_size = {self.clients * self.pool_size:,} pooled "
                             "connections; at most 10,000,000")
        return self

    @model_validator(mode="after")
    def _regions_or_distance(self) -> "NetworkConfig":
        # Compared with the default rather than "was it set", so that a dumped scenario
        # (which writes every field) loads again.
        if (self.regions is not None
                and self.distance_km != type(self).model_fields["distance_km"].default):
            raise ValueError("give either distance_km or regions (whose clients carry "
                             "their own distances), not both")
        return self

    @property
    def rich(self) -> bool:
        """True when requests need per-request streams (their RTT or link differ)."""
        return self.protocol != "http1.1" or self.regions is not None


class FixedDownlink(StrictModel):
    """Every client has the same downlink."""

    kind: Literal["fixed"]
    mbps: float = Field(..., ge=MIN_MBPS, le=MAX_MBPS, description="every client's downlink")


class LognormalDownlink(StrictModel):
    """Per-client downlink ~ lognormal(median, sigma), floored at ``min_mbps``."""

    kind: Literal["lognormal"]
    median_mbps: float = Field(..., ge=MIN_MBPS, le=MAX_MBPS, description="median downlink")
    sigma: float = Field(..., ge=0, description="standard deviation of ln(downlink)")
    min_mbps: float = Field(0.1, ge=MIN_MBPS, le=MAX_MBPS,
                            description="draws below are raised to this")


class DownlinkTier(StrictModel):
    """One tier of clients: its downlink and its share of the clients."""

    mbps: float = Field(..., ge=MIN_MBPS, le=MAX_MBPS, description="this tier's downlink")
    share: float = Field(..., gt=0, description="share of the clients (normalised)")


class TieredDownlink(StrictModel):
    """Clients drawn into tiers by share (normalised), e.g. broadband / 4G / poor 3G."""

    kind: Literal["tiers"]
    tiers: list[DownlinkTier] = Field(..., min_length=1)


DownlinkDist = Annotated[Union[FixedDownlink, LognormalDownlink, TieredDownlink],
                         Field(discriminator="kind")]


class ConstantDuration(StrictModel):
    """Always ``s`` seconds."""

    kind: Literal["constant"]
    s: float = Field(..., ge=0)


class UniformDuration(StrictModel):
    """Uniform on [low_s, high_s]."""

    kind: Literal["uniform"]
    low_s: float = Field(..., ge=0)
    high_s: float = Field(..., ge=0)

    @model_validator(mode="after")
    def _order(self) -> "UniformDuration":
        if self.high_s < self.low_s:
            raise ValueError(f"high_s ({self.high_s}) < low_s ({self.low_s})")
        return self


class ExponentialDuration(StrictModel):
    """Exponential with mean ``mean_s`` (memoryless impatience)."""

    kind: Literal["exponential"]
    mean_s: float = Field(..., gt=0)


class LognormalDuration(StrictModel):
    """Lognormal with median ``median_s`` and log-space ``sigma``."""

    kind: Literal["lognormal"]
    median_s: float = Field(..., gt=0)
    sigma: float = Field(..., ge=0, description="standard deviation of ln(seconds)")


DurationDist = Annotated[Union[ConstantDuration, UniformDuration, ExponentialDuration,
                               LognormalDuration], Field(discriminator="kind")]


class DisconnectConfig(StrictModel):
    """Clients that leave mid-stream.

    A request's client disconnects with ``probability``, ``after_first_token`` after
    it received the first token. A ``signalled`` fraction closes the connection cleanly
    (FIN/RST, or RST_STREAM under HTTP/2): the server cancels the request one way later
    and frees its KV. The others vanish silently and are found only by the heartbeat
    timeout (``heartbeat_timeout_s``, 45 s: ``data/README.md``, *Facts from two design
    articles*) unless the request ends first; the GPU time spent on them meanwhile is
    reported, priced at ``gpu_cost_per_hour`` when given (the planner's
    ``--cost-per-gpu-hour`` is a command-line option a run does not see)."""

    probability: float = Field(0.0, ge=0, le=1, description="share of requests whose client "
                               "disconnects")
    after_first_token: DurationDist = Field(
        default_factory=lambda: ExponentialDuration(kind="exponential", mean_s=5.0))
    signalled: float = Field(1.0, ge=0, le=1, description="fraction that close cleanly")
    heartbeat_timeout_s: float = Field(45.0, gt=0, description="a silent disconnect is "
                                       "found this long after it happens")
    gpu_cost_per_hour: Optional[float] = Field(None, gt=0, description="$ per GPU-hour")


class StreamConfig(StrictModel):
    """Streaming back: SSE frames (per token, or coalesced) over each client's
    downlink, heartbeats, a bounded send buffer with a backpressure policy, and
    client disconnects. The defaults are one frame per token, one fixed downlink,
    no heartbeats, an unbounded buffer and no disconnects."""

    frame_overhead_bytes: int = Field(80, ge=0, description="SSE + JSON envelope per frame")
    bytes_per_token: float = Field(4.0, ge=0, description="token text bytes")
    downlink_mbps: float = Field(50.0, gt=0, description="every client's downlink (one "
                                 "fixed rate)")
    downlink: Optional[DownlinkDist] = Field(
        None, description="per-client downlink distribution (replaces downlink_mbps)")
    every_tokens: Optional[int] = Field(1, ge=1, description="coalesce: a frame per k tokens")
    every_ms: Optional[float] = Field(None, gt=0, description="coalesce: flush after t ms")
    heartbeat_s: Optional[float] = Field(None, ge=0.01, description="': ping' after N s idle "
                                         "(at least 10 ms: each ping is an event)")
    heartbeat_bytes: int = Field(8, ge=1, description="bytes of one heartbeat comment frame")
    buffer_bytes: Optional[int] = Field(None, ge=1, description="per-connection send buffer")
    backpressure: Literal["block", "buffer", "degrade"] = Field(
        "buffer", description="when the buffer is full: stop the request, grow, or un-stream")
    disconnect: DisconnectConfig = Field(default_factory=DisconnectConfig)
    target_tpot_ms: Optional[float] = Field(
        None, gt=0, le=MAX_WIRE_MS, description="pacing: release tokens to the client no "
        "faster than one per this many ms (the delay is part of T_stream)")
    write_timeout_s: Optional[float] = Field(
        None, gt=0, le=3600, description="block: a write waiting this long for a client that "
        "does not drain closes the stream and cancels the request")
    framing: Optional[Literal["sse", "websocket"]] = Field(
        None, description="add the transport's bytes per frame (sse: 8; websocket: 2/4/10 "
        "header); frame_overhead_bytes is then the JSON envelope alone")
    reconnect: ReconnectConfig = Field(default_factory=ReconnectConfig,
                                       description="connection drops and SSE auto-reconnect")

    @model_validator(mode="after")
    def _consistent(self) -> "StreamConfig":
        if (self.downlink is not None
                and self.downlink_mbps != type(self).model_fields["downlink_mbps"].default):
            raise ValueError("give either downlink_mbps or downlink, not both")
        if self.every_tokens is None and self.every_ms is None:
            raise ValueError("every_tokens and every_ms cannot both be null")
        if self.backpressure != "buffer" and self.buffer_bytes is None:
            raise ValueError(f"backpressure {self.backpressure!r} needs buffer_bytes")
        if self.write_timeout_s is not None and self.backpressure != "block":
            raise ValueError("write_timeout_s needs backpressure 'block' (only a blocked "
                             "write can wait)")
        if self.buffer_bytes is not None:
            frame = self.frame_overhead_bytes + (self.every_tokens or 1) * self.bytes_per_token
            if self.buffer_bytes < frame:
                raise ValueError(f"buffer_bytes ({self.buffer_bytes}) is smaller than one "
                                 f"frame ({frame:g} bytes)")
        return self

    @property
    def rich(self) -> bool:
        """True when any setting departs from one frame per token on one fixed downlink
        with an unbounded buffer, no heartbeats and no disconnects."""
        return (self.downlink is not None or self.every_tokens != 1
                or self.every_ms is not None or self.heartbeat_s is not None
                or self.buffer_bytes is not None or self.backpressure != "buffer"
                or self.disconnect.probability > 0 or self.target_tpot_ms is not None
                or self.write_timeout_s is not None or self.framing is not None
                or self.reconnect.drops)
