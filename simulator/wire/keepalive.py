"""The keep-alive connection pool's rules, written once for every event loop.

Each client's pool is a row of three arrays: ``idle[c, :n_idle[c]]``, the times at
which its idle pooled connections became idle (in the order they were released), and
``n_open[c]``, how many pooled connections it has open (busy or idle). A pooled
connection is busy from its request's send until its response is delivered, then idle;
an idle one expires (the server closes it) once it has been idle longer than the
keep-alive; a request takes the warmest idle one (the one idle most recently), else
opens a pooled one while the pool has room, else a one-off connection that is not kept.
An HTTP client with a bounded keep-alive pool behaves so.

The SimPy model's ``network.ConnectionPools`` keeps its pools in these arrays and calls
these kernels; the compiled loop calls them on the same arrays. A row never holds more
idle connections than the pool's size, so ``size`` columns are enough.
"""
from __future__ import annotations

from simulator.kernel import kernel

REUSED, NEW_POOLED, NEW_ONE_OFF = 0, 1, 2


@kernel
def pool_acquire(idle, n_idle, n_open, c, now, keepalive, size, reuse):
    """Client ``c`` takes a connection at ``now``: ``REUSED`` (an idle pooled one, no
    handshake), ``NEW_POOLED`` (a new one the pool keeps) or ``NEW_ONE_OFF`` (a new one
    that is closed after its response: the pool is full, or pools are off). Expired idle
    connections leave the pool on the way."""
    if not reuse:
        return NEW_ONE_OFF
    best = -1
    i = 0
    while i < n_idle[c]:
        t = idle[c, i]
        if t <= now and now - t > keepalive:
            # Expired while idle: the server closed it.
            for j in range(i, n_idle[c] - 1):
                idle[c, j] = idle[c, j + 1]
            n_idle[c] -= 1
            n_open[c] -= 1
            continue
        if t <= now and (best < 0 or t > idle[c, best]):
            best = i
        i += 1
    if best >= 0:
        for j in range(best, n_idle[c] - 1):
            idle[c, j] = idle[c, j + 1]
        n_idle[c] -= 1
        return REUSED
    if n_open[c] < size:
        n_open[c] += 1
        return NEW_POOLED
    return NEW_ONE_OFF


@kernel
def pool_release(idle, n_idle, c, free_at, pooled, reuse):
    """A pooled connection of client ``c`` is idle again from ``free_at`` (its response
    delivered); a one-off connection just closes."""
    if pooled and reuse:
        idle[c, n_idle[c]] = free_at
        n_idle[c] += 1


@kernel
def pool_discard(idle, n_idle, n_open, c, idle_at, was_idle):
    """Client ``c`` closed one of its pooled connections (it disconnected): it leaves
    the pool; ``was_idle``: it had been released, idle since ``idle_at``."""
    if was_idle:
        for i in range(n_idle[c]):
            if idle[c, i] == idle_at:
                for j in range(i, n_idle[c] - 1):
                    idle[c, j] = idle[c, j + 1]
                n_idle[c] -= 1
                break
    n_open[c] -= 1


@kernel(inline=True)
def request_net_s(send_s, handshake_s, is_new, setup_wait_s):
    """``T_net`` of a request: one-way travel, upload and gateway (``send_s``), after the
    handshake when it opens a new connection, else after what is left of its shared
    connection's set-up (``setup_wait_s``: HTTP/2; 0 for a pooled HTTP/1.1 one)."""
    return send_s + (handshake_s if is_new else setup_wait_s)
