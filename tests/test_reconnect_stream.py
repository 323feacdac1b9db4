"""One stream's drops and reconnections (``wire.streamdrop``) without an engine: token
arrival times after a resume against the frame arithmetic, and the drawn drops against
their law (a Poisson process over the seconds of streaming)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from simulator.wire.clientstream import ClientStream, StreamParams
from simulator.wire.reconnect import StreamPlan

OW = 0.01                    # one way
TX = 100 * 8 / 1e6           # a 100-byte frame on 1 Mb/s: 0.8 ms
DT = 0.005                   # the engine makes a token every 5 ms (slower than TX)


def _stream(plan=None, every_tokens=1):
    p = StreamParams(frame_overhead_bytes=96.0, bytes_per_token=4.0, downlink_bps=1e6,
                     every_tokens=every_tokens, one_way=OW)
    st = ClientStream(p, 0.0)
    drops = []
    if plan is not None:
        st.attach_reconnect(plan, on_drop=lambda *a: drops.append(a))
    return st, drops


def _plan(mode="resume", scheduled=(), draws=None, gap=0.2, detect=0.05, max_rc=5):
    return StreamPlan(mode, detect, gap, max_rc, draws, tuple(scheduled))


def test_resume_replays_the_lost_frames_then_streams_live():
    n, t_d = 100, 0.2013
    st, drops = _stream(_plan(scheduled=[t_d]))
    for k in range(n):
        st.emit(k * DT)
    r = st.close((n - 1) * DT)
    # Token k's frame leaves at k*DT + TX and arrives OW later: those arriving by the
    # drop are delivered; the rest (in flight, and made while the client is away) are
    # written again when the reconnection reaches the server, t_s = drop + detect + gap,
    # back to back; the later ones as made.
    t_s = t_d + 0.05 + 0.2
    delivered = [k for k in range(n) if k * DT + TX + OW <= t_d]
    want, depart = [], -math.inf
    for k in range(n):
        if k in delivered:
            want.append(k * DT + TX + OW)
            continue
        depart = max(t_s if k * DT < t_s else k * DT, depart) + TX
        want.append(depart + OW)
    got = np.concatenate([[r.first_arrival], r.first_arrival + np.cumsum(r.gaps)])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert r.tokens_delivered == r.tokens_emitted == n and r.drops == 1
    assert r.replayed_tokens == sum(1 for k in range(n) if k not in delivered and k * DT < t_s)
    assert r.reconnect_s == pytest.approx(0.25, abs=1e-12)
    assert len(drops) == 1 and drops[0][2] is True      # resumed


def test_coalesced_frames_are_replayed_as_written():
    st, _d = _stream(_plan(scheduled=[0.1013]), every_tokens=4)
    for k in range(80):
        st.emit(k * DT)
    r = st.close(79 * DT)
    # Every frame, replayed or not, carries its 4 tokens (they arrive together).
    arr = np.concatenate([[r.first_arrival], r.first_arrival + np.cumsum(r.gaps)])
    _vals, counts = np.unique(np.round(arr, 12), return_counts=True)
    assert r.tokens_delivered == 80 and (counts == 4).all() and len(counts) == 20
    assert r.replayed_tokens % 4 == 0 and r.replayed_tokens > 0


def test_drawn_drops_follow_the_poisson_law_over_streaming_seconds():
    # Mode none: a stream drops at most once, at (first arrival) + Exp(rate) if that is
    # before its last arrival. P(drop) = 1 - exp(-rate x (last - first arrival)).
    rate, n_streams = 0.8, 2000
    rng = np.random.default_rng(3)
    draws = rng.exponential(1 / rate, size=(n_streams, 1))
    lengths = rng.integers(20, 400, size=n_streams)
    dropped, p = 0, []
    for i in range(n_streams):
        st, drops = _stream(_plan(mode="none", draws=draws[i], max_rc=0))
        for k in range(lengths[i]):
            st.emit(k * DT)
        st.close((lengths[i] - 1) * DT)
        dropped += len(drops)
        p.append(1 - math.exp(-rate * (lengths[i] - 1) * DT))
    p = np.asarray(p)
    # A sum of independent Bernoulli draws: within 4 standard deviations of its mean.
    assert abs(dropped - p.sum()) <= 4 * math.sqrt((p * (1 - p)).sum()), (dropped, p.sum())
