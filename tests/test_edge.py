"""The edge node (``edge``: ``cluster.edge``, ``cluster.edgecache``, ``cluster.edgerun``)
against closed forms and arithmetic: the cache's hit ratio against the popularity laws
(exact for an unbounded cache, Che's approximation for LRU, the renewal formula for a
TTL), a hit's latency (edge RTT + stream time), the GPU-seconds saved against the
engine time the same request takes alone in the cluster, the escalation fraction
against its probability, the escalated path (edge time + WAN + central), and bad YAML."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from conftest import make_scenario_dict
from simulator.cluster import edgecache as C
from simulator.config.edge import PopularityConfig
from simulator.config.scenario import validate_scenario
from simulator.loops.simulate import Unsupported, simulate
from simulator.report.metrics import requests_table

ROOF = {"kind": "roofline", "model": "llama-3.2-1b", "gpu": "l4"}


def _zipf_keys(k, s, n, seed=0):
    pop = PopularityConfig(kind="zipf", catalogue=k, exponent=s)
    return C.prompt_keys(pop, _N(n), np.random.default_rng(seed)), C.zipf_probabilities(k, s)


class _N:
    """A stand-in workload of ``n`` requests (``prompt_keys`` reads only its length)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def test_unbounded_cache_hits_are_the_repeats():
    """Unbounded, no TTL (or capacity >= K: LRU never evicts): a request hits iff its key
    came before, E[hits] = N - sum_k (1 - (1 - p_k)^N). Tolerance: 4 standard deviations
    of the distinct count, whose variance is at most sum q_k (1 - q_k) (negative
    association)."""
    n, k = 20000, 2000
    keys, p = _zipf_keys(k, 0.8, n)
    t = np.arange(n, dtype=np.float64)
    hits = int((C.lookup(keys, t, None, None) >= 0).sum())
    assert hits == n - len(np.unique(keys))                     # the rule itself
    assert np.array_equal(C.lookup(keys, t, k, None), C.lookup(keys, t, None, None))
    want = C.expected_hits_unbounded(p, n)
    assert abs(hits - want) <= 4 * math.sqrt(C.distinct_variance_bound(p, n))


@pytest.mark.parametrize("cap,s", [(50, 0.8), (200, 1.0)])
def test_lru_hit_ratio_matches_che(cap, s):
    """LRU of C entries under IRM Zipf: Che's approximation. Its error for Zipf at these
    sizes is well under 1% (Fricker, Robert, Roberts 2012, Table 1); the sample of 50,000
    requests after a 10,000-request warm-up adds ~0.2% (binomial). Tolerance 0.01."""
    keys, p = _zipf_keys(1000, s, 60000, seed=3)
    src = C.lookup(keys, np.arange(60000.0), cap, None)
    measured = float((src[10000:] >= 0).mean())
    assert abs(measured - C.che_hit_ratio(p, cap)) < 0.01


def test_ttl_hit_ratio_matches_renewal_formula():
    """Unbounded TTL cache (no refresh on hit), Poisson arrivals of rate lambda: key k
    hits with ratio lambda p_k T / (1 + lambda p_k T) (renewal cycles, exact in the long
    run). 40,000 requests after a 1,000 s warm-up; tolerance 0.01 (binomial SE ~0.003)."""
    rng = np.random.default_rng(7)
    rate, ttl, n = 20.0, 5.0, 60000
    keys, p = _zipf_keys(500, 1.0, n, seed=8)
    t = np.cumsum(rng.exponential(1 / rate, n))
    src = C.lookup(keys, t, None, ttl)
    late = t > 1000.0
    assert late.sum() > 30000
    assert abs(float((src[late] >= 0).mean()) - C.ttl_hit_ratio(p, rate, ttl)) < 0.01


def _edge_dict(n=40, rate=0.2, **edge):
    d = make_scenario_dict()
    d["workload"]["num_requests"] = n
    d["workload"]["arrival"]["rate"] = rate
    d["edge"] = {"rtt_ms": 6.0, "lookup_ms": 0.5, **edge}
    return d


def _run(d, **kw):
    res = simulate(validate_scenario(copy.deepcopy(d)), **kw)
    return res, requests_table(res)


def test_hits_cost_edge_rtt_and_stream_time_and_add_up():
    """One prompt (K = 1): every request after the first hits. A hit that found its
    entry there has E2E = edge RTT + lookup + (N - 1) / rate exactly, zero queue,
    prefill and decode; one that came while the fetch was in flight waits for that
    fetch's delivery (T_queue). Every row's breakdown adds up to E2E."""
    cache = {"popularity": {"kind": "zipf", "catalogue": 1, "exponent": 1.0},
             "stream_tokens_per_s": 250.0}
    res, df = _run(_edge_dict(n=60, rate=2.0, cache=cache))
    parts = df[["t_net", "t_queue", "t_prefill", "t_decode", "t_stream"]].sum(axis=1)
    assert np.allclose(parts, df["e2el"], rtol=0, atol=1e-9)
    hits = df[df["edge"] == "hit"]
    assert len(hits) == 59 and (df["edge"].iloc[0] == "miss")
    ready = hits[hits["t_queue"] == 0]
    assert len(ready) > 20
    want = 0.006 + 0.0005 + (ready["output_tokens"] - 1) / 250.0
    assert np.allclose(ready["e2el"], want, rtol=1e-12, atol=1e-12)
    assert (ready[["t_prefill", "t_decode"]] == 0).all().all()
    waited = hits[hits["t_queue"] > 0]
    # The entry is at the edge when the fetch's last byte is: one edge hop (RTT / 2)
    # before that byte reaches the fetch's own client.
    src_done = df["last_delivered"].iloc[0] - 0.003
    assert np.allclose(waited["scheduled"], src_done, rtol=0, atol=1e-12)
    e = res.meta["edge"]
    assert e["cache"]["hits"] == 59 and e["cache"]["coalesced_hits"] == len(waited)
    assert e["cache"]["expected_hit_ratio"] == {"no_eviction": pytest.approx(59 / 60)}


def test_saved_gpu_seconds_are_the_engine_time_the_hits_would_have_cost():
    """``saved_gpu_s`` = hits x the engine time (first scheduled to last token) the same
    request takes alone in the cluster, measured by the simulator itself on a run
    without the edge (requests 1000 s apart: always alone), x gpus_per_replica."""
    cache = {"popularity": {"kind": "zipf", "catalogue": 1, "same_lengths": True}}
    d = _edge_dict(n=5, rate=0.001, cache=cache)
    d["cluster"] = {"gpus_per_replica": 2, "gpu_cost_per_hour": 3.0}
    res, df = _run(d)
    plain = copy.deepcopy(d)
    del plain["edge"]
    plain["workload"]["num_requests"] = 1
    plain["workload"]["prompt_tokens"] = {"kind": "constant", "value": int(df.prompt_tokens[0])}
    plain["workload"]["output_tokens"] = {"kind": "constant", "value": int(df.output_tokens[0])}
    _, alone = _run(plain)
    engine_s = float(alone["last_token"][0] - alone["scheduled"][0])
    e = res.meta["edge"]
    assert e["hit"] == 4
    assert e["saved_gpu_s"] == pytest.approx(4 * engine_s * 2, rel=1e-9)
    assert e["saved_cost_usd"] == pytest.approx(e["saved_gpu_s"] / 3600 * 3.0, rel=1e-12)


def test_escalation_fraction_is_binomial():
    """Each edge attempt is kept with probability ``acceptance``: the escalated share of
    4,000 attempts is within 4 binomial standard deviations of 1 - acceptance; exactly
    the escalated ones are sent to the cluster, each when the edge let it go."""
    from conftest import make_workload
    from simulator.cluster.edge import ESCALATED, plan_edge
    from simulator.cost import build_cost_model
    cfg = validate_scenario(_edge_dict(speculation={
        "cost": ROOF, "acceptance": 0.3, "servers": 8, "decide_after_tokens": 0})).edge
    wl = make_workload(4000, rate=50.0, prompt=64, output=3)
    plan = plan_edge(cfg, wl, None, np.random.default_rng(5),
                     build_cost_model(cfg.speculation.cost, None, []))
    esc = plan.kind == ESCALATED
    assert abs(esc.mean() - 0.7) <= 4 * math.sqrt(0.7 * 0.3 / 4000)
    assert np.array_equal(np.sort(plan.to_cluster), np.flatnonzero(esc))
    assert (plan.leave[esc] > plan.start[esc]).all()


def test_edge_answer_and_escalated_path_are_their_sums():
    """One request, nothing to wait for. Kept: E2E = edge RTT + lookup + the edge
    model's prefill + its N - 1 decode steps (its cost model's own step times).
    Escalated after k tokens: E2E = edge RTT/2 + lookup + the edge's prefill and k - 1
    decode steps + the request's E2E in the cluster without an edge + edge RTT/2."""
    from simulator.cluster.edge import alone_times
    from simulator.cost import build_cost_model
    d = _edge_dict(n=1, speculation={"cost": ROOF, "acceptance": 1.0})
    res, df = _run(d)
    cost = build_cost_model(validate_scenario(d).edge.speculation.cost, None, [])
    p, o = int(df.prompt_tokens[0]), int(df.output_tokens[0])
    pre, dec = alone_times(cost, p, o - 1)
    assert df["edge"][0] == "edge"
    assert df["e2el"][0] == pytest.approx(0.006 + 0.0005 + pre + sum(dec), rel=1e-12)
    assert df["ttft"][0] == pytest.approx(0.006 + 0.0005 + pre, rel=1e-12)
    d["edge"]["speculation"] = {"cost": ROOF, "acceptance": 0.0, "decide_after_tokens": 4}
    _, esc = _run(d)
    plain = copy.deepcopy(d)
    del plain["edge"]
    _, central = _run(plain)
    pre, dec = alone_times(cost, p, 3)
    edge_s = 0.003 + 0.0005 + pre + sum(dec)
    assert esc["edge"][0] == "escalated"
    assert esc["t_net"][0] == pytest.approx(edge_s + central["t_net"][0], rel=1e-9)
    assert esc["e2el"][0] == pytest.approx(edge_s + central["e2el"][0] + 0.003, rel=1e-9)


def test_compiled_loop_declines_and_auto_says_why():
    d = _edge_dict(n=5, cache={"popularity": {"kind": "zipf", "catalogue": 3}})
    with pytest.raises(Unsupported, match="edge"):
        simulate(validate_scenario(d), loop="compiled")
    res = simulate(validate_scenario(d))
    assert "edge" in res.meta["loop"] and res.meta["loop"].startswith("simpy")


def test_what_the_edge_plan_cannot_follow_is_refused():
    """A decision trace follows the cluster's request ids; closed-loop sessions send a
    turn when the previous answer is back, which a plan made from the arrivals cannot
    know: both are one-line errors naming ``edge``, before any run."""
    from simulator.errors import LatsimError
    from simulator.report.decisions import DecisionTrace
    d = _edge_dict(n=5, cache={"popularity": {"kind": "zipf", "catalogue": 3}})
    with pytest.raises(LatsimError, match="edge"):
        simulate(validate_scenario(d), trace=DecisionTrace(None))
    sc = validate_scenario(d).model_copy(update={"workload": _Sessions()})
    with pytest.raises(LatsimError, match="sessions"):
        simulate(sc)


class _Sessions:
    kind = "sessions"


@pytest.mark.parametrize("edge,field", [
    ({"cache": {"popularity": {"kind": "zipf", "catalogue": 10}, "capacity": 0}},
     "edge.cache.capacity"),
    ({"cache": {"popularity": {"kind": "zipf"}}}, "edge.cache.popularity"),
    ({"speculation": {"cost": ROOF, "acceptance": 1.5}}, "edge.speculation.acceptance"),
    ({"rtt_ms": -1, "cache": {"popularity": {"kind": "trace"}}}, "edge.rtt_ms"),
    ({}, "edge"),
    ({"cache": {"popularity": {"kind": "trace"}}}, "edge.cache.popularity.kind"),
    # 1e8 prompts ran out of memory (the law's arrays) instead of failing here.
    ({"cache": {"popularity": {"kind": "zipf", "catalogue": 10**8}}},
     "edge.cache.popularity.catalogue"),
    # 1e-300 tokens/s gave hits an E2E of 1e304 ms (and a run clock to match).
    ({"cache": {"popularity": {"kind": "zipf", "catalogue": 10},
                "stream_tokens_per_s": 1e-300}}, "edge.cache.stream_tokens_per_s"),
    ({"speculation": {"cost": ROOF, "acceptance": float("nan")}},
     "edge.speculation.acceptance"),
    ({"speculation": {"cost": ROOF, "acceptance": 0.5, "engine": {"max_num_seqs": -1}}},
     "edge.speculation.engine.max_num_seqs")])
def test_bad_edge_yaml_is_one_line_exit_2(tmp_path, edge, field):
    import yaml
    from simulator.cli.main import app
    from typer.testing import CliRunner
    d = make_scenario_dict()
    d["edge"] = edge
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(d))
    r = CliRunner().invoke(app, ["run", str(p), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and "bad.yaml" in line and field in line


def test_trace_prompt_identity_is_its_hash_ids():
    """``popularity: trace``: equal ``hash_ids`` lists are the same prompt, so an
    unbounded cache hits exactly the repeats; on the shipped Mooncake conversation trace
    (200 requests) that is N - distinct lists, and the hits do no engine work."""
    from pathlib import Path

    from simulator.config.scenario import load_scenario
    from simulator.workload import Workload
    wl = Workload(arrival_s=[0.0, 1, 2, 3, 4], prompt_tokens=[10] * 5, output_tokens=[5] * 5,
                  priority=[0] * 5, hash_ids=[np.array([1, 2]), np.array([1]), np.array([1, 2]),
                                              np.array([2, 1]), np.array([1])])
    keys = C.prompt_keys(PopularityConfig(kind="trace"), wl, None)
    assert list(C.lookup(keys, wl.arrival_s, None, None)) == [-1, -1, 0, -1, 1]
    sc, base = load_scenario(Path(__file__).parents[1] / "scenarios" / "mooncake-conv.yaml",
                             ["workload.limit=200", "policies=null"])
    from simulator.config.edge import EdgeConfig
    sc = sc.model_copy(update={"edge": EdgeConfig.model_validate(
        {"cache": {"popularity": {"kind": "trace"}}})})
    res = simulate(sc, base_dir=base)
    df = requests_table(res)
    distinct = len({tuple(h) for h in res.workload.hash_ids})
    assert res.meta["edge"]["hit"] == 200 - distinct > 0
    hits = df[df["edge"] == "hit"]
    assert (hits["t_prefill"] == 0).all() and (hits["t_decode"] == 0).all()


def test_console_shows_the_edge_table():
    """``latsim run``'s console: an 'Edge node' table whose hit count is the summary's."""
    from io import StringIO

    from rich.console import Console

    from simulator.report.output import run_outputs
    from simulator.report.tables import print_run
    d = _edge_dict(n=20, cache={"popularity": {"kind": "zipf", "catalogue": 4}})
    _, s = run_outputs(simulate(validate_scenario(d)))
    buf = StringIO()
    print_run(Console(file=buf, width=200), {"cache": s})
    text = buf.getvalue()
    row = next(line for line in text.splitlines() if "cache hits" in line)
    assert "Edge node" in text and row.split()[-2] == str(s["edge"]["hit"]) and s["edge"]["hit"] > 0


def test_max_sim_time_cuts_the_edge_too():
    """``max_sim_time_s``: no timestamp past the clock's stop, for the edge's answers
    as for the cluster's (a hit past it is unfinished)."""
    cache = {"popularity": {"kind": "zipf", "catalogue": 2}, "stream_tokens_per_s": 5.0}
    d = _edge_dict(n=30, rate=2.0, cache=cache)
    d["max_sim_time_s"] = 8.0
    res, df = _run(d)
    cols = ["enqueued", "scheduled", "first_token", "last_token", "first_delivered",
            "last_delivered"]
    assert not (df[cols] > 8.0).any().any()
    assert res.sim_end == 8.0 and df["last_delivered"].isna().any()
    assert (df["edge"] == "hit").sum() > 20


def test_a_policies_entry_changes_the_edge_sections_it_names():
    """A ``policies:`` entry's ``edge`` changes the sections it names of the scenario's
    edge (``null``: no edge), in a run as in a sweep point."""
    from simulator.planning.sweep import point_scenario, policy_axis
    d = _edge_dict(cache={"popularity": {"kind": "zipf", "catalogue": 3}})
    d["policies"] = [{"policy": "chunked", "label": "none", "edge": None},
                     {"policy": "chunked", "label": "both",
                      "edge": {"speculation": {"cost": ROOF, "acceptance": 0.5}}}]
    runs = dict(validate_scenario(copy.deepcopy(d)).policy_runs())
    assert runs["none"].edge is None
    both = runs["both"].edge
    assert both.cache.popularity.catalogue == 3 and both.speculation.acceptance == 0.5
    assert both.rtt_ms == 6.0
    _, entries = policy_axis(d)
    for label, want in (("none", None), ("both", both)):
        point = validate_scenario(point_scenario(d, {"engine.policy": label}, entries))
        assert point.edge == want


ENGINE = {"policy": "chunked", "max_num_seqs": 16, "max_num_batched_tokens": 4096}


def test_edge_engine_alone_is_the_one_at_a_time_edge():
    """``speculation.engine``: the edge's GPUs run the engine loop. A request alone (its
    prompt in one chunk) costs there what one-at-a-time prices: the same prefill and
    decode steps of the same cost model (to rounding of the sums, 1e-12)."""
    one = {"cost": ROOF, "acceptance": 1.0}
    res1, a = _run(_edge_dict(n=1, speculation=one))
    res2, b = _run(_edge_dict(n=1, speculation={**one, "engine": ENGINE}))
    for col in ("ttft", "e2el", "t_queue"):
        assert b[col][0] == pytest.approx(a[col][0], rel=1e-12, abs=1e-12)
    assert res2.meta["edge"]["speculation"]["edge_gpu_s"] == pytest.approx(
        res1.meta["edge"]["speculation"]["edge_gpu_s"], rel=1e-12)


def test_edge_engine_batches_under_load():
    """300 requests at 4 req/s on one edge GPU: batching shares each step, so the engine
    loop is busy for less time than one request at a time would be, and its requests
    wait less; the acceptance draws are the same (same seed, same escalations)."""
    spec = {"cost": ROOF, "acceptance": 0.5, "decide_after_tokens": 4}
    d1 = _edge_dict(n=300, rate=4.0, speculation=spec)
    d2 = _edge_dict(n=300, rate=4.0, speculation={**spec, "engine": ENGINE})
    (r1, a), (r2, b) = _run(d1), _run(d2)
    e1, e2 = r1.meta["edge"]["speculation"], r2.meta["edge"]["speculation"]
    assert e2["edge_gpu_s"] < e1["edge_gpu_s"] and e2["mean_edge_wait_s"] < e1["mean_edge_wait_s"]
    assert (a["edge"] == b["edge"]).all()
    parts = b[["t_net", "t_queue", "t_prefill", "t_decode", "t_stream"]].sum(axis=1)
    assert np.allclose(parts, b["e2el"], rtol=0, atol=1e-9)


def test_edge_engine_section_is_checked_when_read(tmp_path):
    d = _edge_dict(n=5, speculation={"cost": ROOF, "acceptance": 0.5,
                                     "engine": {"max_num_seqs": 0}})
    from simulator.errors import LatsimError
    with pytest.raises(Exception, match="max_num_seqs"):
        validate_scenario(d)
    with pytest.raises(LatsimError):
        validate_scenario(d)
    d["edge"]["speculation"]["engine"] = {"kv": {"num_blocks": 10**7}}   # more than an L4 holds
    with pytest.raises(LatsimError, match=r"edge\.speculation.*num_blocks.*more blocks than fit"):
        validate_scenario(d)


def test_a_sweep_row_holds_the_edge_figures():
    """``latsim sweep``'s flat row: the edge's figures as ``edge.<path>`` cells, the same
    numbers as the summary's."""
    from simulator.planning.executors import flatten
    from simulator.report.output import run_outputs
    d = _edge_dict(n=20, cache={"popularity": {"kind": "zipf", "catalogue": 4}})
    _, s = run_outputs(simulate(validate_scenario(d)))
    row = flatten(s, 1.0)
    assert row["edge.hit"] == s["edge"]["hit"] > 0
    assert row["edge.cache.hit_ratio"] == s["edge"]["cache"]["hit_ratio"]
    assert row["edge.speculation.escalation_ratio"] is None


def test_hits_on_a_fetch_that_failed_end_as_it_did():
    """One prompt, so every request after the first hits the first one's entry; the only
    replica fails while that fetch runs and the fault model loses it (``in_flight:
    lost``): the hits waiting on it end ``failed`` as it did (they were left
    ``unfinished``, as if the clock had cut them), and the summary's outcomes count
    every request once. (The cache is played out before the cluster runs, so an entry
    whose fetch failed is not fetched again: see README's edge section.)"""
    from simulator.report.output import run_summary
    d = _edge_dict(n=30, rate=20.0, cache={"popularity": {"kind": "zipf", "catalogue": 1}})
    d["workload"]["output_tokens"] = {"kind": "constant", "value": 300}
    d["cluster"] = {"replicas": 1, "faults": {"outages": [{"replica": 0, "start_s": 0.2,
                                                           "duration_s": 1.0}],
                                              "in_flight": "lost"}}
    res, df = _run(d)
    assert df["edge"][0] == "miss" and (df["edge"][1:] == "hit").all()
    assert (df["outcome"] == "failed").all(), df["outcome"].value_counts()
    assert sum(run_summary(res)["overall"]["outcomes"].values()) == 30
