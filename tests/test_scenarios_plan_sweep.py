"""``latsim run``, ``latsim plan`` and ``latsim sweep`` run on every shipped scenario (each
cut to a few requests with ``--set``): ``run`` exits 0, a scenario's ``policies:`` list
becomes the runs' policy axis (labelled entries with their own engine settings
included), every run completes, and the tables hold one row per point."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from conftest import REPO
from simulator.cli.main import app

SCENARIOS = sorted((REPO / "scenarios").glob("*.yaml"))
N = 30


def _tiny(path) -> tuple[list, int]:
    """``--set`` overrides cutting a scenario to ``N`` requests, and its number of runs
    per point (its ``policies:`` entries, else one)."""
    d = yaml.safe_load(path.read_text())
    kind = d["workload"].get("kind", "synthetic")
    key = "workload.num_requests" if kind == "synthetic" else "workload.limit"
    return ["--set", f"{key}={N}"], len(d.get("policies") or [None])


def test_every_scenario_is_covered():
    assert len(SCENARIOS) >= 9
    assert {p.stem for p in SCENARIOS} >= {"quickstart", "kv-pressure", "azure-conv",
                                            "mooncake-prefix", "slow-clients", "refbench-h200"}


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_run_exits_0_on_every_scenario(path, tmp_path):
    """Every shipped scenario runs to exit 0 (1 would say it did not meet what was asked:
    requests rejected, cut off or never completed) and writes its summary, one entry
    per run."""
    sets, runs = _tiny(path)
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["run", str(path), *sets, "--out", str(out)])
    assert r.exit_code == 0, (r.output[-2000:], r.exception)
    summary = json.loads((out / "summary.json").read_text())
    assert (len(summary) if runs > 1 else 1) == runs
    assert "never completed" not in r.output


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_plan_runs_on_every_scenario(path, tmp_path):
    """A bound every configuration meets: one replica is chosen for every run of the
    scenario, and every request completed."""
    sets, runs = _tiny(path)
    out = tmp_path / "plan"
    r = CliRunner().invoke(app, ["plan", str(path), *sets, "--slo", "p99_e2el_ms<=1e12",
                                 "--cost-per-gpu-hour", "2", "--search", "replicas=1:2",
                                 "--no-headroom", "--workers", "1", "--out", str(out)])
    pools = (yaml.safe_load(path.read_text()).get("cluster") or {}).get("pools")
    if pools:
        # A mixed fleet has a replica count per pool, a disaggregated one per role: plan
        # says so before any run (the split is searched with --disaggregate, tested in
        # tests/test_disaggregated.py).
        e = r.exception
        roles = any(p.get("role", "mixed") != "mixed" for p in pools)
        want = "count per role" if roles else "mixed fleet"
        assert getattr(e, "exit_code", None) == 2 and want in str(e), (r.output, e)
        assert not out.exists()
        return
    assert r.exit_code == 0, (r.output, r.exception)
    doc = json.loads((out / "plan.json").read_text())
    assert doc["chosen"]["config"]["cluster.replicas"] == 1
    assert doc["chosen"]["violations"] == {}
    ev = pd.read_csv(out / "evaluations.csv")
    # One row per simulated run: each combination's binary search over 1:2 ran 2, then 1.
    assert len(ev) == doc["runs"] == 2 * runs
    assert (ev.groupby("cluster.replicas").size() == runs).all() and ev["feasible"].all()


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_sweep_runs_on_every_scenario(path, tmp_path):
    sets, runs = _tiny(path)
    out = tmp_path / "sweep"
    r = CliRunner().invoke(app, ["sweep", str(path), *sets, "--grid",
                                 "engine.max_num_seqs=16,32", "--workers", "1", "--out", str(out)])
    assert r.exit_code == 0, (r.output, r.exception)
    df = pd.read_csv(out / "results.csv")
    assert len(df) == 2 * runs
    assert "error" not in df or df["error"].isna().all(), df.get("error")
    assert (df["completed"] == N).all()
