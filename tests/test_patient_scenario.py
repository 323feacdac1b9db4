"""The shipped scenario of clients that act on the wait estimate
(``scenarios/patient-clients.yaml``, ``cluster.patience``): in each run where clients act
on it (give up, go elsewhere, come back later) the published ``work`` estimate's median is
within 20% of the median queue wait of the requests that completed (issue 32 item 5's
bar), and each run's clients did what their ``on_long_wait`` says, checked against the
estimates the run published."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import REPO
from simulator.config.scenario import load_scenario
from simulator.loops.simulate import simulate
from simulator.report.metrics import add_derived, requests_table

PATH = REPO / "scenarios" / "patient-clients.yaml"


def _run(label: str):
    sc, base = load_scenario(PATH, [])
    psc = dict(sc.policy_runs())[label]
    res = simulate(psc, base_dir=base)
    return psc, res, add_derived(requests_table(res))


# Measured (median estimate / median wait of the completed requests, seed 7):
#   give-up 1.077 (4.19 s vs 3.89 s), elsewhere 1.094 (4.68 s vs 4.28 s),
#   later 1.100 (4.80 s vs 4.37 s); patient (not run here: 13 s) 1.082 (20.6 vs 19.0 s).
@pytest.mark.parametrize("label", ["give-up", "elsewhere", "later"])
def test_the_estimate_median_is_within_20_percent_where_clients_act_on_it(label):
    psc, res, df = _run(label)
    ok = df["finished"] & np.isfinite(df["wait_estimate"])
    est, act = df.loc[ok, "wait_estimate"].median(), df.loc[ok, "t_queue"].median()
    # Waits of seconds (the queue the overload builds, held near the patience by the
    # clients that leave): a 20% bar is not lost in the one-step granularity of a wait.
    assert act > 1.0
    assert abs(est / act - 1.0) <= 0.20, (label, est, act)
    tr = res.meta["traffic"]
    patience = psc.client.wait_patience_s
    # Whoever completed was last told a wait within its patience (else it acted on it).
    assert (df.loc[df["finished"], "wait_estimate"] <= patience).all()
    if label == "give-up":
        # Exactly the requests told more than their patience left (timed out, balked).
        np.testing.assert_array_equal(df["timed_out"], df["wait_estimate"] > patience)
        assert tr["balked"] == int(df["timed_out"].sum()) > 0
    elif label == "elsewhere":
        assert tr["moved_elsewhere"] > 0
    else:
        assert tr["came_back"] > 0
        assert df["attempts"].max() <= 1 + psc.client.max_come_backs
