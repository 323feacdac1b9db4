"""Clients that act on the published wait estimate (``cluster.patience``): past their
``wait_patience_s`` they give up, go to the replica with the least estimate, or come
back later; checked against the estimates the run published, exactly."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import make_scenario
from simulator.loops.simulate import simulate
from simulator.wire import clients as C

PATIENCE = 1.0


def _run(on_long_wait=None, replicas=1, router="round_robin", rate=40.0, **client):
    """300 small requests at 40/s on a replica that serves ~15/s: waits grow to seconds."""
    wl = {"kind": "synthetic", "num_requests": 300, "arrival": {"kind": "poisson", "rate": rate},
          "prompt_tokens": {"kind": "uniform", "low": 50, "high": 400},
          "output_tokens": {"kind": "uniform", "low": 20, "high": 200}}
    cl = {"read_timeout_s": None, "retry": None, **client}
    if on_long_wait is not None:
        cl.update(wait_patience_s=PATIENCE, on_long_wait=on_long_wait)
    sc = make_scenario(workload=wl, client=cl, cluster={"replicas": replicas, "router": router})
    return simulate(sc)


def _attempts(res):
    t = res.meta["attempts"]
    return {k: np.asarray(v) for k, v in t.items()}


def test_impatient_clients_give_up_exactly_when_the_estimate_is_past_patience():
    base, res = _run(), _run("give_up")
    rec = res.rec
    est = rec.wait_estimate
    balked = est > PATIENCE
    assert balked.any() and not balked.all()
    # Each balked request ended timed out, its one attempt 'balked'; the others ran.
    np.testing.assert_array_equal(rec.timed_out, balked)
    att = _attempts(res)
    np.testing.assert_array_equal(att["outcome"] == C.BALKED, balked[att["rid"]])
    assert res.meta["traffic"]["balked"] == balked.sum()
    assert np.isfinite(rec.last_delivered[~balked]).all()
    # Those that stayed waited less than anyone waited without patience (the queue is
    # shorter by the requests that left).
    w = (rec.scheduled - rec.enqueued)[~balked]
    assert np.median(w) < np.median(base.rec.scheduled - base.rec.enqueued)


def test_clients_that_come_back_later_do_so_after_come_back_s():
    res = _run("later", come_back_s=2.0, max_come_backs=2)
    att = _attempts(res)
    order = np.lexsort((att["sent"], att["rid"]))
    rid, sent, end, out = (att[k][order] for k in ("rid", "sent", "end", "outcome"))
    again = (rid[1:] == rid[:-1])
    assert again.any()
    # Every next attempt is sent 2 s after its client heard the estimate of a balked one.
    assert (out[:-1][again] == C.BALKED).all()
    np.testing.assert_allclose(sent[1:][again] - end[:-1][again], 2.0, atol=1e-9)
    assert res.meta["traffic"]["came_back"] == again.sum()
    assert res.rec.attempts.max() <= 3          # the first and two come-backs
    # Who came back at most twice and was still told too long gave up.
    gave_up = res.rec.timed_out
    assert (res.rec.attempts[gave_up] == 3).all()


def test_clients_go_elsewhere_to_the_replica_with_the_least_estimate():
    # Two replicas at 60/s (near their capacity): a random router loads them unevenly, so
    # a client told too long a wait on one often finds the other within its patience.
    give_up = _run("give_up", replicas=2, router="random", rate=60.0)
    moved = _run("elsewhere", replicas=2, router="random", rate=60.0)
    tr = moved.meta["traffic"]
    assert tr["moved_elsewhere"] > 0
    # Nobody that stayed was told more than its patience (it moved within it or left).
    stayed = ~moved.rec.timed_out
    assert (moved.rec.wait_estimate[stayed] <= PATIENCE).all()
    assert moved.rec.timed_out.sum() < give_up.rec.timed_out.sum()


@pytest.mark.parametrize("bad, msg", [({"wait_patience_s": -1}, "wait_patience_s"),
                                      ({"on_long_wait": "sulk"}, "on_long_wait")])
def test_bad_patience_settings_are_errors(bad, msg):
    from pydantic import ValidationError
    with pytest.raises((ValidationError, Exception), match=msg):
        make_scenario(client={"wait_patience_s": 1.0, **bad})
