"""How a request (logical) of a run with traffic control ended: the gateway's outcome
codes, in their own module so that what the gateway calls (client patience, replica
faults, routing) can read them without importing the gateway back.

A client that gives up does so on a timer (connect, read, deadline): ``timed_out``.
``cancelled`` (a client's own disconnect) is the per-request stream model's
(``stream.disconnect``), which the gateway does not run. ``failed``: lost to a replica
failure (``cluster.faults``).
"""
from __future__ import annotations

OUTCOMES = ("completed", "rejected", "timed_out", "cancelled", "unfinished", "failed")
DONE, REJECTED, TIMED_OUT, CANCELLED, UNFINISHED, FAILED = range(6)
