"""The inputs and outputs of one stream (``clientstream.ClientStream``): its parameters
(frame sizes, the client's downlink, coalescing, heartbeats, the send buffer and its
backpressure policy, pacing, the write timeout, framing), the downlink FIFO a stream
writes to, and what a closed stream delivered."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from simulator.wire.framing import FRAMINGS, framing_bytes

POLICIES = ("block", "buffer", "degrade")
INF = math.inf


@dataclass(frozen=True)
class StreamParams:
    """Everything one stream needs to know: frame sizes, the client's downlink,
    coalescing, heartbeats, the send buffer and its backpressure policy, latency."""

    frame_overhead_bytes: float = 80.0
    bytes_per_token: float = 4.0
    downlink_bps: float = 50e6
    every_tokens: Optional[int] = 1        # write a frame once this many tokens are pending
    every_ms: Optional[float] = None       # ... or this long after the oldest pending token
    heartbeat_s: Optional[float] = None    # comment frame after this long without a write
    heartbeat_bytes: float = 8.0           # ": ping\n\n"
    buffer_bytes: Optional[float] = None   # send-buffer capacity (None: unbounded)
    backpressure: str = "buffer"           # block | buffer | degrade
    one_way: float = 0.0                   # server-to-client latency
    target_tpot_s: Optional[float] = None  # pacing: at most one token per this
    write_timeout_s: Optional[float] = None  # block: close a write waiting longer
    framing: Optional[str] = None          # sse | websocket (None: overhead is all)

    def __post_init__(self) -> None:
        if self.backpressure not in POLICIES:
            raise ValueError(f"backpressure must be one of {POLICIES}, not {self.backpressure!r}")
        if self.every_tokens is None and self.every_ms is None:
            raise ValueError("coalescing needs every_tokens or every_ms")
        if self.every_tokens is not None and self.every_tokens < 1:
            raise ValueError("every_tokens must be >= 1")
        if self.every_ms is not None and self.every_ms <= 0:
            raise ValueError("every_ms must be > 0")
        if self.heartbeat_s is not None and self.heartbeat_s <= 0:
            raise ValueError("heartbeat_s must be > 0")
        if self.downlink_bps <= 0:
            raise ValueError("downlink_bps must be > 0")
        if self.backpressure != "buffer" and self.buffer_bytes is None:
            raise ValueError(f"backpressure {self.backpressure!r} needs buffer_bytes")
        if self.target_tpot_s is not None and not self.target_tpot_s > 0:
            raise ValueError("target_tpot_s must be > 0")
        if self.write_timeout_s is not None and (not self.write_timeout_s > 0
                                                 or self.backpressure != "block"):
            raise ValueError("write_timeout_s must be > 0, with backpressure 'block'")
        if self.framing is not None and self.framing not in FRAMINGS:
            raise ValueError(f"framing must be one of {FRAMINGS}, not {self.framing!r}")

    def frame_bytes(self, tokens: int) -> float:
        """Bytes of one data frame carrying ``tokens`` tokens."""
        return framing_bytes(self.framing, self.frame_overhead_bytes
                             + tokens * self.bytes_per_token)


class Link:
    """The client's downlink as one FIFO: ``busy`` is when its last queued byte leaves.

    One per stream under HTTP/1.1 (each stream has its connection); one per client
    under HTTP/2, shared by all its streams."""

    __slots__ = ("busy",)

    def __init__(self) -> None:
        self.busy = -INF


@dataclass
class StreamResult:
    """What a stream delivered and what it cost (seconds, bytes)."""

    first_arrival: float          # client receives token 1 (NaN if never)
    last_arrival: float           # client receives the last delivered token (NaN if none)
    gaps: np.ndarray              # client-observed gaps between consecutive tokens
    tokens_emitted: int           # tokens the engine produced
    tokens_delivered: int         # tokens that reached the client
    frames: int                   # data frames written (the degraded body counts as one)
    bytes: float                  # data + heartbeat bytes written
    heartbeats: int               # heartbeat comment frames written
    peak_buffer_bytes: float      # most bytes queued on the connection at once
    degraded: bool                # switched to a non-streamed body (degrade policy)
    blocked_s: float              # time writes waited for buffer room (block policy)
    last_depart: float            # last byte written left the server (NaN if nothing)
    cancelled: bool = False
    over_capacity: bool = False   # buffer policy: the peak exceeded buffer_bytes
    timed_out: bool = False       # closed by the server's write timeout
    drops: int = 0                # connection drops (``reconnect``)
    replayed_tokens: int = 0      # resume: tokens written again after a reconnection
    reconnect_s: float = 0.0      # resume: from each drop to the server getting the
    #                               reconnection (detect + retry + handshake + one way)
