"""Sweeps: grid parsing, one tidy table, resume after a kill, local vs Ray executors."""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import yaml
from typer import Typer
from typer.testing import CliRunner

from conftest import REPO, make_scenario_dict
from simulator.errors import LatsimError
from simulator.planning.sweep import Axis, expand, parse_axis, resolve_key, run_sweep

GRID = ["engine.policy=fifo,chunked", "workload.rate=2:6:2"]


def small_base(n=150) -> dict:
    d = make_scenario_dict()
    d["workload"]["num_requests"] = n
    return d


def axes(grid=GRID):
    return [parse_axis(g) for g in grid]


# -- grid ---------------------------------------------------------------------------------

def test_ranges_are_inclusive_on_the_grid_and_decimal_exact():
    assert parse_axis("workload.rate=2:20:2").values == tuple(range(2, 21, 2))
    assert parse_axis("workload.rate=2:19:2").values == (2, 4, 6, 8, 10, 12, 14, 16, 18)
    assert parse_axis("replicas=1:4").values == (1, 2, 3, 4)
    assert parse_axis("x.y=0.1:0.5:0.1").values == (0.1, 0.2, 0.3, 0.4, 0.5)
    assert parse_axis("x.y=1.5:2.5:0.5").values == (1.5, 2.0, 2.5)


def test_lists_are_read_as_yaml_and_points_expand_last_axis_fastest():
    a = parse_axis("engine.chunk_size=256, 512,1024")
    assert a == Axis("engine.chunk_size", (256, 512, 1024))
    assert parse_axis("engine.policy=fifo,chunked").values == ("fifo", "chunked")
    pts = expand([Axis("a", (1, 2)), Axis("b", ("x", "y"))])
    assert pts == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"},
                   {"a": 2, "b": "y"}]


@pytest.mark.parametrize("bad", ["workload.rate=5:2:1", "workload.rate=1:5:0", "seed=1,2",
                                 "workload.rate=", "=1,2"])
def test_bad_axes_are_one_line_errors(bad):
    with pytest.raises(LatsimError):
        parse_axis(bad)


def test_rate_shorthand_follows_the_workload_kind():
    assert resolve_key(small_base(), "workload.rate") == "workload.arrival.rate"
    assert resolve_key({"workload": {"kind": "trace"}}, "rate") == "workload.rate"
    assert resolve_key({}, "replicas") == "cluster.replicas"


# -- the table --------------------------------------------------------------------------

def test_table_has_parameters_seed_and_every_metric(tmp_path):
    base = make_scenario_dict()
    base["workload"]["num_requests"] = 150
    base["workload"]["classes"] = [{"name": "P0", "share": 0.5}, {"name": "P1", "share": 0.5}]
    res = run_sweep(base, REPO, axes(["engine.policy=fifo,chunked"]), tmp_path, seeds=2,
                    workers=1, progress=False)
    df = res.table
    assert list(df.columns[:3]) == ["point", "engine.policy", "seed"]
    assert list(df["engine.policy"]) == ["fifo", "fifo", "chunked", "chunked"]
    assert list(df["seed"]) == [1, 2, 1, 2]
    for col in ("median_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms", "request_throughput",
                "output_throughput", "diagnosis", "P0:p99_ttft_ms", "P1:median_e2el_ms",
                "run.engine_steps", "offered_rate"):
        assert col in df.columns, col
    assert (df["completed"] == 150).all()
    if importlib.util.find_spec("pyarrow"):   # parquet is written when pyarrow is there
        assert pd.read_parquet(tmp_path / "results.parquet").shape == df.shape
    else:
        assert not (tmp_path / "results.parquet").exists()
    # Seeds differ, same seed and point would not.
    assert df["mean_ttft_ms"].nunique() == 4


def test_failing_point_is_recorded_not_fatal(tmp_path):
    base = small_base(50)
    base["engine"]["kv"] = {"gpu_memory_gb": 80}
    res = run_sweep(base, REPO, axes(["engine.kv.gpu_memory_gb=10,80"]), tmp_path,
                    workers=1, progress=False)
    assert res.errors == 1
    assert "no memory for the KV cache" in res.table["error"][0]
    assert res.table["completed"][1] == 50


def test_existing_results_need_resume_or_force(tmp_path):
    run_sweep(small_base(30), REPO, axes(["engine.policy=fifo"]), tmp_path, workers=1,
              progress=False)
    with pytest.raises(LatsimError, match="--resume"):
        run_sweep(small_base(30), REPO, axes(["engine.policy=fifo"]), tmp_path, workers=1,
                  progress=False)
    with pytest.raises(LatsimError, match="other parameters"):
        run_sweep(small_base(30), REPO, axes(["engine.chunk_size=64"]), tmp_path, workers=1,
                  resume=True, progress=False)
    # The same parameter over other values, or another scenario: rows would be matched
    # to other points by index.
    with pytest.raises(LatsimError, match="another sweep .*grid"):
        run_sweep(small_base(30), REPO, axes(["engine.policy=fifo,chunked"]), tmp_path,
                  workers=1, resume=True, progress=False)
    with pytest.raises(LatsimError, match="another sweep .*scenario"):
        run_sweep(small_base(31), REPO, axes(["engine.policy=fifo"]), tmp_path, workers=1,
                  resume=True, progress=False)
    with pytest.raises(LatsimError, match="--limit"):
        run_sweep(small_base(30), REPO, axes(["engine.policy=fifo"]), tmp_path, workers=1,
                  resume=True, limit=0, progress=False)
    again = run_sweep(small_base(30), REPO, axes(["engine.policy=fifo"]), tmp_path, workers=1,
                      force=True, progress=False)
    assert again.ran == 1


# -- interrupted and resumed == uninterrupted -----------------------------------------------

@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    res = run_sweep(small_base(), REPO, axes(), out, seeds=2, workers=2, progress=False)
    assert res.ran == 12 and res.skipped == 0
    return (out / "results.csv").read_bytes()


def test_stopped_half_way_then_resumed_gives_the_same_table(tmp_path, uninterrupted):
    first = run_sweep(small_base(), REPO, axes(), tmp_path, seeds=2, workers=2, limit=5,
                      progress=False)
    assert first.ran == 5 and len(first.table) == 5
    # A kill can leave half a line behind: it is dropped, and that point rerun.
    with open(tmp_path / "results.csv", "a") as f:
        f.write("3,chunked,2,1,150,150,0,0,12")
    second = run_sweep(small_base(), REPO, axes(), tmp_path, seeds=2, workers=2, resume=True,
                       progress=False)
    assert (second.ran, second.skipped) == (7, 5)
    assert (tmp_path / "results.csv").read_bytes() == uninterrupted


_KILLABLE = """
import sys
sys.path[:0] = [{repo!r}, {tests!r}]
from pathlib import Path
from conftest import make_scenario_dict
from simulator.planning.sweep import parse_axis, run_sweep
base = make_scenario_dict()
base["workload"]["num_requests"] = 150
run_sweep(base, Path({repo!r}), [parse_axis(g) for g in {grid!r}], Path({out!r}), seeds=2,
          workers=1, progress=False)
"""


def test_killed_process_resumes_to_the_same_table(tmp_path, uninterrupted):
    out = tmp_path / "out"
    code = _KILLABLE.format(repo=str(REPO), tests=str(REPO / "tests"), grid=GRID, out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", code])
    csv_path = out / "results.csv"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if csv_path.exists() and csv_path.read_text().count("\n") >= 4:  # header + 3 rows
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=60)
    done = max(0, csv_path.read_text().count("\n") - 1)
    assert 3 <= done < 12, "the sweep was not killed half-way"
    res = run_sweep(small_base(), REPO, axes(), out, seeds=2, workers=2, resume=True,
                    progress=False)
    assert res.skipped == done and res.ran == 12 - done
    assert csv_path.read_bytes() == uninterrupted


# -- executors ------------------------------------------------------------------------------

def test_ray_executor_gives_the_same_table_as_local(tmp_path, uninterrupted):
    """``--executor ray`` on a local Ray instance the executor starts (one CPU, no
    dashboard): the same table, byte for byte, as the process pool's."""
    res = run_sweep(small_base(), REPO, axes(), tmp_path, seeds=2, executor="ray", workers=1,
                    progress=False)
    assert res.ran == 12
    assert (tmp_path / "results.csv").read_bytes() == uninterrupted


# A Ray cluster that outlives the sweep: started in its own process, which prints its
# address and keeps the cluster up until its stdin is closed (then Ray shuts it down).
_RAY_HEAD = """
import sys, ray
ctx = ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
print(ctx.address_info["gcs_address"], flush=True)
sys.stdin.read()
"""


def test_sweep_on_a_running_ray_cluster_by_address(tmp_path, monkeypatch):
    """``latsim sweep --executor ray --address HOST:PORT`` runs on that cluster (it does
    not start its own) and writes the table the process pool writes."""
    import ray
    # A test cluster on this machine only: no auth token to hand between the processes.
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump(small_base(60)))
    grid = ["--grid", "engine.policy=fifo,chunked"]
    r = CliRunner().invoke(_app(), ["sweep", str(sc), *grid, "--out", str(tmp_path / "local"),
                                    "--workers", "1"])
    assert r.exit_code == 0, r.output
    head = subprocess.Popen([sys.executable, "-c", _RAY_HEAD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address = head.stdout.readline().strip()
        assert re.fullmatch(r"[\w.\-]+:\d+", address), address
        r = CliRunner().invoke(_app(), ["sweep", str(sc), *grid, "--out", str(tmp_path / "ray"),
                                        "--executor", "ray", "--address", address])
        assert r.exit_code == 0, r.output
        assert not ray.is_initialized()       # it connected, ran, and let go of the cluster
    finally:
        head.stdin.close()
        head.wait(timeout=120)
    assert head.returncode == 0
    assert (tmp_path / "ray" / "results.csv").read_bytes() == \
        (tmp_path / "local" / "results.csv").read_bytes()


def test_address_is_only_for_ray(tmp_path):
    with pytest.raises(LatsimError, match="--address is for --executor ray"):
        run_sweep(small_base(30), REPO, axes(["engine.policy=fifo"]), tmp_path,
                  address="127.0.0.1:6379", progress=False)


def test_unknown_executor_is_an_error(tmp_path):
    with pytest.raises(LatsimError, match="executor"):
        run_sweep(small_base(30), REPO, axes(["engine.policy=fifo"]), tmp_path,
                  executor="dask", progress=False)


# -- the command ------------------------------------------------------------------------------

def _app():
    from simulator.cli.plan import plan, sweep
    app = Typer()
    app.command("sweep")(sweep)
    app.command("plan")(plan)
    return app


def test_sweep_command_writes_csv_and_parquet(tmp_path):
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump(small_base(60)))
    r = CliRunner().invoke(_app(), ["sweep", str(sc), "--grid", "engine.policy=fifo,chunked",
                                    "--grid", "engine.max_num_seqs=4,8", "--out",
                                    str(tmp_path / "o"), "--workers", "1"])
    assert r.exit_code == 0, r.output
    assert "ran 4 point(s)" in r.output and "healthy" in r.output
    df = pd.read_csv(tmp_path / "o" / "results.csv")
    assert df[["engine.policy", "engine.max_num_seqs"]].values.tolist() == [
        ["fifo", 4], ["fifo", 8], ["chunked", 4], ["chunked", 8]]
    r = CliRunner().invoke(_app(), ["sweep", str(sc), "--grid", "engine.policy=nope",
                                    "--out", str(tmp_path / "o2")])
    assert isinstance(r.exception, LatsimError) and "unknown policy" in str(r.exception)


def test_sweep_over_a_scenario_whose_policies_carry_settings(tmp_path):
    """``policies:`` entries with their own engine/kv settings become the policy axis
    (their labels); the other grid axes override what an entry sets."""
    from simulator.planning.sweep import point_scenario, policy_axis
    base = {"engine": {"policy": "chunked", "kv": {"gpu_memory_gb": 24}},
            "policies": [{"policy": "chunked", "label": "swap", "kv": {"preemption": "swap"}},
                         {"policy": "fifo", "label": "big", "max_num_seqs": 8,
                          "kv": {"gpu_memory_gb": 48}}, "priority_aging"]}
    axis, runs = policy_axis(base)
    assert axis.values == ("swap", "big", "priority_aging")
    d = point_scenario(base, {"engine.policy": "big"}, runs)
    assert d["engine"]["policy"] == "fifo" and d["engine"]["max_num_seqs"] == 8
    assert d["engine"]["kv"] == {"gpu_memory_gb": 48}
    d = point_scenario(base, {"engine.policy": "big", "engine.kv.gpu_memory_gb": 80}, runs)
    assert d["engine"]["kv"]["gpu_memory_gb"] == 80
    d = point_scenario(base, {"engine.policy": "swap"}, runs)
    assert d["engine"]["kv"] == {"gpu_memory_gb": 24, "preemption": "swap"}
    assert point_scenario(base, {"engine.policy": "priority_aging"}, runs)["engine"]["policy"] \
        == "priority_aging"
