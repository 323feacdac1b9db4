"""The command line as a user types it: results, files, and one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, make_scenario_dict

LATSIM = [sys.executable, "-m", "simulator.cli"]


# A safety net for a hung command only, never a speed bound: a cold compile of the
# compiled loop took 250 s of a 300 s limit at load average 12 on two cores.
CLI_TIMEOUT_S = 900


def latsim(*args, cwd=REPO):
    return subprocess.run([*LATSIM, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=CLI_TIMEOUT_S)


def _write(tmp_path: Path, data, name="s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def test_quickstart_runs_and_writes_results(tmp_path):
    r = latsim("run", "scenarios/quickstart.yaml", "--out", tmp_path / "out",
               "--set", "workload.num_requests=300")
    assert r.returncode == 0, r.stderr
    for word in ("TTFT", "TPOT", "ITL", "E2EL", "T_QUEUE", "T_STREAM", "class P0", "goodput"):
        assert word in r.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["overall"]["completed"] == 300
    assert set(summary["per_class"]) == {"P0", "P1", "P2"}
    for k in ("median_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "request_goodput", "diagnosis"):
        assert k in summary["overall"]
    resolved = yaml.safe_load((tmp_path / "out" / "scenario.yaml").read_text())
    assert resolved["workload"]["num_requests"] == 300
    assert (tmp_path / "out" / "requests.csv").stat().st_size > 0


def test_policies_side_by_side(tmp_path):
    r = latsim("run", "scenarios/policies-compare.yaml", "--out", tmp_path,
               "--set", "workload.num_requests=200")
    assert r.returncode == 0, r.stderr
    for p in ("fifo", "chunked", "priority_aging"):
        assert p in r.stdout
        assert (tmp_path / f"requests-{p}.csv").exists()
    assert set(json.loads((tmp_path / "summary.json").read_text())) == {
        "fifo", "chunked", "priority_aging"}


def test_same_seed_identical_requests_csv(tmp_path):
    a = latsim("run", "scenarios/quickstart.yaml", "--out", tmp_path / "a",
               "--set", "workload.num_requests=200")
    b = latsim("run", "scenarios/quickstart.yaml", "--out", tmp_path / "b",
               "--set", "workload.num_requests=200")
    assert a.returncode == b.returncode == 0
    assert (tmp_path / "a/requests.csv").read_bytes() == (tmp_path / "b/requests.csv").read_bytes()


def test_simpy_loop_gives_the_same_requests_csv(tmp_path):
    """``--loop compiled`` runs the compiled loop, the default (a small run) SimPy, and
    says why; the tables are the same bytes and each summary says which loop ran."""
    a = latsim("run", "scenarios/quickstart.yaml", "--out", tmp_path / "a",
               "--set", "workload.num_requests=200", "--loop", "compiled")
    b = latsim("run", "scenarios/quickstart.yaml", "--out", tmp_path / "b",
               "--set", "workload.num_requests=200")
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    why = "simpy (200 requests: below 1,000, where loading the compiled loop takes " \
          "longer than running on SimPy)"
    assert "(compiled)" in a.stdout and why in " ".join(b.stdout.split())
    assert (tmp_path / "a/requests.csv").read_bytes() == (tmp_path / "b/requests.csv").read_bytes()
    runs = [json.loads((tmp_path / d / "summary.json").read_text())["run"] for d in "ab"]
    assert [r["event_loop"] for r in runs] == ["compiled", why]
    bad = latsim("run", "scenarios/quickstart.yaml", "--loop", "turbo")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "latsim: error: --loop: must be 'auto', 'compiled' or 'simpy' (got 'turbo')")


def _bad(tmp_path, data):
    p = _write(tmp_path, data)
    r = latsim("run", p)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert str(p) in lines[0]
    return lines[0]


@pytest.mark.parametrize("section,key,value,expect", [
    ("engine", "polcy", "fifo", ["engine.polcy", "unknown key"]),
    ("engine", "max_num_seqs", "lots", ["engine.max_num_seqs", "'lots'"]),
    ("workload.arrival", "rate", -3, ["workload.arrival.rate", "-3"]),
    ("engine", "policy", "lifo", ["engine.policy", "'lifo'", "fifo"]),
])
def test_bad_field_names_field_and_value(tmp_path, section, key, value, expect):
    """Unknown key, wrong type, negative rate, unknown policy: one line, exit 2."""
    d = make_scenario_dict()
    node = d
    for part in section.split("."):
        node = node[part]
    node[key] = value
    line = _bad(tmp_path, d)
    for fragment in expect:
        assert fragment in line, (fragment, line)


def test_unknown_arrival_kind(tmp_path):
    d = make_scenario_dict()
    d["workload"]["arrival"] = {"kind": "weibul", "rate": 1}
    line = _bad(tmp_path, d)
    assert "workload.arrival" in line and "weibul" in line


def test_invalid_yaml(tmp_path):
    line = _bad(tmp_path, "workload: {kind: synthetic\n  rate: [\n")
    assert "invalid YAML" in line and "line" in line


def test_missing_profile(tmp_path):
    d = make_scenario_dict()
    d["model"]["cost"]["path"] = "nope/missing.json"
    p = _write(tmp_path, d)
    r = latsim("run", p)
    assert r.returncode == 2 and "missing.json" in r.stderr and "model.cost.path" in r.stderr
    assert "Traceback" not in r.stderr


def test_profile_path_naming_a_folder(tmp_path):
    d = make_scenario_dict()
    d["model"]["cost"]["path"] = str(tmp_path)
    r = latsim("run", _write(tmp_path, d))
    assert r.returncode == 2 and "model.cost.path" in r.stderr and "is a folder" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_file_and_bad_override(tmp_path):
    r = latsim("run", tmp_path / "none.yaml")
    assert r.returncode == 2 and "none.yaml" in r.stderr and "not found" in r.stderr
    r = latsim("run", "scenarios/quickstart.yaml", "--set", "engine.policy")
    assert r.returncode == 2 and "a.b=value" in r.stderr
    r = latsim("run", "scenarios/quickstart.yaml", "--set", "engine.policy=sjf_oracle")
    assert r.returncode == 2 and "'sjf_oracle'" in r.stderr and "engine.policy" in r.stderr


def test_override_applies(tmp_path):
    r = latsim("run", "scenarios/quickstart.yaml", "--set", "workload.num_requests=50",
               "--set", "engine.policy=fifo", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["policy"] == "fifo" and s["overall"]["num_requests"] == 50


@pytest.mark.parametrize("scenario,n,runs", [
    ("refbench-h200", 150, 3), ("azure-conv", None, 3), ("azure-code", None, 3),
    ("mooncake-conv", None, 3), ("mooncake-prefix", None, 2), ("kv-pressure", 150, 3)])
def test_shipped_scenarios_run_every_policy(tmp_path, scenario, n, runs):
    """Every shipped scenario that reads data/ (or compares runs) runs under
    each of its policies."""
    extra = ["--set", f"workload.num_requests={n}"] if n else ["--set", "workload.limit=150"]
    r = latsim("run", f"scenarios/{scenario}.yaml", "--out", tmp_path, *extra)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary) == runs
    for label, s in summary.items():
        assert s["overall"]["completed"] + s["overall"]["not_finished"] == 150
        assert s["overall"]["completed"] > 0
