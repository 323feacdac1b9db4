"""Disaggregated prefill/decode (issue 16 item 9; ``cluster.disagg``): prefill and decode
pools with a KV link between them, checked against closed forms (transfer time from the
model's KV bytes, zero-load TTFT and second token from the pools' own step costs), the
DistServe interference claim, conservation, bad input and the planner's split search."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from conftest import REPO as REPO_DIR, make_scenario, make_scenario_dict
from test_fuzz import run_cli
from simulator.cost import build_cost_model
from simulator.loops.simulate import simulate
from simulator.report.output import run_outputs

H100_TP4 = {"kind": "roofline", "gpu": "h100-80gb", "tp": 4}
H100 = {"kind": "roofline", "gpu": "h100-80gb", "tp": 1}
SPLIT = [{"name": "pre", "role": "prefill", "replicas": 1},
         {"name": "dec", "role": "decode", "replicas": 1}]
NET = {"distance_km": 500, "tls": "1.3"}    # a network that takes time


def one_request(prompt: int, output: int, pools=SPLIT, link=None, net=NET, n=1, rate=1.0):
    """One Llama-2-70B request (or ``n``) on H100s at TP4 (roofline), whole-prompt
    prefill; ``net`` None: no network time."""
    cluster = {"pools": pools, **({"kv_transfer": link} if link else {})}
    return make_scenario(
        **({"network": net} if net else {}),
        workload={"kind": "synthetic", "num_requests": n, "arrival": {"kind": "poisson",
                                                                      "rate": rate},
                  "prompt_tokens": {"kind": "constant", "value": prompt},
                  "output_tokens": {"kind": "constant", "value": output}},
        engine={"policy": "fifo", "max_num_seqs": 32, "max_num_batched_tokens": 4096},
        model={"name": "llama-2-70b", "cost": H100_TP4}, cluster=cluster)


def test_kv_bytes_per_token_of_llama_2_70b_from_the_catalog():
    """2 (K and V) x 80 layers x 8 KV heads x 128 head dim x 2 bytes (bf16) = 327,680."""
    from simulator.cluster.disagg import kv_bytes_per_token
    from simulator.cost.catalog import model
    arch = model("llama-2-70b")
    assert (arch.layers, arch.kv_heads, arch.head_dim) == (80, 8, 128)
    assert 2 * 80 * 8 * 128 * 2 == 327_680
    assert kv_bytes_per_token(one_request(100, 2)) == 327_680
    fp8 = one_request(100, 2).model_copy(deep=True)
    fp8.model.cost.kv_dtype = "fp8"
    assert kv_bytes_per_token(fp8) == 163_840


def test_one_kv_bytes_rule_for_transfers_and_swap_blocks():
    """The transfer's bytes per token and a swap block's bytes come from one function
    (``loops.simulate.kv_bytes_per_token``): at TP4 each GPU holds 2 of the 8 KV heads,
    a quarter of the token; a model given by its shape has the shape's bytes."""
    import simulator.cluster.disagg as D
    from simulator.loops.simulate import kv_bytes_per_token, replica_kv_args
    assert D.kv_bytes_per_token is kv_bytes_per_token
    sc = one_request(100, 2)
    assert kv_bytes_per_token(sc, per_gpu=True) == 327_680 / 4
    assert replica_kv_args(sc)["block_bytes"] == 327_680 / 4 * sc.engine.kv.block_size
    shaped = make_scenario()
    assert kv_bytes_per_token(shaped) == kv_bytes_per_token(shaped, per_gpu=True) == (
        shaped.model.shape.kv_bytes_per_token)


def test_no_transfer_summary_is_nan_like_the_rest():
    """A one-token answer ends on the prefill replica: nothing is handed off, and the
    transfer statistics are NaN (as every empty statistic of summary.json; null in the
    file)."""
    out = run_outputs(simulate(one_request(500, 1)))[1]
    d = out["disaggregation"]
    assert d["handed_off"] == d["transfers"] == 0
    for k in ("kv_transfer_ms", "kv_link_wait_ms", "decode_queue_ms"):
        assert all(np.isnan(v) for v in d[k].values()), d[k]


@pytest.mark.parametrize("gbs, latency_us", [(50.0, 10.0), (12.5, 200.0)])
def test_zero_load_ttft_transfer_and_second_token_in_closed_form(gbs, latency_us):
    """One request, nothing else running: TTFT is the network plus the prefill pool's
    step time for the whole prompt (the same as a colocated replica's), the transfer
    takes latency + prompt x 327,680 B / bandwidth, and the second token comes one
    decode step (batch 1 at context prompt + 1, the decode pool's cost model) after the
    transfer lands; the breakdown still adds up."""
    p = 2000
    res = simulate(one_request(p, 2, link={"gbs": gbs, "latency_us": latency_us}))
    df, out = run_outputs(res)
    r = df.iloc[0]
    cost = build_cost_model(res.scenario.model.cost, np.random.default_rng(0), [])
    prefill = cost.step_time(0, 0, 0, [(p, 0, True)])
    decode = cost.step_time(1, p + 1, p + 1, [])
    xfer = latency_us * 1e-6 + p * 327_680 / (gbs * 1e9)
    assert r["t_queue"] == 0.0
    assert r["t_prefill"] == pytest.approx(prefill, rel=1e-12)
    assert r["kv_bytes"] == p * 327_680
    assert r["kv_transfer_s"] == pytest.approx(xfer, rel=1e-9)
    assert r["decode_queue_s"] == 0.0          # the decode replica was idle
    assert r["t_decode"] == pytest.approx(xfer + decode, rel=1e-9)
    assert r["replica"] == 0 and r["decode_replica"] == 1
    # TTFT = network in + prefill + the first frame out (the prefill replica sends it).
    colo = run_outputs(simulate(one_request(p, 2, pools=[{"name": "m", "replicas": 1}])))[0]
    assert r["ttft"] == pytest.approx(colo.iloc[0]["ttft"], rel=1e-12)
    assert r["t_net"] > 0 and r["ttft"] == pytest.approx(
        r["t_net"] + prefill + (r["first_delivered"] - r["first_token"]), rel=1e-12)
    # The second token carries the transfer: the colocated replica decodes it at once.
    assert r["t_decode"] - colo.iloc[0]["t_decode"] == pytest.approx(xfer, rel=1e-9)
    parts = r[["t_net", "t_queue", "t_prefill", "t_decode", "t_stream"]].sum()
    assert parts == pytest.approx(r["e2el"], rel=1e-12)
    d = out["disaggregation"]
    assert d["transfers"] == 1 and d["kv_gb"] == pytest.approx(p * 327_680 / 1e9)
    assert d["kv_transfer_ms"]["max"] == pytest.approx(xfer * 1e3, rel=1e-9)


def test_transfers_from_one_prefill_replica_queue_on_its_link():
    """Two prompts handed off while the first one's bytes are still on the link: the
    second transfer starts when the first's bytes are through (it waits for them, not for
    the first's latency), so it lands exactly one transfer's bytes after the first."""
    p = 1000
    sc = one_request(p, 3, link={"gbs": 1.0, "latency_us": 1000.0}, net=None, n=2,
                     rate=1e9)                     # both arrive together
    df = run_outputs(simulate(sc))[0].sort_values("first_token")
    bytes_s = p * 327_680 / 1e9
    landed = (df["first_token"] + df["decode_queue_s"] + df["kv_transfer_s"]).to_numpy()
    x = df["kv_transfer_s"].to_numpy()
    assert x[0] == pytest.approx(1e-3 + bytes_s, rel=1e-9)          # an idle link
    assert df["first_token"].iloc[1] < landed[0] - 1e-3              # handed off meanwhile
    assert landed[1] == pytest.approx(landed[0] + bytes_s, rel=1e-9)
    assert x[1] > 1e-3 + bytes_s + 0.01                              # it waited


def _interference(pools, n=400, rate=8.0, spy=None):
    """Llama-3-8B on H100s, chunked prefill in 512-token steps, 1-3k-token prompts."""
    sc = make_scenario(
        seed=2, workload={"kind": "synthetic", "num_requests": n,
                          "arrival": {"kind": "poisson", "rate": rate},
                          "prompt_tokens": {"kind": "uniform", "low": 1000, "high": 3000},
                          "output_tokens": {"kind": "uniform", "low": 100, "high": 300}},
        engine={"policy": "chunked", "max_num_seqs": 64, "max_num_batched_tokens": 512},
        model={"name": "llama-3-8b", "cost": H100},
        cluster={"router": "least_outstanding", "pools": pools})
    return sc


@pytest.fixture(scope="module")
def interference():
    """Colocated (two mixed replicas) against one prefill + one decode replica, same
    GPUs and traffic; every step's prefill chunks recorded per replica."""
    import simulator.loops.traffic as T
    chunks: dict = {}
    built: list = []
    base = T.Replica

    class Spy:
        def __init__(self, cost, index):
            self._c, self._i = cost, index

        def __getattr__(self, name):
            return getattr(self._c, name)

        def step_time(self, nd, ctx_max, ctx_sum, ch):
            chunks.setdefault(self._i, []).append(len(ch))
            return self._c.step_time(nd, ctx_max, ctx_sum, ch)

    class Replica(base):
        def __init__(self, env, index, policy, cost, *a, **k):
            super().__init__(env, index, policy, Spy(cost, index), *a, **k)
            built.append(self)

    mp = pytest.MonkeyPatch()
    mp.setattr(T, "Replica", Replica)
    try:
        out = {}
        for name, pools in (("colocated", [{"name": "m", "replicas": 2}]),
                            ("disaggregated", SPLIT)):
            chunks.clear()
            built.clear()
            res = simulate(_interference(pools))
            out[name] = (res, *run_outputs(res), dict(chunks), list(built))
    finally:
        mp.undo()
    return out


def test_decode_pool_never_runs_prefill_and_tpot_p99_drops(interference):
    """DistServe's claim: with the same two GPUs, the colocated replicas' decodes share
    steps with 512-token prefill chunks, the decode pool's never do, so P99 TPOT is
    lower disaggregated (TTFT pays for it: one replica prefills everything)."""
    _r, _df, co, co_chunks, _b = interference["colocated"]
    _r, df, dis, dis_chunks, _b = interference["disaggregated"]
    assert sum(n > 0 for n in dis_chunks[1]) == 0            # decode replica: no chunk
    assert sum(n > 0 for n in dis_chunks[0]) > 0              # prefill replica: chunks
    assert all(sum(n > 0 for n in v) > 0 for v in co_chunks.values())
    co_tpot, dis_tpot = co["overall"]["p99_tpot_ms"], dis["overall"]["p99_tpot_ms"]
    assert dis_tpot < 0.9 * co_tpot, (dis_tpot, co_tpot)
    assert dis["overall"]["p99_ttft_ms"] > co["overall"]["p99_ttft_ms"]
    assert (df["preemptions"] == 0).all()


def test_conservation_kv_returns_to_zero_and_pools_report(interference):
    """Every request finishes exactly once, handed off and transferred once; both pools'
    KV blocks are free at the end; per pool: role, requests, GPU-hours and cost."""
    res, df, out, _c, built = interference["disaggregated"]
    n = len(df)
    assert out["overall"]["outcomes"]["completed"] == n
    assert df["rid"].is_unique and df["finished"].all()
    for rep in built:
        assert rep.kv.manager.num_used == 0 and rep.kv_tokens == 0
        assert not (rep.waiting or rep.decoding or rep.prefilling or rep.incoming
                    or rep.landed or rep._landing)
    d = out["disaggregation"]
    assert d["handed_off"] == d["transfers"] == n
    assert d["kv_gb"] == pytest.approx(df["kv_bytes"].sum() / 1e9)
    assert (df["kv_bytes"] == df["prompt_tokens"] * 131_072).all()   # Llama-3-8B bf16
    assert (df["decode_queue_s"] >= 0).all() and (df["kv_transfer_s"] > 0).all()
    assert (df["t_decode"] >= df["decode_queue_s"] + df["kv_transfer_s"]).all()
    parts = df[["t_net", "t_queue", "t_prefill", "t_decode", "t_stream"]].sum(axis=1)
    np.testing.assert_allclose(parts, df["e2el"], rtol=1e-12, atol=1e-12)
    pools = out["cluster"]["pools"]
    assert {k: v["role"] for k, v in pools.items()} == {"pre": "prefill", "dec": "decode"}
    # TTFT ends on the prefill pool: the decode pool reports none of it.
    assert pools["pre"]["p99_ttft_ms"] == pytest.approx(out["overall"]["p99_ttft_ms"])
    assert np.isnan(pools["dec"]["p99_ttft_ms"])
    assert pools["pre"]["requests_completed"] == pools["dec"]["requests_completed"] == n
    assert out["cluster"]["gpu_hours"] == pytest.approx(2 * res.sim_end / 3600.0)
    assert "disaggregated prefill/decode pools" in res.meta["loop"]


def test_the_columns_survive_a_table_written_in_chunks(interference):
    """A big run's requests table is written in slices of rows: the disaggregation
    columns are sliced with the rest."""
    import pandas as pd
    from simulator.report.chunks import requests_chunks
    from simulator.report.metrics import requests_table
    res = interference["disaggregated"][0]
    whole = requests_table(res)
    assert {"decode_queue_s", "kv_transfer_s", "kv_bytes", "decode_replica"} <= set(whole)
    parts = pd.concat(list(requests_chunks(res, rows=97)), ignore_index=True)
    pd.testing.assert_frame_equal(whole, parts)


def test_deterministic_per_seed():
    sc = _interference(SPLIT, n=150)
    a, b = (json.dumps(run_outputs(simulate(sc))[1], default=str) for _ in range(2))
    assert a == b
    c = json.dumps(run_outputs(simulate(sc, seed=9))[1], default=str)
    assert a != c


def test_a_slow_decode_pool_holds_the_prefill_pools_memory():
    """Backpressure: with a decode replica of few KV blocks, hand-offs wait to be taken
    in (decode_queue_s), their KV still held by the prefill replica meanwhile."""
    pools = [{"name": "pre", "role": "prefill", "replicas": 1},
             {"name": "dec", "role": "decode", "replicas": 1}]
    sc = _interference(pools, n=200, rate=20.0)
    sc.engine.kv.num_blocks = 1200                 # ~19k tokens: a handful of requests
    res = simulate(sc)
    df, out = run_outputs(res)
    assert out["overall"]["outcomes"]["completed"] == 200
    assert out["disaggregation"]["decode_queue_ms"]["p99"] > 100.0
    ts = __import__("simulator.report.output", fromlist=["series_table"]).series_table(res)
    pre = ts[(ts["replica"] == 0)]
    assert pre["kv_blocks_reserved"].max() > 600     # prompts held while they wait


def _write(tmp_path, **cluster):
    data = make_scenario_dict(model={"name": "llama-3-8b", "cost": H100},
                              engine={"policy": "chunked"}, cluster=cluster)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("cluster, words", [
    ({"pools": [{"name": "p", "role": "prefill", "replicas": 2}]},
     ["at least one decode replica", "'p' (prefill, 2 replicas)"]),
    ({"pools": [{"name": "d", "role": "decode", "replicas": 1},
                {"name": "p", "role": "prefill", "replicas": 0}]},
     ["at least one prefill replica"]),
    ({"pools": [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"},
                {"name": "m"}]}, ["pool 'm' has role 'mixed'"]),
    ({"pools": [{"name": "p", "role": "prefil"}, {"name": "d", "role": "decode"}]},
     ["role", "prefil"]),
    ({"pools": [{"name": "m"}], "kv_transfer": {"gbs": 10}}, ["cluster.kv_transfer"]),
    ({"pools": SPLIT, "kv_transfer": {"gbs": 0}}, ["gbs", "0"]),
    ({"pools": SPLIT, "router": "nearest_region"}, ["cluster.router", "'nearest_region'"]),
    ({"pools": SPLIT, "router": "region_load_rtt"}, ["cluster.router", "'region_load_rtt'"]),
])
def test_bad_disaggregated_cluster_is_one_line_exit_2(tmp_path, cluster, words):
    path = _write(tmp_path, **cluster)
    code, _out, err = run_cli(["run", path])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("latsim: error: ") and str(path) in lines[0]
    assert "cluster" in lines[0] and all(w in lines[0] for w in words), lines[0]


def test_client_timeouts_and_autoscaling_are_refused_with_roles():
    with pytest.raises(Exception, match="not modelled on a disaggregated"):
        make_scenario(model={"name": "llama-3-8b", "cost": H100}, cluster={"pools": SPLIT},
                      client={"read_timeout_s": 3.0})
    with pytest.raises(Exception, match="autoscaling a disaggregated"):
        make_scenario(model={"name": "llama-3-8b", "cost": H100}, cluster={
            "pools": SPLIT, "autoscaler": {"pool": "dec", "max_replicas": 2, "target": 1}})


def test_the_compiled_loop_refuses_and_auto_says_why():
    from simulator.loops.simulate import Unsupported
    sc = one_request(500, 4, net=None)
    with pytest.raises(Unsupported, match="disaggregated prefill/decode pools"):
        simulate(sc, loop="compiled")


def test_shipped_scenario_runs(tmp_path):
    from conftest import REPO
    code, out, err = run_cli(["run", REPO / "scenarios" / "disaggregated.yaml", "--set",
                              "workload.num_requests=60", "--out", tmp_path / "o"])
    assert code == 0, err
    runs = json.loads((tmp_path / "o" / "summary.json").read_text())
    dis, colo = runs["disaggregated"], runs["colocated"]
    assert [p["role"] for p in dis["cluster"]["pools"].values()] == ["prefill", "decode"]
    assert dis["disaggregation"]["transfers"] == 60 and "disaggregation" not in colo
    assert [p["role"] for p in colo["cluster"]["pools"].values()] == ["mixed"]
    assert dis["cluster"]["gpu_hours"] / dis["run"]["sim_end_s"] == pytest.approx(8 / 3600)


# -- the planner: the cheapest split ------------------------------------------------------

def _plan_base() -> dict:
    """Llama-3-8B on H100s, 2k-token prompts at 16 req/s: one prefill replica cannot keep
    P99 TTFT under 500 ms (741 ms; two: 149 ms), one decode replica keeps TPOT far under
    15 ms (7.9 ms)."""
    return make_scenario_dict(
        seed=3, workload={"kind": "synthetic", "num_requests": 200,
                          "arrival": {"kind": "poisson", "rate": 16.0},
                          "prompt_tokens": {"kind": "uniform", "low": 1000, "high": 3000},
                          "output_tokens": {"kind": "uniform", "low": 50, "high": 150}},
        engine={"policy": "chunked", "max_num_seqs": 64, "max_num_batched_tokens": 512},
        model={"name": "llama-3-8b", "cost": H100},
        cluster={"router": "least_outstanding", "pools": SPLIT})


def test_planner_picks_the_cheapest_feasible_split_and_skips_with_reasons():
    """Every point of prefill 1-3 x decode 1-2 x prefill TP 1|3 is either skipped before
    running (TP 3 does not divide 32 heads) or simulated; the choice is the cheapest of
    the points that, run on their own, meet both SLOs; the others say what they missed."""
    from simulator.config.scenario import validate_scenario
    from simulator.planning.disagg import DisaggPlanner
    from simulator.planning.slo import parse_slo
    from simulator.planning.sweep import parse_axis
    slos = [parse_slo("p99_ttft_ms<=500", []), parse_slo("p99_tpot_ms<=15", [])]
    axes = [parse_axis(a, "--search") for a in
            ("prefill_replicas=1,2,3", "decode_replicas=1,2", "prefill_tp=1,3")]
    pl = DisaggPlanner(_plan_base(), REPO_DIR, slos, axes, workers=1, prices=2.0)
    try:
        plan = pl.search()
    finally:
        pl.close()
    assert len(pl.skipped) == 6 and all("divide" in why for _c, why in pl.skipped)
    assert all(c["prefill_tp"] == 3 for c, _w in pl.skipped)
    # Brute force: run each point as a plain scenario and check the SLOs by hand.
    ok = {}
    for p in (1, 2, 3):
        for d in (1, 2):
            data = _plan_base()
            data["cluster"]["pools"] = [dict(SPLIT[0], replicas=p), dict(SPLIT[1], replicas=d)]
            o = run_outputs(simulate(validate_scenario(data)))[1]["overall"]
            ok[(p, d)] = o["p99_ttft_ms"] <= 500 and o["p99_tpot_ms"] <= 15
    assert not ok[(1, 1)] and not ok[(1, 2)] and ok[(2, 1)]
    cheapest = min((p + d, p, d) for (p, d), good in ok.items() if good)
    ch = plan.chosen
    assert (ch.params["prefill_replicas"], ch.params["decode_replicas"]) == cheapest[1:]
    assert ch.gpus == 3 and ch.cost_per_hour == pytest.approx(3 * 2.0)
    for c, ev in plan.best_per_combo:
        assert ev.feasible == ok[(c["prefill_replicas"], c["decode_replicas"])]
        if c["prefill_replicas"] == 1:
            assert [t for t, _v in ev.violations] == ["p99_ttft_ms<=500"]


def test_plan_disaggregate_cli_tries_every_split(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(_plan_base()))
    code, out, err = run_cli(["plan", path, "--slo", "p99_ttft_ms<=500", "--slo",
                              "p99_tpot_ms<=15", "--cost-per-gpu-hour", "2", "--disaggregate",
                              "3", "--no-headroom", "--workers", "1", "--out", tmp_path / "o"])
    assert code == 0, err
    doc = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert doc["chosen"]["config"] == {"prefill_replicas": 2, "decode_replicas": 1}
    text = " ".join(out.split())
    assert "infeasible: prefill_replicas=1, decode_replicas=2: p99_ttft_ms<=500" in text
    plain = tmp_path / "plain.yaml"
    data = _plan_base()
    data["cluster"] = {"replicas": 1}
    plain.write_text(yaml.safe_dump(data))
    code, _o, err = run_cli(["plan", plain, "--slo", "p99_ttft_ms<=500",
                             "--cost-per-gpu-hour", "2", "--disaggregate", "3"])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "--disaggregate" in lines[0], err


# -- memory pressure on the decode side (review findings) ---------------------------------

def _run_keeping_replicas(sc, watch=None):
    """``simulate(sc)`` with every replica it builds kept (for their end state);
    ``watch(rep)``: called after each decode-side intake."""
    import simulator.loops.traffic as T
    built: list = []
    base = T.Replica

    class Replica(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            built.append(self)

        def _intake(self, now):
            super()._intake(now)
            if watch is not None:
                watch(self)

    mp = pytest.MonkeyPatch()
    mp.setattr(T, "Replica", Replica)
    try:
        res = simulate(sc)
    finally:
        mp.undo()
    return res, built


def _shipped(**sets):
    """scenarios/disaggregated.yaml (its disaggregated run), 200 requests, with ``sets``
    (``engine.kv`` fields)."""
    from simulator.config.scenario import validate_scenario
    data = yaml.safe_load((REPO_DIR / "scenarios" / "disaggregated.yaml").read_text())
    data.pop("policies")
    data["workload"]["num_requests"] = 200
    data["engine"]["kv"] = {**data["engine"].get("kv", {}), **sets}
    return validate_scenario(data, base_dir=REPO_DIR)


def _assert_drained(built):
    for rep in built:
        assert rep.kv.manager.num_used == 0 and rep.kv_tokens == 0, rep.index
        assert not (rep.by_id or rep._sent or rep._landing or len(rep.waiting)
                    or rep.decoding or rep.prefilling or rep.incoming or rep.landed
                    or rep.swapped), rep.index


@pytest.mark.parametrize("kv", [{"preemption": "recompute"},
                                {"preemption": "swap", "swap_space_gb": 0.05}],
                         ids=["recompute", "swap"])
@pytest.mark.parametrize("num_blocks", [200, 260])
def test_a_decode_replica_under_memory_pressure_preempts_and_finishes(kv, num_blocks):
    """A decode replica of few blocks preempts (its decoders grow): the run completes
    (no request lost but those too large for the cache) and every replica ends empty.
    Preempted requests come back before new hand-offs are taken in, and a replica whose
    only blocks are held by KV still landing waits for it. Swap: a swap space of a few
    victims (50 MB per GPU), the rest recomputed."""
    res, built = _run_keeping_replicas(_shipped(num_blocks=num_blocks, **kv))
    df, out = run_outputs(res)
    oc = out["overall"]["outcomes"]
    assert oc["completed"] + oc["rejected"] == 200 and oc["completed"] > 150, oc
    dec = df[df["decode_replica"] == 1]
    assert dec["preemptions"].sum() > 0
    if kv["preemption"] == "swap":
        assert dec["swapped_bytes"].sum() > 0
    _assert_drained(built)
    parts = df.loc[df["finished"], ["t_net", "t_queue", "t_prefill", "t_decode", "t_stream"]]
    np.testing.assert_allclose(parts.sum(axis=1), df.loc[df["finished"], "e2el"],
                               rtol=1e-12, atol=1e-12)


def test_contiguous_decode_intake_reserves_the_admission_reservation():
    """Contiguous allocation reserves max_model_len (4000 tokens = 250 blocks) per
    request: a decode replica of 1000 blocks holds at most 4 requests at a time, and the
    KV it holds never exceeds its capacity (taking a hand-off in reserves what admitting
    it would, not only the KV it brings)."""
    held = []

    def watch(rep):
        if not rep.hands_off:
            held.append((len(rep.decoding) + len(rep.prefilling) + rep._landing,
                         rep.kv_tokens, rep.kv.reserved_tokens()))
    sc = _interference(SPLIT, n=120, rate=20.0)
    sc.engine.kv.num_blocks = 1000
    sc.engine.kv.allocation = "contiguous"
    sc.engine.kv.max_model_len = 4000
    res, built = _run_keeping_replicas(sc, watch)
    assert run_outputs(res)[1]["overall"]["outcomes"]["completed"] == 120
    assert held and max(n for n, _t, _r in held) == 4
    assert all(t <= r <= 1000 * 16 for _n, t, r in held)
    _assert_drained(built)


def _one_split_plan(data, prices, **kw):
    """The plan of ``data`` over the one split 2 prefill : 1 decode replicas."""
    from simulator.planning.disagg import DisaggPlanner
    from simulator.planning.slo import parse_slo
    from simulator.planning.sweep import parse_axis
    axes = [parse_axis(a, "--search") for a in ("prefill_replicas=2", "decode_replicas=1",
                                                 *kw.pop("axes", ()))]
    pl = DisaggPlanner(data, REPO_DIR, [parse_slo("p99_tpot_ms<=1e9", [])], axes, workers=1,
                       prices=prices, **kw)
    try:
        return pl, pl.search()
    finally:
        pl.close()


def test_plan_prices_each_pool_as_the_run_does():
    """Without a price on the command line a pool is priced as ``latsim run`` bills it:
    its own gpu_cost_per_hour, else the cluster's (the run's cost_usd per hour is the
    plan's); a --cost-per-gpu-hour price wins over the scenario's, a price named for a
    GPU type prices the pools of that type."""
    data = _plan_base()
    data["workload"]["num_requests"] = 40
    data["cluster"]["pools"] = [dict(SPLIT[0], gpu_cost_per_hour=5.0), dict(SPLIT[1])]
    data["cluster"]["gpu_cost_per_hour"] = 2.0
    _pl, plan = _one_split_plan(data, None)
    assert plan.chosen.gpus == 3 and plan.chosen.cost_per_hour == pytest.approx(2 * 5 + 2)
    res = simulate(__import__("simulator.config.scenario", fromlist=["x"]).validate_scenario(
        data))
    pools = run_outputs(res)[1]["cluster"]["pools"]
    assert {k: v["gpu_cost_per_hour"] for k, v in pools.items()} == {"pre": 5.0, "dec": 2.0}
    _pl, plan = _one_split_plan(data, 3.0)
    assert plan.chosen.cost_per_hour == pytest.approx(3 * 3.0)
    _pl, plan = _one_split_plan(data, {"a100-80gb": 1.5, "h100-80gb": 4.0},
                                axes=("prefill_gpu=a100-80gb",))
    # The prefill pool's GPU is priced by its type; the decode pool by its type too.
    assert plan.chosen.cost_per_hour == pytest.approx(2 * 1.5 + 4.0)


def test_plan_refuses_a_pool_left_without_a_price(tmp_path):
    """--cost-per-gpu-hour for the searched prefill GPU only: the decode pool (H100, no
    price of its own) is unpriced: one line, exit 2, before any run."""
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(_plan_base()))
    code, _o, err = run_cli(["plan", path, "--disaggregate", "3", "--cost-per-gpu-hour",
                             "a100-80gb=2", "--search", "prefill_gpu=a100-80gb", "--slo",
                             "p99_tpot_ms<=50", "--workers", "1", "--out", tmp_path / "o"])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "--cost-per-gpu-hour" in lines[0] and "h100-80gb" in lines[0], lines[0]
    assert not (tmp_path / "o").exists()


def test_plan_honours_the_scenarios_policies():
    """``policies:`` is an axis, as for a single fleet: each entry's engine settings are
    planned; an entry that makes the cluster colocated has no split and is skipped."""
    data = _plan_base()
    data["workload"]["num_requests"] = 40
    data["policies"] = [{"policy": "chunked", "label": "chunks"},
                        {"policy": "fifo", "label": "whole"},
                        {"policy": "chunked", "label": "colo",
                         "cluster": {"pools": [{"name": "m", "replicas": 2}]}}]
    pl, plan = _one_split_plan(data, 2.0)
    assert sorted(c["engine.policy"] for c in pl.combos) == ["chunks", "whole"]
    assert [(c["engine.policy"], "no prefill:decode split" in why)
            for c, why in pl.skipped] == [("colo", True)]
    runs = {c["engine.policy"]: ev for c, ev in plan.best_per_combo}
    assert runs["chunks"].rows[0]["p99_ttft_ms"] != runs["whole"].rows[0]["p99_ttft_ms"]
