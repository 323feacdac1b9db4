"""Run-wide totals over the closed per-request streams (``clientstream``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class StreamStats:
    """Run-wide totals over closed streams, for ``Results.meta["stream"]``."""

    streams: int = 0
    frames: int = 0
    bytes: float = 0.0
    heartbeats: int = 0
    tokens_emitted: int = 0
    tokens_delivered: int = 0
    degraded: int = 0
    blocked: int = 0
    blocked_s: float = 0.0
    over_capacity: int = 0
    write_timeouts: int = 0
    replayed_tokens: int = 0      # reconnections (``reconnect``): read by its summary
    reconnect_s: float = 0.0
    peak_buffer_bytes: list = field(default_factory=list)

    def add(self, r: StreamResult) -> None:
        """Count one closed stream."""
        self.streams += 1
        self.frames += r.frames
        self.bytes += r.bytes
        self.heartbeats += r.heartbeats
        self.tokens_emitted += r.tokens_emitted
        self.tokens_delivered += r.tokens_delivered
        self.degraded += r.degraded
        self.blocked += r.blocked_s > 0
        self.blocked_s += r.blocked_s
        self.over_capacity += r.over_capacity
        self.write_timeouts += r.timed_out
        self.replayed_tokens += r.replayed_tokens
        self.reconnect_s += r.reconnect_s
        self.peak_buffer_bytes.append(r.peak_buffer_bytes)

    def as_dict(self) -> dict:
        """Totals plus the peak send-buffer bytes (max, P99, mean over streams)."""
        peaks = np.asarray(self.peak_buffer_bytes, dtype=np.float64)
        has = len(peaks) > 0
        return {
            "streams": self.streams,
            "frames": self.frames,
            "bytes": self.bytes,
            "heartbeats": self.heartbeats,
            "tokens_per_frame": (self.tokens_emitted / self.frames) if self.frames else math.nan,
            "tokens_emitted": self.tokens_emitted,
            "tokens_delivered": self.tokens_delivered,
            "degraded": self.degraded,
            "blocked_streams": self.blocked,
            "blocked_s": self.blocked_s,
            "over_capacity": self.over_capacity,
            "write_timeouts": self.write_timeouts,
            "peak_buffer_bytes_max": float(peaks.max()) if has else math.nan,
            "peak_buffer_bytes_p99": float(np.percentile(peaks, 99)) if has else math.nan,
            "peak_buffer_bytes_mean": float(peaks.mean()) if has else math.nan,
        }
