"""The capacity planner against queueing theory, and multi-replica queueing itself.

The known-answer case is M/M/c-like: one-slot replicas (``max_num_seqs: 1``), one output
token, exponential service (exponential prompt lengths on a profile linear in the
prompt, 1 ms per token, mean 1 s), Poisson arrivals at 3.5/s, ``least_outstanding``
routing (join the replica with the least work, which pools like a central queue). Erlang
C then says how many replicas a mean-wait / P99-wait SLO needs, with margins wide enough
(c-1 misses by ~2x, c meets with ~2x to spare) that the simulator's finite run and its
routing (close to, not exactly, a central queue) cannot change the answer.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer import Typer
from typer.testing import CliRunner

from conftest import REPO, ZERO_NET, ZERO_STREAM, make_profile
from simulator.config.scenario import validate_scenario
from simulator.errors import LatsimError
from simulator.planning.planner import Planner, knee, scale_rate
from simulator.planning.slo import default_slos, parse_slo
from simulator.cli.plan import write_plan
from simulator.planning.executors import LocalExecutor
from simulator.planning.sweep import parse_axis
from simulator.workload import build_workload

LAM, MEAN_S = 3.5, 1.0
MEAN_WAIT_MS, P99_WAIT_MS = 600.0, 4500.0


def erlang_c(c: int, a: float) -> float:
    """Probability of waiting in M/M/c with offered load ``a`` = lambda / mu < c."""
    top = a ** c / math.factorial(c) * c / (c - a)
    return top / (sum(a ** k / math.factorial(k) for k in range(c)) + top)


def mmc_wait(c: int, lam: float, mu: float = 1 / MEAN_S) -> tuple[float, float]:
    """Mean and P99 waiting time (ms) of M/M/c; inf when unstable."""
    if lam >= c * mu:
        return math.inf, math.inf
    pc = erlang_c(c, lam / mu)
    p99 = max(0.0, math.log(pc / 0.01) / (c * mu - lam))
    return pc / (c * mu - lam) * 1000, p99 * 1000


def mmc_dict(tmp_path, n=10_000, lam=LAM, replicas=1, router="least_outstanding") -> dict:
    prof = tmp_path / "linear.json"
    prof.write_text(json.dumps(make_profile(prefill=((1, 0, 1.0), (10**6, 0, 10**6)))))
    return {
        "name": "mmc", "seed": 1,
        "workload": {"kind": "synthetic", "num_requests": n,
                     "arrival": {"kind": "poisson", "rate": lam},
                     "prompt_tokens": {"kind": "exponential", "mean": MEAN_S * 1000},
                     "output_tokens": {"kind": "constant", "value": 1},
                     "classes": [{"name": "P0", "share": 0.5}, {"name": "P1", "share": 0.5}]},
        "network": dict(ZERO_NET), "stream": dict(ZERO_STREAM),
        "cluster": {"replicas": replicas, "router": router},
        "engine": {"policy": "fifo", "max_num_seqs": 1, "max_num_batched_tokens": 10**7,
                   "kv": {"num_blocks": 10**7}},
        "model": {"cost": {"kind": "profile", "path": str(prof)}},
    }


SLOS = ["mean_t_queue_ms<=600", "p0:p99_t_queue_ms<=4500"]


def slos_for(data):
    return [parse_slo(s, ["P0", "P1"]) for s in SLOS]


# -- SLO syntax ---------------------------------------------------------------------------

def test_slo_syntax():
    s = parse_slo("p0:p99_ttft_ms<=500", ["P0", "P1", "P2"])
    assert (s.cls, s.metric, s.op, s.bound, s.column) == ("P0", "p99_ttft_ms", "<=", 500, "P0:p99_ttft_ms")
    assert s.ok(500) and not s.ok(501) and not s.ok(float("nan"))
    g = parse_slo("request_goodput >= 3.5", ["P0"])
    assert g.column == "request_goodput" and g.ok(4) and g.ratio(7) == 0.5
    assert parse_slo("default:p99_tpot_ms<50ms", ["default"]).column == "p99_tpot_ms"
    for bad, msg in (("p9:p99_ttft_ms<=5", "unknown class"), ("p99_ttfx_ms<=5", "unknown metric"),
                     ("p0:p99_itl_ms<=5", "without a class"), ("p99_ttft_ms=5", "looks like"),
                     ("p99_ttft_ms<=-5", "positive number"), ("p99_ttft_ms<0", "positive"),
                     ("p99_ttft_ms<=1e999", "positive number"),
                     ("request_goodput>=-1", ">= 0")):
        with pytest.raises(LatsimError, match=msg):
            parse_slo(bad, ["P0"])


def test_a_configuration_is_judged_on_its_worst_seed():
    """Over seeds, an upper bound reads the largest value and a lower bound the smallest:
    P99 TTFT 100 and 300 ms against <= 200 is infeasible at 300; goodput 4 and 6 against
    >= 5 is infeasible at 4; a request lost on any seed makes it infeasible."""
    from simulator.planning.planner import Eval
    ttft = parse_slo("p99_ttft_ms<=200", ["P0"])
    good = parse_slo("request_goodput>=5", ["P0"])
    e = Eval({}, 1.0, 1, [{"p99_ttft_ms": 100.0, "request_goodput": 6.0},
                          {"p99_ttft_ms": 300.0, "request_goodput": 4.0}], [ttft, good])
    assert e.value(ttft) == 300.0 and e.value(good) == 4.0
    assert not e.feasible and dict(e.violations) == {ttft.text: 300.0, good.text: 4.0}
    ok = Eval({}, 1.0, 1, [{"p99_ttft_ms": 100.0, "request_goodput": 6.0},
                           {"p99_ttft_ms": 150.0, "request_goodput": 5.5}], [ttft, good])
    assert ok.feasible and ok.value(ttft) == 150.0 and ok.value(good) == 5.5
    lost = Eval({}, 1.0, 1, [{"p99_ttft_ms": 100.0, "request_goodput": 6.0},
                             {"p99_ttft_ms": 100.0, "request_goodput": 6.0, "not_finished": 2}],
                [ttft, good])
    assert not lost.feasible


def test_default_slos_come_from_the_classes():
    sc = validate_scenario(yaml.safe_load((REPO / "scenarios/quickstart.yaml").read_text()))
    texts = [s.text for s in default_slos(sc)]
    assert texts == ["P0:p99_ttft_ms<=500", "P0:p99_tpot_ms<=50", "P1:p99_ttft_ms<=2000",
                     "P1:p99_tpot_ms<=100", "P2:p99_ttft_ms<=10000"]


def test_rate_scaling_for_synthetic_and_trace(tmp_path):
    d = mmc_dict(tmp_path)
    assert scale_rate(d, validate_scenario(d), 2.0)["workload"]["arrival"]["rate"] == 7.0
    trace = {"workload": {"kind": "trace", "path": str(REPO / "tests/data/azure_conv_head40.csv"),
                          "speedup": 2.0}}
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    sc = validate_scenario(trace)
    fast = validate_scenario(scale_rate(trace, sc, 3.0))
    assert fast.workload.speedup == 6.0
    a0 = build_workload(sc.workload, rng(), REPO).arrival_s
    a1 = build_workload(fast.workload, rng(), REPO).arrival_s
    np.testing.assert_allclose(a1, a0 / 3.0)


def test_knee_of_a_hockey_stick():
    xs = [1, 2, 3, 4, 5, 6]
    assert knee(xs, [1, 1.1, 1.3, 1.6, 5, 20]) == 4
    assert knee([1, 2], [1, 2]) is None


# -- replicas are real queueing -------------------------------------------------------------

def test_replicas_are_real_queueing(tmp_path):
    """N one-slot replicas at N x the rate: least_outstanding pools like M/M/c (Erlang C),
    round robin does not, and neither is one replica's result divided by N."""
    cases = [(1, LAM / 4, "round_robin"), (4, LAM, "least_outstanding"),
             (4, LAM, "round_robin"), (5, LAM, "least_outstanding")]
    tasks = [(mmc_dict(tmp_path, n=20_000, lam=lam, replicas=c, router=r), 1, str(tmp_path), None)
             for c, lam, r in cases]
    ex = LocalExecutor()
    try:
        rows = dict(ex.imap_unordered(tasks))
    finally:
        ex.close()
    w = [rows[i]["mean_t_queue_ms"] for i in range(len(cases))]
    one, pooled4, rr4, pooled5 = w
    e4, e5 = mmc_wait(4, LAM)[0], mmc_wait(5, LAM)[0]
    assert one > 3 * pooled4 and rr4 > 2 * pooled4      # pooling is real, and routing matters
    assert abs(pooled4 - e4) / e4 < 0.25, (pooled4, e4)
    assert abs(pooled5 - e5) / e5 < 0.35, (pooled5, e5)
    assert 0.6 < one / mmc_wait(1, LAM / 4)[0] < 1.5  # M/M/1 at rho 0.875, 20k requests


# -- the planner's answer ----------------------------------------------------------------------

def test_planner_finds_the_erlang_c_replica_count(tmp_path):
    need = next(c for c in range(1, 20) if mmc_wait(c, LAM)[0] <= MEAN_WAIT_MS
                and mmc_wait(c, LAM)[1] <= P99_WAIT_MS)
    # The case is unambiguous: one replica fewer misses clearly, the answer meets clearly.
    assert mmc_wait(need - 1, LAM)[0] > 2 * MEAN_WAIT_MS
    assert mmc_wait(need, LAM)[0] < 0.5 * MEAN_WAIT_MS and mmc_wait(need, LAM)[1] < 0.6 * P99_WAIT_MS
    d = mmc_dict(tmp_path)
    pl = Planner(d, tmp_path, slos_for(d), [parse_axis("replicas=1:16")])
    try:
        plan = pl.search()
        assert plan.runs <= math.ceil(math.log2(16)) + 1  # binary search, not 16 runs
        assert plan.chosen is not None and plan.chosen.params["cluster.replicas"] == need == 5
        assert plan.below.params["cluster.replicas"] == need - 1 and not plan.below.feasible
        assert plan.binding == "mean_t_queue_ms<=600"
        pl.headroom(plan, tol=0.04)
    finally:
        pl.close()
    # Headroom: the rate at which Erlang C's mean wait for `need` servers reaches the SLO.
    lo, hi = LAM, need / MEAN_S
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mmc_wait(need, mid)[0] <= MEAN_WAIT_MS else (lo, mid)
    sim_rate = plan.headroom * plan.chosen.mean("offered_rate")
    assert abs(sim_rate - lo) / lo < 0.1, (sim_rate, lo)
    assert len(plan.curve) >= 5
    files = write_plan(tmp_path / "out", plan, 3.5)
    png = tmp_path / "out" / "load_curve.png"
    assert png in files and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert doc["chosen"]["gpus"] == 5 and doc["chosen"]["cost_per_hour"] == 17.5


def _app():
    from simulator.cli.plan import plan
    app = Typer()
    app.command("plan")(plan)
    app.command("other")(lambda: None)
    return app


def test_plan_says_when_nothing_meets_the_slos_and_which_binds(tmp_path):
    sc = tmp_path / "mmc.yaml"
    sc.write_text(yaml.safe_dump(mmc_dict(tmp_path, n=5000)))
    args = ["plan", str(sc), "--slo", SLOS[0], "--slo", SLOS[1], "--cost-per-gpu-hour", "2",
            "--search", "replicas=1:4", "--search", "router=round_robin,least_outstanding",
            "--out", str(tmp_path / "o")]
    r = CliRunner().invoke(_app(), args)
    assert r.exit_code == 1, r.output        # ran, but nothing met what was asked
    out = " ".join(r.output.split())
    assert "No configuration in the search space meets the SLOs" in out
    assert "binding SLO: mean_t_queue_ms<=600" in out
    doc = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert doc["chosen"] is None and doc["binding_slo"] == "mean_t_queue_ms<=600"
    assert doc["runs"] == 4  # 3 and 4 replicas of each router; 1 and 2 are ruled out
    r = CliRunner().invoke(_app(), [*args[:2], "--slo", "p7:p99_ttft_ms<=1",
                                    "--cost-per-gpu-hour", "2"])
    assert isinstance(r.exception, LatsimError) and "unknown class" in str(r.exception)


# -- fixed bugs ---------------------------------------------------------------------------------

def _tiny(tmp_path, name: str, n: int = 30) -> dict:
    """A shipped scenario with its traffic cut to ``n`` requests, paths made absolute."""
    d = yaml.safe_load((REPO / "scenarios" / name).read_text())
    d["workload"]["num_requests"] = n
    return d


def test_search_over_the_policy_axis_runs(tmp_path):
    """``--search engine.policy=chunked,priority_aging`` used to fail with ``TypeError:
    argument of type 'int' is not iterable`` (the run counter overwrote the map of
    ``policies:`` entries) once the first batch of runs was counted."""
    d = _tiny(tmp_path, "quickstart.yaml")
    slos = [parse_slo("p99_e2el_ms<=1e9", ["P0", "P1", "P2"])]
    pl = Planner(d, REPO / "scenarios", slos,
                 [parse_axis("engine.policy=chunked,priority_aging"), parse_axis("replicas=1:4")],
                 workers=1)
    try:
        plan = pl.search()
    finally:
        pl.close()
    assert plan.chosen is not None and plan.chosen.params["cluster.replicas"] == 1
    assert {ev.params["engine.policy"] for _, ev in plan.best_per_combo} == {"chunked", "priority_aging"}
    assert plan.runs >= 4 and pl.policy_runs is None


def test_policies_entries_are_applied_not_taken_for_policy_names(tmp_path):
    """kv-pressure.yaml's ``policies:`` entries are labelled runs (``recompute``,
    ``swap``, ``larger-gpu``), which used to be set as ``engine.policy`` and fail with
    ``unknown policy 'recompute'``: each entry's engine settings apply (larger-gpu's 48 GB
    holds more KV than the others' 24 GB)."""
    d = _tiny(tmp_path, "kv-pressure.yaml")
    slos = [parse_slo("p99_e2el_ms<=1e9", ["P0", "P1"])]
    pl = Planner(d, REPO / "scenarios", slos, [parse_axis("replicas=1:2")], workers=1)
    try:
        plan = pl.search()
    finally:
        pl.close()
    cap = {ev.params["engine.policy"]: ev.rows[0]["run.kv_capacity_tokens"]
           for _, ev in plan.best_per_combo}
    assert set(cap) == {"recompute", "swap", "larger-gpu"}
    assert cap["recompute"] == cap["swap"] < cap["larger-gpu"]
    assert all("error" not in ev.rows[0] for _, ev in plan.best_per_combo)


# -- hardware: the cheapest GPU type, TP and replica count --------------------------------------

def _seventy_b(tmp_path) -> Path:
    d = _tiny(tmp_path, "quickstart.yaml", n=24)
    d["workload"]["arrival"]["rate"] = 1.0
    d["workload"]["prompt_tokens"] = {"kind": "constant", "value": 256}
    d["workload"]["output_tokens"] = {"kind": "constant", "value": 8}
    d["engine"]["kv"] = {"block_size": 16}
    d["model"] = {"name": "llama-2-70b",
                  "cost": {"kind": "roofline", "gpu": "h100-80gb", "tp": 4}}
    p = tmp_path / "seventy.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def test_gpu_axis_finds_the_cheapest_type_tp_and_replicas(tmp_path):
    """Llama-2-70B over H100, A100 and L40S at TP 1-8, priced per GPU type: what does not
    fit (TP1 anywhere, 138 GB of weights; L40S below TP4) is skipped with its reason,
    every other configuration is simulated, and the choice is the cheapest feasible one
    of all evaluated (checked against every evaluation)."""
    sc = _seventy_b(tmp_path)
    args = ["plan", str(sc), "--slo", "p99_tpot_ms<=200", "--slo", "P0:p99_ttft_ms<=5000",
            "--gpus", "h100-80gb,a100-80gb,l40s", "--search", "tp=1,2,4,8",
            "--search", "replicas=1:2", "--cost-per-gpu-hour", "h100-80gb=3.9,a100-80gb=2.2,l40s=1.1",
            "--no-headroom", "--workers", "1", "--out", str(tmp_path / "o")]
    r = CliRunner().invoke(_app(), args)
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "skipped model.cost.tp=1, model.cost.gpu=h100-80gb" in out and "does not fit" in out
    doc = json.loads((tmp_path / "o" / "plan.json").read_text())
    skipped = {(s["config"]["model.cost.gpu"], s["config"]["model.cost.tp"]) for s in doc["skipped"]}
    assert {("h100-80gb", 1), ("a100-80gb", 1), ("l40s", 1), ("l40s", 2)} <= skipped
    ch = doc["chosen"]
    price = {"h100-80gb": 3.9, "a100-80gb": 2.2, "l40s": 1.1}[ch["config"]["model.cost.gpu"]]
    assert ch["cost_per_hour"] == pytest.approx(ch["gpus"] * price)
    assert ch["gpus"] == ch["config"]["cluster.replicas"] * ch["config"]["model.cost.tp"]
    import pandas as pd
    ev = pd.read_csv(tmp_path / "o" / "evaluations.csv")
    feas = ev[ev["feasible"] & (ev["rate_multiplier"] == 1.0)]
    assert ch["cost_per_hour"] == pytest.approx(feas["cost_per_hour"].min())
    assert "roofline estimates from datasheets" in doc["step_costs"]


def test_prices_per_gpu_type_must_cover_the_axis(tmp_path):
    sc = _seventy_b(tmp_path)
    r = CliRunner().invoke(_app(), ["plan", str(sc), "--slo", "p99_tpot_ms<=200",
                                    "--gpus", "h100-80gb,l40s", "--cost-per-gpu-hour",
                                    "h100-80gb=3.9", "--workers", "1"])
    assert isinstance(r.exception, LatsimError) and "missing: l40s" in str(r.exception)
    r = CliRunner().invoke(_app(), ["plan", str(sc), "--slo", "p99_tpot_ms<=200",
                                    "--gpus", "h100-80gb,h99", "--cost-per-gpu-hour", "2"])
    assert isinstance(r.exception, LatsimError) and "--gpus" in str(r.exception)


# -- what the report says (binding SLO, units, rates, every run, progress) ----------------------

class _ClosedForm:
    """An executor whose runs are a closed form of the point, not a simulation: per
    replica the load is rho = 0.6 x (rate / LAM) x 4 / replicas, P99 TTFT = 100 / (1 - rho)
    ms (it explodes near saturation), P99 TPOT = 20 + 30 rho ms (it grows gently), and the
    sampled arrivals realise 98.7% of the rate asked."""

    workers = 1

    def imap_unordered(self, tasks):
        for i, (data, _seed, _dir, _prof) in enumerate(tasks):
            rate = data["workload"]["arrival"]["rate"]
            rho = 0.6 * (rate / LAM) * 4 / data["cluster"]["replicas"]
            yield i, {"p99_ttft_ms": 100 / (1 - rho) if rho < 1 else 1e6,
                      "p99_tpot_ms": 20 + 30 * rho, "offered_rate": 0.987 * rate,
                      "output_throughput": 100.0}

    def close(self):
        pass


CF_SLOS = ("p99_ttft_ms<=400", "p99_tpot_ms<=40")


def _closed_form_plan(tmp_path, seeds=1):
    d = mmc_dict(tmp_path, n=50)
    pl = Planner(d, tmp_path, [parse_slo(s, ["P0", "P1"]) for s in CF_SLOS],
                 [parse_axis("replicas=1:8")], seeds=seeds)
    pl.executor.close()
    pl.executor = _ClosedForm()
    return pl


def test_the_binding_slo_is_the_one_missed_first_as_the_load_grows(tmp_path):
    """4 replicas (rho 0.6) meet both SLOs, 3 (rho 0.8) miss both: TTFT 500 ms (1.25x its
    bound) further than TPOT 44 ms (1.1x). As the load on 4 replicas grows, TPOT is missed
    first (rho > 2/3: above 1.11x the rate), TTFT only at rho > 0.75 (1.25x). The report's
    binding SLO, its headroom line and the plot name the same one: TPOT (the report used
    to name TTFT, from the smaller size, while the headroom line said TPOT)."""
    from simulator.cli.plan import binding_slo
    pl = _closed_form_plan(tmp_path)
    plan = pl.search()
    assert plan.chosen.params["cluster.replicas"] == 4
    # Before any higher rate is run, the smaller size is the evidence: TTFT, the further miss.
    assert plan.binding == "p99_ttft_ms<=400"
    assert "with 3 replicas: p99_ttft_ms<=400 missed (500 ms); p99_tpot_ms<=40 missed (44 ms)" \
        in plan.binding_detail
    pl.headroom(plan, tol=0.02)
    assert 1.09 < plan.headroom <= 1.112                  # rho 2/3 at 10/9 = 1.111x
    assert plan.binding == plan.headroom_binding == "p99_tpot_ms<=40"
    assert binding_slo(plan).text == "p99_tpot_ms<=40"
    assert plan.binding_detail.startswith("missed first as the load grows: at 1.1")
    assert "p99_tpot_ms<=40 missed (" in plan.binding_detail and " ms)" in plan.binding_detail


def test_plan_report_says_units_and_the_rate_asked_and_realised(tmp_path):
    from rich.console import Console

    from simulator.cli.plan import print_plan
    pl = _closed_form_plan(tmp_path)
    plan = pl.search()
    pl.headroom(plan, tol=0.02)
    con = Console(width=400, record=True, file=open(tmp_path / "out.txt", "w"))
    print_plan(con, plan, 2.0, 3, 1, len(pl.replicas))
    text = con.export_text()
    assert "(at 3.5 req/s asked, 3.45 req/s realised by the arrivals)" in text
    asked, real = plan.headroom * LAM, plan.headroom * 0.987 * LAM
    assert f"({asked:.3g} req/s asked, {real:.3g} realised)" in text
    assert "missed (500 ms)" in text and "above it p99_tpot_ms<=40 is missed first" in text


def test_evaluations_csv_holds_every_simulated_run(tmp_path):
    """One row per simulated run (a configuration at a rate, one seed): as many rows as
    the plan says it simulated, each with its seed, the rate asked and realised, and what
    it was to the plan."""
    import pandas as pd
    pl = _closed_form_plan(tmp_path, seeds=2)
    plan = pl.search()
    pl.headroom(plan, tol=0.02)
    write_plan(tmp_path / "out", plan, 2.0)
    df = pd.read_csv(tmp_path / "out" / "evaluations.csv")
    assert len(df) == plan.runs == 2 * len(plan.evaluations) > 2 * len(plan.curve)
    assert sorted(set(df["seed"])) == [1, 2]                  # the scenario's seed, +1
    np.testing.assert_allclose(df["offered_rate"], 0.987 * df["asked_rate"])
    np.testing.assert_allclose(df["asked_rate"], LAM * df["rate_multiplier"])
    assert set(df["role"]) >= {"chosen", "next smaller size", "search", "headroom"}
    assert (df.loc[df["role"] == "chosen", "cluster.replicas"] == 4).all()
    rho = 0.6 * df["rate_multiplier"] * 4 / df["cluster.replicas"]
    np.testing.assert_allclose(df["p99_tpot_ms<=40"], 20 + 30 * rho)


def test_plan_shows_its_progress_on_stderr(tmp_path, monkeypatch):
    """Not a terminal: a line with the runs simulated so far (run's progress watcher, its
    delays set to zero here so that the line comes at once)."""
    import io
    import time

    from rich.console import Console

    from simulator.cli.plan import plan_progress
    from simulator.cli.run import RunProgress
    monkeypatch.setattr(RunProgress, "DELAY_S", 0.0)
    monkeypatch.setattr(RunProgress, "NOTE_S", 0.0)

    class _Planner:
        settled = 7
    buf = io.StringIO()
    watch = plan_progress(_Planner(), Console(file=buf, force_terminal=False))
    try:
        for _ in range(400):                 # the watcher looks every 0.25 s
            if "runs simulated" in buf.getvalue():
                break
            time.sleep(0.05)
    finally:
        watch.close()
    assert "latsim: plan: 7 runs simulated, " in buf.getvalue()
