"""Regions, region-aware routing and HTTP/2 connections: the topology built from the
config, the routers' rules against fake replicas, and both in whole runs."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from conftest import ZERO_NET, make_scenario, make_scenario_dict, make_workload
from simulator.config.scenario import validate_scenario
from simulator.errors import LatsimError
from simulator.report.metrics import requests_table
from simulator.wire.network import ConnectionPools, H2Connections, Topology, split_by_shares
from simulator.cluster.routers import make_router
from simulator.loops.simulate import simulate

# Two serving regions, three client regions: New York is near us-east, Paris near
# eu-west, Chicago in between but nearer us-east.
REGIONS = {
    "serving": [{"name": "us-east", "replicas": 2}, {"name": "eu-west", "replicas": 1}],
    "clients": [
        {"name": "new-york", "share": 2, "distance_km": {"us-east": 300, "eu-west": 5800}},
        {"name": "paris", "share": 1, "distance_km": {"us-east": 6200, "eu-west": 350}},
        {"name": "chicago", "share": 1, "distance_km": {"us-east": 1100, "eu-west": 6600}},
    ],
}


def net(**kw) -> dict:
    """ZERO_NET with 8 clients; with regions, whose clients carry the distances."""
    base = {**ZERO_NET, "clients": 8}
    if "regions" in kw:
        base.pop("distance_km")
    return {**base, **kw}


def fake_replicas(*loads):
    return [SimpleNamespace(outstanding_tokens=v) for v in loads]


def topology(regions=REGIONS, clients=8, replicas=3, **netkw):
    sc = make_scenario(network=net(regions=regions, **netkw),
                       cluster={"replicas": replicas})
    return Topology.from_config(sc.network, clients, replicas)


def test_topology_from_config():
    topo = topology()
    assert list(topo.replica_region) == [0, 0, 1]
    assert topo.region_replicas == ((0, 1), (2,))
    # 8 clients split 2:1:1 in index order.
    assert list(topo.client_region) == [0, 0, 0, 0, 1, 1, 2, 2]
    assert topo.rtt[1, 1] == pytest.approx(2 * 350 / 200_000)      # base RTT 0 here
    assert topo.timing[0][1].one_way == pytest.approx(5800 / 200_000)
    assert list(split_by_shares(10, np.array([1.0, 1.0, 1.0]))) == [4, 3, 3]
    with pytest.raises(LatsimError, match=r"network.regions.serving.*3 replicas.*has 4"):
        topology(replicas=4)


def test_nearest_region_router_picks_the_nearest_then_the_least_loaded_there():
    topo = topology()
    r = make_router("nearest_region", 3, None, topology=topo)
    assert [r.pick_region(fake_replicas(0, 0, 0), cr) for cr in range(3)] == [0, 1, 0]
    # Load does not move it; inside the region the least loaded replica wins.
    assert r.pick_region(fake_replicas(10**6, 10**6, 0), 0) == 0
    assert r.pick_in(fake_replicas(500, 100, 0), 0) == 1
    assert r.pick_in(fake_replicas(500, 100, 0), 1) == 2


def test_load_rtt_router_spills_only_when_the_near_region_is_loaded():
    topo = topology()
    r = make_router("region_load_rtt", 3, None, topology=topo)
    # New York: RTT 3 ms to us-east, 58 ms to eu-west; 50 tokens per ms of RTT.
    pen = (topo.rtt[0] * 1000 * 50)
    extra = pen[1] - pen[0]                         # 2750 tokens
    assert extra == pytest.approx(2750)
    assert r.pick_region(fake_replicas(0, 0, 0), 0) == 0
    below = extra - 1
    assert r.pick_region(fake_replicas(below, below + 5, 0), 0) == 0
    above = extra + 1
    assert r.pick_region(fake_replicas(above, above + 5, 0), 0) == 1
    # One idle replica in us-east is enough to keep New York there.
    assert r.pick_region(fake_replicas(10**6, 0, 0), 0) == 0
    # Paris spills to us-east only past its own (opposite) threshold.
    assert r.pick_region(fake_replicas(0, 0, 2000), 1) == 1
    assert r.pick_region(fake_replicas(0, 0, 6000), 1) == 0
    # Without regions both routers are least-outstanding over every replica.
    flat = make_router("region_load_rtt", 3, None)
    assert flat.pick(fake_replicas(5, 1, 3), SimpleNamespace(client=7)) == 1


def test_nearest_routing_in_a_run_sends_each_client_to_its_nearest_region():
    sc = make_scenario(network=net(regions=REGIONS, tls="1.3"),
                       cluster={"replicas": 3, "router": "nearest_region"})
    res = simulate(sc, 0, workload=make_workload(120, rate=20.0, prompt=100, output=8))
    df = requests_table(res)
    topo = Topology.from_config(sc.network, 8, 3)
    region = topo.replica_region[df["replica"].to_numpy()]
    assert set(np.unique(region)) == {0, 1}
    assert res.meta["network"]["requests_per_region"]["eu-west"] > 0
    # The client of a request is not in the table, but the RTT it paid is: on a reused
    # connection T_net is exactly the one-way latency, and it is always that of a
    # nearest-region pair (New York or Chicago to us-east, Paris to eu-west).
    near_ow = {topo.timing[0][0].one_way, topo.timing[1][1].one_way, topo.timing[2][0].one_way}
    reused = df[~df["new_connection"]]
    assert set(np.round(reused["t_net"], 12)) <= set(np.round(list(near_ow), 12))


def test_load_rtt_routing_in_a_run_spills_under_load_only():
    regions = {"serving": [{"name": "near", "replicas": 1}, {"name": "far", "replicas": 1}],
               "clients": [{"name": "here", "share": 1,
                            "distance_km": {"near": 100, "far": 3000}}],
               "rtt_penalty_tokens_per_ms": 20}
    sc = make_scenario(network=net(regions=regions),
                       cluster={"replicas": 2, "router": "region_load_rtt"})
    light = simulate(sc, 0, workload=make_workload(60, rate=0.5, prompt=200, output=20))
    assert (light.rec.replica == 0).all()
    heavy = simulate(sc, 0, workload=make_workload(300, rate=5.0, prompt=1500, output=60))
    far = heavy.rec.replica == 1
    assert 0 < far.sum() < len(far) / 2       # the near region still takes most
    heavier = simulate(sc, 0, workload=make_workload(300, rate=20.0, prompt=1500, output=60))
    assert (heavier.rec.replica == 1).sum() > far.sum()
    # The far region's requests paid its RTT: 2 x 3000 km / 200,000 km/s = 30 ms.
    df = requests_table(heavy)
    reused = df[~df["new_connection"] & far]
    np.testing.assert_allclose(reused["t_net"], 0.015)


def test_h2_opens_one_connection_per_client_per_keepalive_period():
    h2 = H2Connections(n_clients=2, max_streams=100, keepalive_s=10.0, reuse=True)
    assert h2.acquire(0, 0.0, handshake=0.03) == (True, True)
    # A second stream while the handshake is in progress waits for the rest of it.
    assert h2.acquire(0, 0.01, handshake=0.03) == (False, True)
    assert h2.setup_wait(0, 0.01, 0.03) == pytest.approx(0.02)
    assert h2.setup_wait(0, 0.05, 0.03) == 0.0
    h2.release(0, 1.0, True)
    h2.release(0, 2.0, True)
    assert h2.acquire(0, 11.5, handshake=0.03) == (False, True)   # idle 9.5 s: still open
    h2.release(0, 12.0, True)
    assert h2.acquire(0, 22.5, handshake=0.03) == (True, True)    # idle 10.5 s: expired
    assert h2.acquire(1, 0.0) == (True, True)
    assert (h2.new_connections, h2.reused_connections) == (3, 2)
    tiny = H2Connections(n_clients=1, max_streams=2, keepalive_s=10.0, reuse=True)
    assert [tiny.acquire(0, 0.0) for _ in range(3)] == [(True, True), (False, True), (True, False)]


def test_h2_in_a_run_one_connection_per_client_http11_opens_more():
    workload = make_workload(300, rate=40.0, prompt=100, output=40)
    base = dict(tls="1.3", base_rtt_ms=20, clients=4, keepalive_s=300.0)
    h2 = simulate(make_scenario(network=net(protocol="http2", **base)), 0, workload=workload)
    h1 = simulate(make_scenario(network=net(**base)), 0, workload=workload)
    assert h2.connections["new"] == 4 and h2.connections["reused"] == 296
    assert h1.connections["new"] > 4      # concurrent requests need concurrent connections
    # Short keep-alive, sparse traffic: a new connection exactly when a client was idle
    # for longer than the keep-alive period.
    sparse = make_workload(40, rate=0.2, prompt=50, output=4, seed=2)
    sc = make_scenario(network=net(protocol="http2", **{**base, "keepalive_s": 8.0}))
    res = simulate(sc, 0, workload=sparse)
    df = requests_table(res)
    assert res.connections["new"] < 40
    assert res.connections["new"] + res.connections["reused"] == 40
    assert df["finished"].all()


def test_h1_pool_discard_on_disconnect():
    pools = ConnectionPools(n_clients=1, pool_size=1, keepalive_s=10.0, reuse=True)
    assert pools.acquire(0, 0.0) == (True, True)
    pools.release(0, 1.0, True)
    pools.discard(0, 1.0)                  # the client closed it after its response
    assert pools.acquire(0, 2.0) == (True, True)   # a fresh one (the pool had room)


def test_region_config_errors_are_one_line():
    bad_dist = {**REGIONS, "clients": [{"name": "x", "share": 1, "distance_km": {"us-east": 1}}]}
    cases = [
        (net(regions=bad_dist), r"distance_km to exactly the serving regions"),
        (net(regions=REGIONS, distance_km=900), r"either distance_km or regions"),
        (net(regions={**REGIONS, "serving": [{"name": "a", "replicas": 1},
                                             {"name": "a", "replicas": 1}]}), r"repeat"),
        (net(protocol="http3"), r"network.protocol"),
        (net(regions={**REGIONS, "clients": [{"name": "x", "share": 0,
                                              "distance_km": {"us-east": 1, "eu-west": 2}}]}),
         r"share"),
    ]
    for network, pat in cases:
        with pytest.raises(LatsimError, match=pat):
            validate_scenario(make_scenario_dict(network=network))
    # A resolved (dumped) scenario with regions loads again.
    sc = make_scenario(network=net(regions=REGIONS), cluster={"replicas": 3})
    assert validate_scenario(sc.model_dump(mode="json")).network.regions is not None
