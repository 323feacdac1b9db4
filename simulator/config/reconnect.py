"""``stream.reconnect``: what an SSE client does when its stream's connection drops
mid-stream (EventSource semantics, WHATWG HTML, server-sent events: the ``retry:``
field sets the reconnection time, the ``Last-Event-ID`` header names the last event
received), and what drops it. The model: ``wire.streamdrop`` (a stream) and
``wire.reconnect`` (the run)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from simulator.config.strict import StrictModel

MAX_RETRY_MS = 600_000.0    # ten minutes: past that a client has given up, not retried
MAX_DROP_PER_S = 100.0      # a drop every 10 ms of streaming: nothing would stream
MAX_DROP_AT_S = 1e7         # ~4 months: the run's clock goes on to its last drop


class ReconnectConfig(StrictModel):
    """Connection drops and SSE auto-reconnect. Off unless something can drop a stream:
    ``drop_per_s`` > 0, ``drops_at_s``, or (with a mode other than none) the write
    timeout (``stream.write_timeout_s``)."""

    mode: Literal["none", "resume", "restart"] = Field(
        "none", description="after a drop: resume (reconnect with Last-Event-ID; the "
        "server replays the frames after it), restart (the request is sent again and "
        "generated anew), none (the stream is lost: the request is cancelled)")
    retry_ms: float = Field(3000.0, ge=0, le=MAX_RETRY_MS, description="reconnection "
                            "time (the SSE retry: field; 3 s is Chromium's default, the "
                            "spec leaves it to the browser)")
    detect_ms: float = Field(0.0, ge=0, le=MAX_RETRY_MS, description="from a network drop "
                             "to the client noticing it (0: a reset it sees at once)")
    drop_per_s: float = Field(0.0, ge=0, le=MAX_DROP_PER_S, description="drops per second "
                              "of streaming, per stream (Poisson)")
    drops_at_s: list[float] = Field(default_factory=list, max_length=1000,
                                    description="times at which every open stream drops "
                                    "(a network blip, a proxy restart)")
    max_reconnects: int = Field(5, ge=0, le=100, description="per request; a drop past "
                                "them loses the stream (the request is cancelled)")

    @field_validator("drops_at_s")
    @classmethod
    def _times(cls, v: list[float]) -> list[float]:
        bad = [t for t in v if not 0 <= t <= MAX_DROP_AT_S]
        if bad:
            raise ValueError(f"drops_at_s must hold times of 0..{MAX_DROP_AT_S:g} s, "
                             f"not {bad[0]!r}")
        return sorted(v)

    @property
    def drops(self) -> bool:
        """True when the network can drop a stream (drawn or scheduled drops)."""
        return self.drop_per_s > 0 or bool(self.drops_at_s)
