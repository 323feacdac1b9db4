"""A mixed fleet (``cluster.pools``, issue 18 item 6): replicas of different GPU types
behind one router, each pool on its own cost model, KV capacity and price."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from conftest import make_scenario
from loopcheck import assert_identical
from simulator.config.scenario import validate_scenario
from simulator.errors import LatsimError
from simulator.loops.simulate import kv_capacity_blocks, simulate
from simulator.report.output import run_outputs, series_table

H100 = {"kind": "roofline", "gpu": "h100-80gb", "tp": 1}
A100 = {"kind": "roofline", "gpu": "a100-80gb", "tp": 1}
L40S = {"kind": "roofline", "gpu": "l40s", "tp": 1}


def workload(n=500, rate=30.0) -> dict:
    return {"kind": "synthetic", "num_requests": n,
            "arrival": {"kind": "poisson", "rate": rate},
            "prompt_tokens": {"kind": "uniform", "low": 200, "high": 1500},
            "output_tokens": {"kind": "uniform", "low": 20, "high": 200}}


def fleet(router="least_outstanding", pools=None, seed=1, n=500, rate=30.0, **over):
    """Llama-3-8B on one H100 and one A100 replica (roofline), KV from each memory plan."""
    pools = pools if pools is not None else [
        {"name": "h100", "replicas": 1, "cost": H100, "gpu_cost_per_hour": 4.0},
        {"name": "a100", "replicas": 1, "cost": A100, "gpu_cost_per_hour": 2.0}]
    cluster = {"router": router, "pools": pools, **over.pop("cluster", {})}
    return make_scenario(seed=seed, workload=workload(n, rate),
                         engine={"policy": "chunked", "max_num_seqs": 32,
                                 "max_num_batched_tokens": 512},
                         model={"name": "llama-3-8b", "cost": H100},
                         cluster=cluster, **over)


@pytest.fixture(scope="module")
def runs():
    """The same traffic on round robin and least-outstanding, utilisation on."""
    out = {}
    for router in ("round_robin", "least_outstanding"):
        res = simulate(fleet(router, report={"utilization": True, "window_s": 2.0}))
        out[router] = (res, *run_outputs(res))
    return out


def test_each_pool_steps_on_its_own_cost_model_and_memory_plan(runs):
    """Round robin gives each pool half the requests: the H100 does the same work in
    less busy time (lower busy fraction, its steps are shorter) and answers sooner; each
    pool's KV capacity is its own GPU's memory plan; the time series names the pool."""
    res, _df, out = runs["round_robin"]
    pools = out["cluster"]["pools"]
    h, a = pools["h100"], pools["a100"]
    assert h["requests_served"] == a["requests_served"] == 250
    assert h["gpu"] == "h100-80gb" and a["gpu"] == "a100-80gb"
    assert h["busy_frac_mean"] < 0.8 * a["busy_frac_mean"]
    assert h["p99_ttft_ms"] < a["p99_ttft_ms"]
    ts = series_table(res)
    reps = ts[ts["replica"] >= 0]
    assert set(reps["pool"]) == {"h100", "a100"}
    busy = reps.groupby("pool")["busy_frac"].mean()
    assert busy["h100"] < busy["a100"]
    # KV capacity: each pool's memory plan (80 GB H100 and A100 differ by their usable bytes;
    # an L40S, 48 GB, holds far fewer blocks).
    caps = {k: v["kv_capacity_blocks"] for k, v in pools.items()}
    assert caps["h100"] != caps["a100"]
    small = fleet(pools=[{"name": "h100", "replicas": 1, "cost": H100},
                         {"name": "l40s", "replicas": 1, "cost": L40S}])
    from simulator.cluster.pools import plan_pools
    p = {q.name: q.capacity for q in plan_pools(small)}
    assert p["l40s"] < 0.6 * p["h100"]
    assert kv_capacity_blocks(small) == p["h100"]
    frac = reps["kv_blocks_reserved"] / reps["pool"].map(caps)
    np.testing.assert_allclose(reps["kv_reserved_frac"], frac)


def test_a_load_aware_router_sends_more_to_the_faster_pool(runs):
    rr = runs["round_robin"][2]["cluster"]["pools"]
    lo = runs["least_outstanding"][2]["cluster"]["pools"]
    assert rr["h100"]["completed_share"] == pytest.approx(0.5)
    assert lo["h100"]["completed_share"] > 0.55
    assert lo["h100"]["requests_completed"] > lo["a100"]["requests_completed"]
    # Served where they completed (no retries here).
    for pools in (rr, lo):
        assert sum(p["requests_completed"] for p in pools.values()) == 500


def test_gpu_hours_and_cost_per_pool_add_up_to_the_cluster(runs):
    for _res, _df, out in runs.values():
        cl = out["cluster"]
        pools = cl["pools"].values()
        assert cl["gpu_hours"] == pytest.approx(sum(p["gpu_hours"] for p in pools))
        assert cl["cost_usd"] == pytest.approx(sum(p["cost_usd"] for p in pools))
        end = out["run"]["sim_end_s"]
        for p in pools:
            assert p["gpu_hours"] == pytest.approx(p["replicas_start"] * end / 3600.0)
        assert cl["pools"]["h100"]["cost_usd"] == pytest.approx(
            2 * cl["pools"]["a100"]["cost_usd"])   # $4 vs $2, same hours
        assert cl["replicas_max"] == 2


def test_conservation_and_kv_returns_to_zero(monkeypatch):
    """Every request ends once (``outcomes`` add up), KV and queues empty at the end,
    with admission, timeouts and retries on a mixed fleet."""
    import simulator.loops.traffic as T
    seen = {}

    class Fleet(T.Fleet):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen["fleet"] = self

    monkeypatch.setattr(T, "Fleet", Fleet)
    sc = fleet(n=600, rate=80.0,
               cluster={"admission": {"classes": {"default": {"max_queue": 8}}}},
               client={"read_timeout_s": 3.0, "retry": {"max_retries": 2, "budget": None}})
    res = simulate(sc)
    df, out = run_outputs(res)
    o = out["overall"]
    assert sum(o["outcomes"].values()) == 600
    assert o["outcomes"]["completed"] < 600          # the limits did bite
    assert o["outcomes"]["cancelled"] == 0           # the traffic model's clients time out
    assert o["outcomes"]["timed_out"] == o["timed_out"]
    assert o["outcomes"]["rejected"] == o["rejected"]
    for rep in seen["fleet"].built:
        assert rep.kv.manager.num_used == 0
        assert not (rep.waiting or rep.decoding or rep.prefilling or rep.swapped)
    pools = out["cluster"]["pools"]
    assert sum(p["requests_completed"] for p in pools.values()) == o["outcomes"]["completed"]
    assert sum(p["requests_served"] for p in pools.values()) == out["traffic"]["admitted"]


def test_the_autoscaler_scales_the_pool_it_names(monkeypatch):
    import simulator.loops.traffic as T
    seen = {"provisioned": []}

    class Fleet(T.Fleet):
        def provision(self, delay):
            slot = super().provision(delay)
            seen["provisioned"].append(slot)
            return slot

    monkeypatch.setattr(T, "Fleet", Fleet)
    sc = fleet(n=800, rate=60.0, cluster={"autoscaler": {
        "pool": "h100", "min_replicas": 1, "max_replicas": 3, "metric": "queue",
        "target": 2.0, "window_s": 2, "interval_s": 1, "model_load_s": 1, "warmup_s": 1,
        "scale_down_cooldown_s": 5}})
    res = simulate(sc)
    _df, out = run_outputs(res)
    cl = out["cluster"]
    assert cl["autoscaled_pool"] == "h100" and cl["pools"]["h100"]["autoscaled"]
    # h100's slots are 0..2 (slot 0 may drain and start again), a100's replica slot 3.
    assert seen["provisioned"] and set(seen["provisioned"]) <= {0, 1, 2}
    assert cl["pools"]["a100"]["gpu_hours"] == pytest.approx(res.sim_end / 3600.0)
    assert cl["pools"]["h100"]["gpu_hours"] > res.sim_end / 3600.0
    assert cl["gpu_hours"] == pytest.approx(sum(p["gpu_hours"] for p in cl["pools"].values()))


def test_deterministic_per_seed():
    a, b, c = (run_outputs(simulate(fleet(seed=s, n=300)))[1] for s in (3, 3, 4))
    assert json.dumps(a, default=str) == json.dumps(b, default=str)
    assert a["overall"]["p99_ttft_ms"] != c["overall"]["p99_ttft_ms"]


def test_one_pool_of_the_model_cost_is_the_plain_cluster_bit_for_bit():
    """A single pool of ``model.cost`` replicas runs the plain model's events (the
    traffic model with nothing configured is the plain one, bit for bit), and a cluster
    without pools is untouched."""
    from conftest import make_profile  # noqa: F401  (the default test profile)
    plain = make_scenario(cluster={"replicas": 2, "router": "least_outstanding"})
    pooled = make_scenario(cluster={"router": "least_outstanding",
                                    "pools": [{"name": "only", "replicas": 2}]})
    assert pooled.cluster.replicas == 2
    a, b = simulate(plain, loop="simpy"), simulate(pooled)
    assert "replica pools" in b.meta["loop"]
    assert_identical(a, b)
    assert a.kv_capacity_blocks == b.kv_capacity_blocks
    assert "pools" not in run_outputs(a)[1]["cluster"]


@pytest.mark.parametrize("pools, msg", [
    ([{"name": "x", "replicas": 1}, {"name": "x", "replicas": 1}], "used twice"),
    ([{"name": "x", "replicas": 0}], "no replica"),
    ([{"name": "x", "replicas": 1, "cost": {"kind": "roofline", "gpu": "h100-80gb", "tp": 3}}],
     "cluster.pools['x'].cost"),
])
def test_bad_pools_fail_at_load(pools, msg):
    with pytest.raises(Exception) as e:
        fleet(pools=pools)
    assert msg in str(e.value)


def test_autoscaler_pool_must_be_a_pool():
    with pytest.raises(Exception, match="not a pool"):
        fleet(cluster={"autoscaler": {"pool": "b200", "max_replicas": 2, "target": 1}})
    with pytest.raises(Exception, match="cluster.pools is not given"):
        make_scenario(cluster={"autoscaler": {"pool": "h100", "max_replicas": 2,
                                              "target": 1}})


def test_a_pool_whose_model_does_not_fit_its_gpu_is_one_line_exit_2(tmp_path):
    from simulator.cli.main import app
    from conftest import make_scenario_dict
    data = make_scenario_dict(
        workload=workload(50), engine={"policy": "chunked"},
        model={"name": "llama-3-70b", "cost": {**H100, "tp": 4}},
        cluster={"pools": [{"name": "h100", "replicas": 1, "cost": {**H100, "tp": 4}},
                           {"name": "l4", "replicas": 1,
                            "cost": {"kind": "roofline", "gpu": "l4"}}]})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(LatsimError, match="pool 'l4'"):
        kv_capacity_blocks(validate_scenario(data))
    r = CliRunner().invoke(app, ["run", str(path)])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if "error" in ln]
    assert len(lines) == 1 and "cluster.pools.l4" in lines[0] and "pool 'l4'" in lines[0]


def test_shipped_scenario_loads():
    from simulator.config.scenario import load_scenario
    from conftest import REPO
    sc, _ = load_scenario(REPO / "scenarios" / "mixed-fleet.yaml", [])
    assert [p.name for p in sc.cluster.pools] == ["h100", "a100"]
    assert sc.cluster.replicas == 4
    runs = sc.policy_runs()
    assert [r.cluster.router for _l, r in runs] == ["round_robin", "least_outstanding"]
    assert all(r.cluster.pools for _l, r in runs)


def test_a_scale_up_while_slots_drain_starts_only_the_free_slots():
    """A draining replica keeps its slot until it empties: a decision that wants more
    replicas than there are free slots starts only the free ones (it crashed with
    StopIteration looking for a third free slot of three)."""
    import simpy

    from simulator.cluster.autoscaler import DRAINING, OFF, PROVISIONING, READY, Autoscaler, Fleet
    from simulator.config.traffic import AutoscalerConfig
    env = simpy.Environment()
    f = Fleet(env, lambda i: None, n_ready=2, n_slots=3)
    f._set(1, DRAINING)
    cfg = AutoscalerConfig(min_replicas=1, max_replicas=3, metric="queue", target=1.0)
    a = Autoscaler(env, cfg, f, 100, lambda now, w: [], lambda: True)
    a.metric = lambda now: 10.0        # ten times the target: wants every slot
    a._decide(1.0)
    assert f.state == [READY, DRAINING, PROVISIONING] and f.scale_ups == 1
    a._decide(2.0)                     # nothing free: nothing more to start
    assert f.scale_ups == 1 and OFF not in f.state
