"""The server-to-client half of the wire: SSE frames over the client's downlink.

Each generated token leaves as one SSE frame of ``frame_overhead_bytes`` (the
``data: {...}\\n\\n`` JSON envelope, 50-100 B per the seeds) plus the token text.
A frame takes ``c = bytes x 8 / downlink`` to transmit; frames of one request
queue on its connection, so frame k departs at ``D_k = max(t_k, D_{k-1}) + c``
where ``t_k`` is when the engine produced token k, and arrives one-way latency
later. ``T_stream`` = last arrival - last token. When the client reads slower
than the engine writes, the queue grows and so does ``T_stream``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamTiming:
    """Per-frame transmit time and one-way latency (seconds)."""

    frame_time: float
    one_way: float

    @classmethod
    def from_config(cls, cfg, one_way: float) -> "StreamTiming":
        nbytes = cfg.frame_overhead_bytes + cfg.bytes_per_token
        return cls(frame_time=nbytes * 8.0 / (cfg.downlink_mbps * 1e6), one_way=one_way)
