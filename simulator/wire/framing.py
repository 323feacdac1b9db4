"""Bytes a streaming transport adds around each event: SSE's field syntax or a
WebSocket frame header (``stream.framing``)."""
from __future__ import annotations

from typing import Optional

FRAMINGS = ("sse", "websocket")
SSE_PREFIX, SSE_SUFFIX = len(b"data: "), len(b"\n\n")


def framing_bytes(framing: Optional[str], payload: float) -> float:
    """Bytes on the wire of one event carrying ``payload`` bytes (JSON + text).

    ``sse``: ``data: `` + payload + ``\\n\\n`` (WHATWG HTML, server-sent events: one
    ``data`` field line, an event ends at a blank line), 8 bytes. ``websocket``: a
    server-to-client frame is unmasked (RFC 6455 sec. 5.1), so its header is 2 bytes
    for a payload of up to 125 bytes, 4 up to 65,535 and 10 beyond (sec. 5.2; the
    4-byte masking key of the 2-14 range is only on client-to-server frames).
    ``None``: the payload already counts the envelope (``frame_overhead_bytes``)."""
    if framing is None:
        return payload
    if framing == "sse":
        return SSE_PREFIX + payload + SSE_SUFFIX
    return payload + (2 if payload <= 125 else 4 if payload <= 65535 else 10)
