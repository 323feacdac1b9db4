"""Fuzzing the inputs: every case ends in a result (exit 0 or 1) or in one
``latsim: error:`` line with exit 2, never a traceback, and in a few seconds.

- a corpus of hand-written bad files (``tests/data/bad/``: scenarios, traces in each
  format, profiles, a lengths file, ServeGen folders), bad flags and bad paths: each one
  must be refused with exit 2 and one line;
- hypothesis-generated scenarios: a valid small scenario with a few of its fields (over
  the whole schema: workload, network, stream, cluster, engine, KV, model, SLOs, policies)
  replaced by values from a mixture of valid alternatives, edge values (0, negative,
  huge, NaN, inf) and junk of every type; traces and profiles with random cells;
- a handful of cases through a real subprocess, to check what reaches a terminal: one
  stderr line under 4 KB.

Cases run the console script's own entry point (``simulator.cli.main.main``) in this
process with ``LATSIM_DEBUG`` set, so that a bug is a test failure with its traceback
rather than the one-line "internal error" a user would see. Examples are derandomised:
CI runs the same cases every time.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO, make_scenario_dict

BAD = REPO / "tests" / "data" / "bad"
DATA = REPO / "tests" / "data"
PROFILE = REPO / "profiles" / "h200-llama3-8b-refbench.json"
FUZZ = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture,
                                       HealthCheck.filter_too_much])


def run_cli(argv, monkeypatch=None) -> tuple[int, str, str]:
    """``latsim ARGV`` in this process: (exit code, stdout, stderr)."""
    from simulator.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def assert_outcome(code, err: str, *, bad: bool = False) -> None:
    """A result (0, 1) or one error line (2); ``bad``: it must be the error line."""
    assert code in ((2,) if bad else (0, 1, 2)), (code, err)
    if code == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1, err
        assert lines[0].startswith("latsim: error: ") and len(lines[0]) < 4096, lines[0]
    assert "Traceback" not in err


@pytest.fixture(autouse=True)
def _debug(monkeypatch):
    monkeypatch.setenv("LATSIM_DEBUG", "1")   # a bug raises here instead of exit 70


# -- the corpus --------------------------------------------------------------------------

def _scenario_for_trace(tmp: Path, trace: Path) -> Path:
    p = tmp / "trace.yaml"
    p.write_text(yaml.safe_dump({"workload": {"kind": "trace", "path": str(trace)},
                                 "model": {"cost": {"kind": "profile", "path": str(PROFILE)}}}))
    return p


@pytest.mark.parametrize("path", sorted((BAD / "scenarios").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_bad_scenario_files(path):
    """Each bad scenario file: exit 2, one line."""
    code, _, err = run_cli(["run", path])
    assert_outcome(code, err, bad=True)


@pytest.mark.parametrize("path", sorted((BAD / "traces").glob("*")), ids=lambda p: p.name)
def test_bad_traces_summarized_and_replayed(path, tmp_path):
    """Each bad trace, summarized and replayed by a scenario: exit 2, one line."""
    code, _, err = run_cli(["trace", "summarize", path])
    assert_outcome(code, err, bad=True)
    code, _, err = run_cli(["run", _scenario_for_trace(tmp_path, path)])
    assert_outcome(code, err, bad=True)


@pytest.mark.parametrize("path", sorted((BAD / "profiles").glob("*")), ids=lambda p: p.name)
def test_bad_profiles(path, tmp_path):
    """Each bad profile, read by a run: exit 2, one line."""
    d = make_scenario_dict()
    d["workload"]["num_requests"] = 20
    d["model"]["cost"]["path"] = str(path)
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    code, _, err = run_cli(["run", p])
    assert_outcome(code, err, bad=True)


def test_the_reference_profile_the_bad_ones_are_made_from_runs(tmp_path):
    """Each bad profile is this one with one defect: it must run, so that they fail for
    their defect alone."""
    d = make_scenario_dict()
    d["workload"]["num_requests"] = 20
    d["model"]["cost"]["path"] = str(BAD / "reference-profile.json")
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    code, out, err = run_cli(["run", p])
    assert code == 0, err


def _ok_scenario(tmp: Path) -> Path:
    d = make_scenario_dict()
    d["workload"]["num_requests"] = 20
    p = tmp / "ok.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


# Flags and paths, each with the scenario (``S``) or a scratch folder (``T``) filled in.
FLAG_CASES = [
    ["run", "S", "--seed", "-1"], ["run", "S", "--seed", "1e3"], ["run", "S", "--loop", "turbo"],
    ["run", "S", "--table-format", "xml"], ["run", "S", "--set", "engine.policy"],
    ["run", "S", "--set", "=3"], ["run", "S", "--set", "a..b=1"],
    ["run", "S", "--set", "workload.num_requests=[&a [1], *a]"],
    ["run", "S", "--set", "workload=&w [*w]"], ["run", "S", "--set", "engine.policy=sjf_oracle"],
    ["run", "S", "--policies", "fifo,nope"], ["run", "S", "--plots"],
    ["run", "S", "--out", "T/file"], ["run", "S", "--out", "T/file/under"],
    ["run", "S", "--bogus"], ["run", "T/missing.yaml"], ["run", "T"], ["run", "/dev/null"],
    ["sweep", "S", "--grid", "engine.policy", "--out", "T/sw"],
    ["sweep", "S", "--grid", "seed=1,2", "--out", "T/sw"],
    ["sweep", "S", "--grid", "workload.rate=5:1", "--out", "T/sw"],
    ["sweep", "S", "--grid", "engine.policy=fifo", "--executor", "dask", "--out", "T/sw"],
    ["sweep", "S", "--grid", "engine.policy=fifo", "--address", "x:1", "--out", "T/sw"],
    ["sweep", "S", "--grid", "engine.policy=fifo", "--out", "T/file"],
    ["sweep", "S", "--grid", "engine.policy=fifo", "--out", "T/file/under"],
    ["sweep", "S", "--grid", "engine.policy=fifo,fifo,nope", "--out", "T/sw"],
    ["trace", "summarize", "T"], ["trace", "summarize", "T/missing.csv"],
    ["trace", "summarize", str(DATA / "canonical_small.csv"), "--window", "5,1"],
    ["trace", "summarize", str(DATA / "canonical_small.csv"), "--window", "a,b"],
    ["trace", "summarize", str(DATA / "canonical_small.csv"), "--format", "parquet"],
    ["trace", "convert", str(DATA / "canonical_small.csv"), "--out", "T"],
    ["trace", "convert", str(DATA / "canonical_small.csv"), "--out", "T/file/x.csv"],
    ["trace", "convert", str(DATA / "canonical_small.csv"), "--out", "T/x.csv", "--rate", "inf"],
    ["trace", "convert", str(DATA / "canonical_small.csv"), "--out", "T/x.csv", "--limit", "0"],
    ["trace", "convert", str(DATA / "canonical_small.csv"), "--out", "T/x.csv", "--speedup",
     "1e-300"],
    ["trace", "convert", str(DATA / "canonical_small.csv"), "--out", "T/x.csv", "--speedup",
     "2", "--rate", "2"],
    ["report", "T/flat-sweep.csv"],
    ["report", "T/missing"], ["report", "T/file"], ["report", "T/garbage"],
    ["report", "T/summary-list"], ["report", "T/no-requests"],
    ["run", "S", "--seed", "99999999999999999999999"],
    ["sweep", "S", "--grid", "engine.policy=fifo", "--limit", "0", "--out", "T/sw"],
    ["sweep", "S", "--grid", "engine.policy=fifo", "--workers", "0", "--out", "T/sw"],
    ["plan", "S", "--cost-per-gpu-hour", "3", "--headroom-tol", "0"],
    ["plan", "S", "--cost-per-gpu-hour", "3", "--headroom-tol", "nan"],
    ["plan", "S", "--cost-per-gpu-hour", "inf"],
    ["plan", "S", "--cost-per-gpu-hour", "3", "--runner-ups", "-1"],
    ["cost", "--kind", "profile", "--model", "llama-3-8b", "--gpu", "h100-80gb",
     "--prefill", "512"],
    ["cost", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--prefill", "100000000x1"],
    ["validate", "--run", str(REPO / "data" / "h200-refbench" / "runs" / "load50-fifo"),
     str(REPO / "scenarios" / "refbench-h200.yaml"), "--limit", "5"],
    ["validate", "--run", str(REPO / "data" / "h200-refbench" / "runs" / "load50-fifo"),
     str(REPO / "scenarios" / "refbench-h200.yaml"), "--out", "T/file"],
    ["calibrate", str(REPO / "scenarios" / "refbench-load50-fifo.yaml"), "--run",
     str(REPO / "data" / "h200-refbench" / "runs" / "load50-fifo"), "--profile", "T/file",
     "--out", "T/cal.json", "--no-sim"],
    ["calibrate", str(REPO / "scenarios" / "refbench-load50-fifo.yaml"), "--run",
     str(REPO / "data" / "h200-refbench" / "runs" / "load50-fifo"), "--run",
     str(REPO / "data" / "h200-refbench" / "runs" / "load50-fifo") + "/", "--out",
     "T/cal.json", "--no-sim"],
    ["validate", "--run", str(REPO / "data" / "h200-refbench" / "runs" / "load50-fifo"),
     str(REPO / "scenarios" / "refbench-h200.yaml"), "--policies", "bogus"],
    # An existing profile is a result: replaced only with --force (and never a folder).
    ["calibrate", str(REPO / "scenarios" / "refbench-load50-fifo.yaml"), "--run",
     str(REPO / "data" / "h200-refbench" / "runs" / "load50-fifo"), "--out", "T/kept.json",
     "--no-sim"],
    ["calibrate", str(REPO / "scenarios" / "refbench-load50-fifo.yaml"), "--run",
     str(REPO / "data" / "h200-refbench" / "runs" / "load50-fifo"), "--out", "T/dir.json",
     "--force", "--no-sim"],
    ["nosuchcommand"],
]


@pytest.mark.parametrize("argv", FLAG_CASES, ids=lambda a: " ".join(a)[:60])
def test_bad_flags_and_paths(argv, tmp_path):
    """Each bad flag, option value or path: exit 2, one line."""
    (tmp_path / "file").write_text("not a folder\n")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "requests.csv").write_text("\x01\x02 not, a, table\n\"\n")
    for name, summary in (("summary-list", "[1, 2]\n"), ("no-requests", "{}\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(summary)
        (tmp_path / name / "requests.csv").write_text(
            "ttft,tpot,e2el\n" + ("0.1,0.01,1.0\n" if name == "summary-list" else ""))
    (tmp_path / "flat-sweep.csv").write_text("point,seed,x\n0,1,2\n")
    (tmp_path / "kept.json").write_text('{"kept": true}\n')
    (tmp_path / "dir.json").mkdir()
    s = _ok_scenario(tmp_path)
    argv = [str(s) if a == "S" else a.replace("T", str(tmp_path), 1) if a.startswith("T")
            else a for a in argv]
    code, _, err = run_cli(argv)
    assert_outcome(code, err, bad=True)
    assert (tmp_path / "kept.json").read_text() == '{"kept": true}\n'


@pytest.mark.parametrize("name", ["binary-nul.yaml", "billion-laughs.yaml", "deep-nesting.yaml",
                                  "seed-negative.yaml"])
def test_a_real_terminal_gets_one_short_line(name):
    """Through a real process: one stderr line under 4 KB."""
    r = subprocess.run([sys.executable, "-m", "simulator.cli", "run",
                        str(BAD / "scenarios" / name)],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert_outcome(r.returncode, r.stderr, bad=True)
    assert len(r.stderr.encode()) < 4096


def test_a_real_terminal_gets_one_line_for_a_bad_trace_and_a_bad_flag():
    """Through a real process: a bad trace and a bad flag are one line each."""
    for argv in (["trace", "summarize", str(BAD / "traces" / "mooncake-deep.jsonl")],
                 ["run", "--version-of-nothing"]):
        r = subprocess.run([sys.executable, "-m", "simulator.cli", *argv], capture_output=True,
                           text=True, cwd=REPO, timeout=120)
        assert_outcome(r.returncode, r.stderr, bad=True)


# -- generated scenarios -----------------------------------------------------------------------

NAMES = ["fifo", "chunked", "priority_aging", "fair_score", "paged", "contiguous", "swap",
         "recompute", "latest", "priority", "http2", "http1.1", "1.2", "1.3", "none", "0rtt",
         "poisson", "gamma", "constant", "uniform", "lognormal", "exponential", "fixed",
         "tiers", "block", "buffer", "degrade", "round_robin", "least_outstanding", "random",
         "nearest_region", "profile", "fitted", "synthetic", "trace", "servegen", "clip", "drop"]

EDGE_NUMBERS = [0, 1, 2, 3, 16, 64, 512, 10**4, 10**12, 2**63, -(2**63) - 1, 10**30, -1, -7,
                0.0, 0.5, 0.9, 1.0, 1.2, 1.3, 2.5, 1e-9, 1e-300, 1e9, 1e300, -0.5,
                float("nan"), float("inf"), float("-inf")]

STRUCTURED = [
    {"kind": "gamma", "rate": 3.0, "burstiness": 0.5}, {"kind": "constant", "rate": 2.0},
    {"kind": "poisson", "rate": 40.0},
    {"kind": "lognormal", "mean": 200, "cv": 1.5, "max": 2000}, {"kind": "constant", "value": 3},
    {"kind": "exponential", "mean": 50}, {"kind": "uniform", "low": 1, "high": 2},
    {"kind": "fixed", "mbps": 1.0}, {"kind": "lognormal", "median_mbps": 5, "sigma": 1.0},
    {"kind": "tiers", "tiers": [{"mbps": 50, "share": 1}, {"mbps": 0.05, "share": 0.3}]},
    {"kind": "exponential", "mean_s": 1.0}, {"kind": "constant", "s": 0.0},
    {"kind": "uniform", "low_s": 1, "high_s": 0.5},
    [{"name": "a", "share": 1, "slo": {"ttft_ms": 100}}, {"name": "b", "share": 2}],
    [{"name": "a", "share": 1, "system_prompt_tokens": 64}, {"name": "a"}],
    [{"name": "x", "priority": 3}], ["fifo", "chunked"],
    [{"name": "[/b]", "share": 1}, {"name": "[bold]", "share": 1}],
    [{"policy": "fifo", "label": "[/x]"}, {"policy": "chunked", "label": "[red]"}],
    [{"policy": "fifo", "label": "../a b"}, {"policy": "chunked", "label": "../a_b"}],
    ["fifo", {"policy": "chunked", "label": "c2", "kv": {"preemption": "swap"}}],
    [{"policy": "fifo", "kv": {"bogus": 1}}],
    {"probability": 0.5, "signalled": 0.5}, {"ttft_ms": 50, "tpot_ms": 10},
    {"serving": [{"name": "eu", "replicas": 1}],
     "clients": [{"name": "c", "share": 1, "distance_km": {"eu": 100}}]},
    {"kind": "fair_score", "w_wait": 2.0}, {"kind": "chunked", "nope": 1},
    {"kind": "trace", "path": str(DATA / "canonical_small.csv")},
    {"kind": "trace", "path": str(DATA / "mooncake_conv_head30.jsonl"), "limit": 10,
     "speedup": 100.0},
    {"kind": "trace", "path": str(DATA / "azure_conv_head40.csv"), "rate": 3.0,
     "window": [0, 100]},
    {"kind": "servegen", "path": str(DATA / "servegen_mini"), "window": [0, 600],
     "clients": [35], "rate_scale": 0.05},
    {"path": str(REPO / "data" / "sarathi_serve" / "processed_traces" /
              "sharegpt_8k_filtered_stats_llama2_tokenizer.csv")},
    {"kind": "profile", "path": str(PROFILE), "noise": True},
    {"kind": "profile", "path": str(PROFILE), "scale": 1e300},
]

PATHS = [
    "name", "seed", "max_sim_time_s", "policies", "plugins", "slo", "slo.ttft_ms", "slo.e2el_ms",
    "workload", "workload.kind", "workload.num_requests", "workload.duration_s",
    "workload.arrival", "workload.arrival.kind", "workload.arrival.rate",
    "workload.arrival.burstiness", "workload.prompt_tokens", "workload.prompt_tokens.kind",
    "workload.prompt_tokens.low", "workload.prompt_tokens.high", "workload.prompt_tokens.max",
    "workload.output_tokens", "workload.output_tokens.min", "workload.output_tokens.high",
    "workload.classes", "workload.lengths_file",
    "network.distance_km", "network.base_rtt_ms", "network.fibre_km_per_s", "network.tls",
    "network.connection_reuse", "network.clients", "network.pool_size", "network.keepalive_s",
    "network.uplink_mbps", "network.request_overhead_bytes", "network.gateway_ms",
    "network.protocol", "network.h2_max_streams", "network.regions",
    "stream.frame_overhead_bytes", "stream.bytes_per_token", "stream.downlink_mbps",
    "stream.downlink", "stream.every_tokens", "stream.every_ms", "stream.heartbeat_s",
    "stream.buffer_bytes", "stream.backpressure", "stream.disconnect",
    "stream.disconnect.probability", "stream.disconnect.after_first_token",
    "stream.disconnect.heartbeat_timeout_s", "cluster.replicas", "cluster.router",
    "cluster.gpus_per_replica", "engine.policy", "engine.policy_params", "engine.max_num_seqs",
    "engine.max_num_batched_tokens", "engine.chunk_size", "engine.aging_s",
    "engine.kv.block_size", "engine.kv.num_blocks", "engine.kv.gpu_memory_gb",
    "engine.kv.gpu_memory_utilization", "engine.kv.allocation", "engine.kv.max_model_len",
    "engine.kv.watermark", "engine.kv.preemption", "engine.kv.victim", "engine.kv.swap_space_gb",
    "engine.kv.swap_gb_per_s", "engine.kv.prefix_caching", "model.cost", "model.cost.kind",
    "model.cost.path", "model.cost.scale", "model.shape", "model.shape.n_layers",
    "model.shape.params_b", "engine.kv.nonsense", "nonsense",
]

junk = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=12),
                              st.floats(allow_nan=True, allow_infinity=True)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(st.text(max_size=6), inner,
                                                            max_size=3)),
                    max_leaves=6)
edge = st.one_of(st.sampled_from(EDGE_NUMBERS), st.sampled_from(NAMES),
                 st.sampled_from(STRUCTURED))

# Plausible values per field: most generated scenarios should run, so that the mixture
# tests what valid combinations do, not only how invalid ones are refused.
_f = st.floats
_i = st.integers
_pick = st.sampled_from
classes = st.lists(st.fixed_dictionaries(
    {"name": _pick(["P0", "P1", "P2", "batch"]), "share": _f(0.05, 5)},
    optional={"priority": _i(0, 3), "slo": st.fixed_dictionaries({"ttft_ms": _f(1, 5000)}),
              "system_prompt_tokens": _i(0, 300)}), min_size=1, max_size=3)
VALID = {
    "seed": _i(0, 2**63 - 1), "max_sim_time_s": _f(0.5, 120), "name": st.text(max_size=20),
    "slo.ttft_ms": _f(1, 10_000), "slo.e2el_ms": _f(1, 60_000),
    "policies": st.lists(_pick(["fifo", "chunked", "priority_aging", "fair_score"]),
                         min_size=1, max_size=3, unique=True),
    "workload.num_requests": _i(1, 300), "workload.duration_s": _f(0.5, 60),
    "workload.arrival.rate": _f(0.1, 200), "workload.arrival.kind": _pick(["poisson", "constant"]),
    "workload.prompt_tokens.low": _i(1, 3000), "workload.prompt_tokens.high": _i(1, 6000),
    "workload.prompt_tokens.max": _i(1, 6000), "workload.output_tokens.min": _i(1, 50),
    "workload.output_tokens.high": _i(1, 800), "workload.classes": classes,
    "network.distance_km": _f(0, 20_000), "network.base_rtt_ms": _f(0, 200),
    "network.tls": _pick(["none", "1.2", "1.3", "0rtt", 1.2, 1.3]),
    "network.connection_reuse": st.booleans(), "network.clients": _i(1, 200),
    "network.pool_size": _i(1, 16), "network.keepalive_s": _f(0, 600),
    "network.uplink_mbps": _f(0.01, 1000), "network.protocol": _pick(["http1.1", "http2"]),
    "network.h2_max_streams": _i(1, 200), "network.gateway_ms": _f(0, 50),
    "stream.frame_overhead_bytes": _i(0, 500), "stream.bytes_per_token": _f(0, 16),
    "stream.downlink_mbps": _f(0.01, 1000), "stream.every_tokens": _i(1, 16),
    "stream.every_ms": _f(1, 500), "stream.heartbeat_s": _f(0.01, 30),
    "stream.buffer_bytes": _i(100, 100_000), "stream.backpressure": _pick(["buffer"]),
    "stream.disconnect.probability": _f(0, 1), "stream.disconnect.heartbeat_timeout_s": _f(1, 60),
    "cluster.replicas": _i(1, 4),
    "cluster.router": _pick(["round_robin", "least_outstanding", "random"]),
    "engine.policy": _pick(["fifo", "chunked", "priority_aging", "fair_score"]),
    "engine.max_num_seqs": _i(1, 128), "engine.max_num_batched_tokens": _i(16, 4096),
    "engine.chunk_size": _i(1, 1024), "engine.aging_s": _f(0.01, 30),
    "engine.kv.block_size": _pick([1, 8, 16, 32]), "engine.kv.num_blocks": _i(1, 20_000),
    "engine.kv.gpu_memory_gb": _f(10, 200), "engine.kv.gpu_memory_utilization": _f(0.1, 1),
    "engine.kv.allocation": _pick(["paged", "contiguous"]),
    "engine.kv.max_model_len": _i(16, 8192), "engine.kv.watermark": _f(0, 0.5),
    "engine.kv.preemption": _pick(["recompute", "swap"]),
    "engine.kv.victim": _pick(["priority", "latest"]), "engine.kv.swap_space_gb": _f(0, 64),
    "engine.kv.swap_gb_per_s": _f(0.1, 100), "engine.kv.prefix_caching": st.booleans(),
    "model.cost.scale": _f(0.1, 10), "model.cost.kind": _pick(["profile"]),
    "model.shape.n_layers": _i(1, 80), "model.shape.params_b": _f(0.1, 100),
    "cluster.gpus_per_replica": _i(1, 8),
    "workload.arrival": _pick([x for x in STRUCTURED if isinstance(x, dict) and "rate" in x]),
    "workload.prompt_tokens": _pick([x for x in STRUCTURED if isinstance(x, dict)
                                     and x.get("kind") in ("lognormal", "constant", "uniform",
                                                           "exponential") and "s" not in x
                                     and "mean_s" not in x and "low_s" not in x]),
    "stream.downlink": _pick([x for x in STRUCTURED if isinstance(x, dict)
                              and x.get("kind") in ("fixed", "tiers") or "median_mbps" in x]),
    "stream.disconnect": st.fixed_dictionaries({"probability": _f(0, 1),
                                                "signalled": _f(0, 1)}),
}
VALID["workload.output_tokens"] = VALID["workload.prompt_tokens"]


def value_for(path: str):
    """Mostly a plausible value for ``path``, else an edge value or junk."""
    plausible = VALID.get(path, edge)
    return st.integers(0, 9).flatmap(lambda k: plausible if k < 8 else edge if k == 8 else junk)


mutation = st.sampled_from(PATHS).flatmap(lambda p: st.tuples(st.just(p), value_for(p)))
mutations = st.lists(mutation, min_size=1, max_size=3)

MAX_REQUESTS = 400   # a generated run stays small (a few seconds at most)


def _set(d: dict, dotted: str, value) -> None:
    node = d
    keys = dotted.split(".")
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    node[keys[-1]] = copy.deepcopy(value)


def _keep_small(d: dict) -> None:
    """A valid synthetic workload of more than ``MAX_REQUESTS`` requests (but not so many
    that the run is refused at once) is cut to ``MAX_REQUESTS``: the fuzz is about
    inputs, not about long runs."""
    from simulator.config.scenario import validate_scenario
    from simulator.errors import LatsimError
    try:
        sc = validate_scenario(d)
    except LatsimError:
        return
    expected = getattr(sc.workload, "expected_requests", None)
    if expected is not None and MAX_REQUESTS < expected() < 10**9:
        d["workload"]["num_requests"] = MAX_REQUESTS
        d["workload"].pop("duration_s", None)


@settings(FUZZ, max_examples=100)
@given(mutations, st.sampled_from(["auto", "auto", "auto", "compiled"]))
def test_generated_scenarios(tmp_path_factory, muts, loop):
    """Mutated scenarios (written results included): a result or one error line."""
    d = make_scenario_dict()
    d["workload"]["num_requests"] = 40
    for path, value in muts:
        _set(d, path, value)
    _keep_small(d)
    p = tmp_path_factory.mktemp("fuzz") / "s.yaml"
    try:
        p.write_text(yaml.safe_dump(d, allow_unicode=True))
    except (yaml.YAMLError, ValueError):   # not representable as YAML: nothing to test
        return
    code, _, err = run_cli(["run", p, "--loop", loop, "--out", p.parent / "out"])
    assert_outcome(code, err)


cell = st.one_of(st.sampled_from(["0", "1", "17", "1e30", "-1", "nan", "inf", "", " ", "1.5",
                                  "x", "99999999999999999999", "2023-11-16 18:15:46.6", "P1",
                                  "0 1", "a b", '"q,"', "1e-300"]),
                 st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=6))
HEADERS = {"csv": "arrival_s,prompt_tokens,output_tokens,priority,prefix_hashes",
           "azure": "TIMESTAMP,ContextTokens,GeneratedTokens",
           "vidur": "arrived_at,num_prefill_tokens,num_decode_tokens"}


@FUZZ
@given(st.sampled_from(sorted(HEADERS)), st.lists(st.lists(cell, min_size=1, max_size=6),
                                                  min_size=1, max_size=5))
def test_generated_csv_traces(tmp_path_factory, fmt, rows):
    """CSV traces of random cells in each tabular format: a summary or one error line."""
    import csv
    p = tmp_path_factory.mktemp("trace") / f"t-{fmt}.csv"
    buf = io.StringIO()
    buf.write(HEADERS[fmt] + "\n")
    csv.writer(buf, lineterminator="\n").writerows(rows)
    p.write_text(buf.getvalue())
    code, _, err = run_cli(["trace", "summarize", p, "--format", fmt])
    assert_outcome(code, err)


json_value = st.one_of(st.sampled_from([0, 1, 500, 1e30, -1, 1.5, "12", "", True, None, [],
                                        {}, [1, 2], 10**25, float("nan"), float("inf")]),
                       st.integers(), st.text(max_size=5))


@FUZZ
@given(st.lists(st.dictionaries(st.sampled_from(["timestamp", "input_length", "output_length",
                                                 "hash_ids", "extra"]), json_value,
                                min_size=2, max_size=5), min_size=1, max_size=4))
def test_generated_mooncake_traces(tmp_path_factory, recs):
    """Mooncake JSON lines of random values: a summary or one error line."""
    p = tmp_path_factory.mktemp("mc") / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    code, _, err = run_cli(["trace", "summarize", p])
    assert_outcome(code, err)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["prefill", "decode", "mixed", "decode_eager",
                                           "prefill_partial"]),
                          st.integers(0, 3),
                          st.sampled_from(["ms", "batch", "context", "chunk", "prior"]),
                          json_value), min_size=1, max_size=3))
def test_generated_profiles(tmp_path_factory, edits):
    """Profiles with random cells: a run or one error line."""
    prof = json.loads(PROFILE.read_text())
    for section, i, col, v in edits:
        rows = prof.setdefault(section, [])
        while len(rows) <= i:
            rows.append(dict(rows[-1]) if rows else {"batch": 1, "context": 1, "chunk": 1,
                                                     "prior": 0, "ms": 1.0})
        rows[i][col] = v
    d = tmp_path_factory.mktemp("prof")
    (d / "p.json").write_text(json.dumps(prof))
    s = make_scenario_dict()
    s["workload"]["num_requests"] = 20
    s["model"]["cost"]["path"] = str(d / "p.json")
    (d / "s.yaml").write_text(yaml.safe_dump(s))
    code, _, err = run_cli(["run", d / "s.yaml"])
    assert_outcome(code, err)


# -- issue 28's classes of bad input, each across the commands that read it ---------------
#
# Each case builds its input in tmp_path and must end in one ``latsim: error:`` line
# (exit 2) holding the words given: the file and field named, never a traceback (the
# tests run with LATSIM_DEBUG), an exit 0 or a hang.

import json as _json  # noqa: E402
import os as _os  # noqa: E402

RUN28 = REPO / "data" / "h200-refbench" / "runs" / "load50-fifo"


def _results_folder(tmp: Path) -> Path:
    """A small `latsim run --out` folder (requests.csv, summary.json, timeseries.csv)."""
    out = tmp / "res"
    code, _, err = run_cli(["run", _ok_scenario(tmp), "--out", out])
    assert code == 0, err
    return out


def _pipe(p: Path) -> None:
    p.unlink()
    _os.mkfifo(p)


def _loop(p: Path) -> None:
    p.unlink()
    _os.symlink(p.name + ".b", p)
    _os.symlink(p.name, p.with_name(p.name + ".b"))


def _folder(p: Path) -> None:
    p.unlink()
    p.mkdir()


NOT_WHAT_THEY_CLAIM = {"pipe": (_pipe, "is not a regular file"),
                       "link-loop": (_loop, "Too many levels of symbolic links"),
                       "folder": (_folder, "is a folder"),
                       "latin1": (lambda p: p.write_bytes(p.read_bytes() + b"caf\xe9\n"),
                                  "not a UTF-8 text file (byte 0xe9")}


@pytest.mark.parametrize("how", sorted(NOT_WHAT_THEY_CLAIM))
@pytest.mark.parametrize("name", ["requests.csv", "summary.json", "timeseries.csv"])
def test_report_refuses_a_results_file_that_is_not_one(tmp_path, name, how):
    """A pipe (report blocked forever on it), a link loop or a folder (skipped as
    missing, exit 0), latin-1 bytes where a results file should be: one line naming
    the file."""
    res = _results_folder(tmp_path)
    edit, words = NOT_WHAT_THEY_CLAIM[how]
    edit(res / name)
    code, _, err = run_cli(["report", res])
    assert_outcome(code, err, bad=True)
    assert f"{res / name}: " in err and words in err, err


@pytest.mark.parametrize("summary, field", [
    ({"policy": [1, 2]}, "policy"), ({"policy": "fifo", "overall": [1]}, "overall"),
    ({"policy": "fifo", "per_class": "x"}, "per_class"), ({"fifo": [1, 2, 3]}, "fifo"),
    ("deep", None)])
def test_report_refuses_a_summary_of_the_wrong_shape(tmp_path, summary, field):
    """summary.json sections of the wrong JSON type (were used or ignored: exit 0), or
    JSON nested 10^5 deep (a RecursionError, exit 70)."""
    res = _results_folder(tmp_path)
    sj = res / "summary.json"
    sj.write_text("[" * 100_000 + "]" * 100_000 if summary == "deep" else
                  _json.dumps(summary))
    code, _, err = run_cli(["report", res])
    assert_outcome(code, err, bad=True)
    assert f"{sj}: " in err, err
    assert (f"field '{field}'" in err) if field else ("nested too deeply" in err), err


@pytest.mark.parametrize("col, value, words", [
    ("ttft", 1e300, "no run spans more than 1e11 s (got 1e+300)"),
    ("e2el", -5.0, "in [0, 1e+11] (got -5.0)"), ("tpot", "inf", "finite"),
    ("first_token", -1e300, "a time in seconds")])
def test_report_refuses_latencies_no_run_can_have(tmp_path, col, value, words):
    """A latency of 1e300 s or a negative one (a plot spanning 10^300 or below 0, exit
    0): one line naming the file, the column and row, and the value."""
    import pandas as pd
    res = _results_folder(tmp_path)
    df = pd.read_csv(res / "requests.csv")
    df[col] = df[col].astype(object)
    df.loc[3, col] = value
    df.to_csv(res / "requests.csv", index=False)
    code, _, err = run_cli(["report", res])
    assert_outcome(code, err, bad=True)
    assert f"field '{col} (row 4)'" in err and words in err, err


def test_sweep_tables_with_impossible_latencies_are_refused(tmp_path):
    import pandas as pd
    t = tmp_path / "sweep.csv"
    pd.DataFrame({"point": [0, 1], "workload.arrival.rate": [1.0, 2.0], "seed": [1, 1],
                  "median_ttft_ms": [10.0, 12.0], "p99_ttft_ms": [20.0, 1e300],
                  "median_tpot_ms": [5.0, 5.0], "p99_tpot_ms": [6.0, -1.0]}).to_csv(t, index=False)
    code, _, err = run_cli(["report", t])
    assert_outcome(code, err, bad=True)
    assert "field 'p99_ttft_ms (row 2)'" in err and "1e+300" in err, err


@pytest.mark.parametrize("value, tag", [
    ("!!binary MjA=", "!!binary"), ("!!python/object:os.system ls", "!!python/object:os.system"),
    ("!!timestamp 2001-12-14", "!!timestamp"), ("!!set {20: null}", "!!set"),
    ("!!omap [a: 1]", "!!omap"), ("!!pairs [a: 1]", "!!pairs"), ("!local 20", "!local")])
def test_yaml_tags_that_smuggle_another_type_are_refused(tmp_path, value, tag):
    """A tag where an integer goes (``!!binary`` built bytes; ``!!set`` a set ...): one
    line naming the field, the line and the tag; in a scenario and in --set alike."""
    d = make_scenario_dict()
    d["workload"]["num_requests"] = 20
    text = yaml.safe_dump(d).replace("num_requests: 20", f"num_requests: {value}")
    p = tmp_path / "s.yaml"
    p.write_text(text)
    code, _, err = run_cli(["run", p])
    assert_outcome(code, err, bad=True)
    assert "field 'workload.num_requests'" in err and f"YAML tag {tag} at line" in err, err
    code, _, err = run_cli(["run", _ok_scenario(tmp_path), "--set",
                            f"workload.num_requests={value}"])
    assert_outcome(code, err, bad=True)
    assert f"YAML tag {tag}" in err, err


def test_an_unquoted_date_is_text_not_a_datetime():
    """``name: 2024-01-01`` is the name it reads as (the loader builds no datetime)."""
    from simulator.config.yamlfile import safe_yaml
    assert safe_yaml("name: 2024-01-01\nseed: 3\n", "s.yaml") == {"name": "2024-01-01",
                                                                 "seed": 3}


_PROFILE_EDITS = {
    "meta.model": ([1, 2], "must be a mapping"), "meta.model.n_layers": ("thirty", "whole"),
    "meta.model.n_heads": (0, "whole number in [1"), "meta.model.d_model": (1e30, "1e+07"),
    "meta.model.n_kv_heads": (64, "at most n_heads"), "meta.peak_tflops": ("many", "number"),
    "meta.hardware": ([1], "must be text"), "engine.graph_batch_buckets": (["a"], "batch sizes"),
}


@pytest.mark.parametrize("field", sorted(_PROFILE_EDITS))
@pytest.mark.parametrize("cmd", ["fit", "cost", "run"])
def test_profiles_with_wrong_types_or_impossible_values(tmp_path, cmd, field):
    """A list where meta.model goes, text where numbers go, zero heads, a 10^30-wide
    model: refused by the profile's one check (``check_profile``) in fit, cost --profile
    and a scenario's fitted model alike (were AttributeError / ValueError /
    ZeroDivisionError, exit 70, or silently used)."""
    value, words = _PROFILE_EDITS[field]
    prof = _json.loads(PROFILE.read_text())
    node = prof
    keys = field.split(".")
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    p = tmp_path / "p.json"
    p.write_text(_json.dumps(prof))
    if cmd == "fit":
        argv = ["fit", p]
    elif cmd == "cost":
        argv = ["cost", "--profile", p, "--decode", "8@1000"]
    else:
        d = make_scenario_dict()
        d["workload"]["num_requests"] = 20
        d["model"]["cost"] = {"kind": "fitted", "path": str(p)}
        s = tmp_path / "s.yaml"
        s.write_text(yaml.safe_dump(d))
        argv = ["run", s]
    code, _, err = run_cli(argv)
    assert_outcome(code, err, bad=True)
    assert f"field '{field}'" in err and words in err, err


def _servegen(tmp: Path, rows: str, pmf_in: str = "{100: 0.5, 300: 0.5}") -> Path:
    f = tmp / "sg"
    f.mkdir()
    (f / "chunk-1-trace.csv").write_text(rows)
    (f / "chunk-1-dataset.json").write_text(_json.dumps(
        {"0": {"input_tokens": pmf_in, "output_tokens": "{50: 1.0}", "reason_ratio": "{}"}}))
    d = make_scenario_dict()
    d["workload"] = {"kind": "servegen", "path": str(f), "window": [0, 600]}
    s = tmp / "s.yaml"
    s.write_text(yaml.safe_dump(d))
    return s


@pytest.mark.parametrize("rows, pmf, words", [
    ("0,0.05,1.0,Weibull,0.001,1.0\n", "{100: 1.0}", "column 'shape': a Weibull shape below"),
    ("0,0.05,1.0,Gamma,1e-300,1.0\n", "{100: 1.0}", "column 'shape': a Gamma shape below"),
    ("0,0.05,1.0,Gamma,1.0,1.0\n", "{-100: 1.0}", "whole number >= 1 (got -100)"),
    ("0,0.05,1.0,Gamma,1.0,1.0\n", "{0: 0.5, 20: 0.5}", "whole number >= 1 (got 0)"),
    ("0,0.05,1.0,Gamma,1.0,1.0\n", "{2.5: 1.0}", "whole number >= 1 (got 2.5)")])
def test_servegen_numbers_a_sampler_cannot_hold(tmp_path, rows, pmf, words):
    """A Weibull shape of 0.001 (math.gamma overflowed: exit 70), a Gamma shape whose
    gaps all underflow to 0, negative, zero or fractional token counts in a pmf (were
    clipped to 1 token, silently): one line naming the file and the field."""
    code, _, err = run_cli(["run", _servegen(tmp_path, rows, pmf)])
    assert_outcome(code, err, bad=True)
    assert words in err, err


def test_a_gamma_burstiness_below_what_floating_point_holds_is_refused(tmp_path):
    d = make_scenario_dict()
    d["workload"]["num_requests"] = 20
    d["workload"]["arrival"] = {"kind": "gamma", "rate": 5.0, "burstiness": 0.001}
    s = tmp_path / "s.yaml"
    s.write_text(yaml.safe_dump(d))
    code, _, err = run_cli(["run", s])
    assert_outcome(code, err, bad=True)
    assert "workload.arrival.burstiness" in err and "0.01" in err, err


def test_class_shares_whose_sum_overflows_still_split_evenly():
    """Two shares of 1e308 (their sum is inf: numpy refused the probabilities, exit 70)
    are equal weights."""
    import numpy as np
    from simulator.workload.classes import PriorityClass, assign_classes
    cls = [PriorityClass(name="a", share=1e308), PriorityClass(name="b", share=1e308)]
    p = assign_classes(cls, 20_000, np.random.default_rng(1))
    assert abs((p == 0).mean() - 0.5) < 0.02   # binomial sd 0.0035 at n = 20,000


@pytest.mark.parametrize("stamps, ok", [
    (["2023-11-16 18:15:46.68+00:00", "2023-11-16 18:15:47.1", "2023-11-16 18:15:48+00:00"],
     False),
    (["2023-11-16 18:15:46.68", "2023-11-16 18:15:47.1Z", "2023-11-16 18:15:48"], False),
    (["2023-11-16T18:15:46Z", "2023-11-16T10:15:47-08:00", "2023-11-16T19:15:48+01:00"], True),
    (["2023-11-16 18:15:46", "9999-12-31 23:59:59"], False)])
def test_time_stamps_with_mixed_time_zones(tmp_path, stamps, ok):
    """Stamps with and without a zone mixed (pandas raised 'Mixed timezones', exit 70):
    one line naming the line; stamps all with zones, of different offsets, are instants
    compared in UTC (1 s apart each here); a year-9999 stamp is beyond a trace's span
    (it overflowed the nanosecond cast)."""
    t = tmp_path / "t.csv"
    t.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 + "".join(f"{s},100,10\n" for s in stamps))
    code, out, err = run_cli(["trace", "summarize", t])
    if ok:
        assert code == 0, err
        from simulator.workload.tracereaders import read_trace
        assert list(read_trace(t).time_s) == [0.0, 1.0, 2.0]
    else:
        assert_outcome(code, err, bad=True)
        assert f"{t}:3: column 'TIMESTAMP'" in err, err


@pytest.mark.parametrize("body, words", [
    ("import sys\nsys.exit(0)\n", "called sys.exit(0) while being imported"),
    ("import sys\nsys.exit('bye')\n", "called sys.exit('bye')"),
    ("class E(BaseException):\n    pass\nraise E('x')\n", "failed to load: E: x")])
@pytest.mark.parametrize("cmd", ["run", "sweep"])
def test_a_plugin_that_exits_while_imported_is_a_bad_input(tmp_path, body, words, cmd):
    """sys.exit(0) in a plug-in's import ended latsim with exit 0 having written
    nothing: it is now one line naming the plug-in file, exit 2."""
    (tmp_path / "plug.py").write_text(body)
    d = make_scenario_dict()
    d["workload"]["num_requests"] = 20
    d["plugins"] = ["plug.py"]
    s = tmp_path / "s.yaml"
    s.write_text(yaml.safe_dump(d))
    argv = ["run", s, "--out", tmp_path / "o"] if cmd == "run" else \
        ["sweep", s, "--grid", "workload.arrival.rate=2,4", "--out", tmp_path / "o"]
    code, _, err = run_cli(argv)
    assert_outcome(code, err, bad=True)
    assert f"plug-in {tmp_path / 'plug.py'} {words}" in err, err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


@pytest.fixture(scope="module")
def _a_sweep(tmp_path_factory):
    """A finished two-point sweep (its scenario, its folder), copied by each case."""
    tmp = tmp_path_factory.mktemp("sweep28")
    s = _ok_scenario(tmp)
    out = tmp / "sw"
    code, _, err = run_cli(["sweep", s, "--grid", "workload.arrival.rate=2,4", "--out", out])
    assert code == 0, err
    return s, out


@pytest.mark.parametrize("how", sorted(NOT_WHAT_THEY_CLAIM) + ["deep", "binary-tag"])
@pytest.mark.parametrize("name", ["results.csv", "sweep.yaml"])
def test_sweep_resume_refuses_a_table_that_is_not_one(tmp_path, _a_sweep, name, how,
                                                      monkeypatch):
    """``sweep --resume`` over a results table or sweep record that is a pipe (it
    blocked), a link loop (started over, exit 0), a folder or latin-1 bytes (exit 70),
    YAML nested 10^5 deep (RecursionError, exit 70) or tagged !!binary: one line naming
    the file, before any point runs."""
    import shutil
    monkeypatch.setenv("LATSIM_DEBUG", "1")
    s, src = _a_sweep
    out = tmp_path / "sw"
    shutil.copytree(src, out)
    p = out / name
    if how == "deep":
        if name != "sweep.yaml":
            pytest.skip("YAML only")
        p.write_text("[" * 100_000 + "]" * 100_000)
        words = "nesting depth"   # the C parser stops at 1,000 levels
    elif how == "binary-tag":
        if name != "sweep.yaml":
            pytest.skip("YAML only")
        p.write_text("grid: !!binary aGVsbG8=\n")
        words = "YAML tag !!binary"
    else:
        edit, words = NOT_WHAT_THEY_CLAIM[how]
        edit(p)
    code, _, err = run_cli(["sweep", s, "--grid", "workload.arrival.rate=2,4", "--out", out,
                            "--resume"])
    assert_outcome(code, err, bad=True)
    assert f"{p}: " in err and words in err, err


@pytest.mark.parametrize("where", ["engine.aging_s", "policies"])
def test_an_aging_interval_the_int64_key_cannot_hold_is_refused(tmp_path, where):
    """priority_aging floors wait / aging_s into an int64 in the compiled loop: at
    aging_s 1e-300 a 5 s wait is 5e300 classes (numba saturates it at -2^63, Python's
    int does not). Refused at the field, below a microsecond."""
    import math
    d = make_scenario_dict()
    d["workload"]["num_requests"] = 20
    if where == "engine.aging_s":
        d["engine"].update(policy="priority_aging", aging_s=1e-300)
    else:
        d["policies"] = [{"policy": "priority_aging", "aging_s": 1e-300}]
    s = tmp_path / "s.yaml"
    s.write_text(yaml.safe_dump(d))
    code, _, err = run_cli(["run", s])
    assert_outcome(code, err, bad=True)
    assert "aging_s" in err and "0.000001" in err, err
    assert 5.0 / 1e-300 > 2.0**63 and 1e11 / 1e-6 < 2.0**63 and not math.isinf(5.0 / 1e-300)


def test_a_deep_profile_of_a_named_model_is_named_as_the_profile(tmp_path):
    """JSON nested 10^5 deep as the profile of a scenario naming its model: the model
    check read it first and its RecursionError blamed 'the scenario'; now the profile's
    own reader names it."""
    p = tmp_path / "deep.json"
    p.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    d = make_scenario_dict()
    d["workload"]["num_requests"] = 20
    d["model"] = {"name": "llama3-8b", "cost": {"kind": "profile", "path": str(p)}}
    s = tmp_path / "s.yaml"
    s.write_text(yaml.safe_dump(d))
    code, _, err = run_cli(["run", s])
    assert_outcome(code, err, bad=True)
    assert f"{p}: invalid JSON: nested too deeply" in err, err


def test_a_deep_model_config_is_named_as_the_config(tmp_path):
    """A model.name config.json nested 10^5 deep: its reader names it (the scenario
    loader's RecursionError said 'the scenario is nested too deeply')."""
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    d = make_scenario_dict()
    d["workload"]["num_requests"] = 20
    d["model"] = {"name": str(m / "config.json"), "cost": {"kind": "roofline", "gpu": "h200"}}
    s = tmp_path / "s.yaml"
    s.write_text(yaml.safe_dump(d))
    code, _, err = run_cli(["run", s])
    assert_outcome(code, err, bad=True)
    assert "nested too deeply" in err and "config.json" in err, err
