"""inference-perf traffic as a workload, runs of aggregates (inference-perf folders and
``vllm bench serve`` JSON) for ``latsim validate --run``, and the replay benchmark of
``data/vllm-h100-runs``. Small recordings made in each format live in ``tests/data``."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simulator.config import plugins  # noqa: F401  (registers kind: inference_perf)
from simulator.cost.calibration.aggregates import (compare_aggregates, read_summary_run,
                                                   run_workload, saturated, sim_aggregates)
from simulator.errors import LatsimError
from simulator.workload.inference_perf import (InferencePerfWorkload, build_inference_perf,
                                               read_config)

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
MINI = DATA / "inference_perf_mini"
VLLM_JSON = DATA / "vllm_bench_mini.json"
RUNS = REPO / "data" / "vllm-h100-runs"
CODEGEN = RUNS / "20260217-155451-llama-2-7b-tp1-codegen"

SCENARIO = """\
name: t
seed: 0
workload: {kind: synthetic, num_requests: 20, arrival: {rate: 1.0},
           prompt_tokens: {kind: constant, value: 100},
           output_tokens: {kind: constant, value: 3}}
network: {distance_km: 0, base_rtt_ms: 0.2, tls: none, gateway_ms: 0}
engine:
  policy: chunked
  max_num_seqs: 16
  max_num_batched_tokens: 2048
  kv: {block_size: 16, prefix_caching: true, max_model_len: 4096}
model:
  name: llama-2-7b
  cost: {kind: roofline, gpu: h100-sxm, tp: 1}
"""


def latsim(*args):
    from typer.testing import CliRunner

    from simulator.cli.main import app
    r = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    return r.exit_code, r.output


def inline(stages, groups=2, per_group=2, sys_len=64, q_len=32, out_len=8, **kw):
    return InferencePerfWorkload(
        data={"shared_prefix": {"num_groups": groups, "num_prompts_per_group": per_group,
                                "system_prompt_len": sys_len, "question_len": q_len,
                                "output_len": out_len}},
        load={"type": "constant", "stages": [{"rate": r, "duration": d} for r, d in stages]},
        **kw)


# -- the workload ---------------------------------------------------------------------------

def test_constant_stages_send_int_rate_x_duration_ending_at_the_stage_end():
    """ConstantLoadTimer: int(rate x duration) requests whose gaps sum to the duration
    (the last at the stage's end); the next stage's clock starts load.interval + 1 s
    later (stage_gap_s default)."""
    w = build_inference_perf(inline([(2.5, 7), (4.0, 5)]), np.random.default_rng(3), REPO)
    stage = w.meta["stage"]
    assert np.bincount(stage).tolist() == [17, 20]          # int(17.5), int(20.0)
    a0, a1 = w.arrival_s[stage == 0], w.arrival_s[stage == 1]
    assert a0[-1] == pytest.approx(7.0, abs=1e-9)
    assert a1[-1] == pytest.approx(7.0 + 2.0 + 5.0, abs=1e-9)  # interval 1 + start offset 1
    assert a1[0] > 9.0 and a0[0] > 0.0
    # Exponential gaps, not even ones: their spread is of the mean's order.
    g = np.diff(build_inference_perf(inline([(10.0, 100)]), np.random.default_rng(0),
                                     REPO).arrival_s)
    assert 0.8 < g.std() / g.mean() < 1.2


def test_prompts_rotate_every_groups_x_prompts_and_restart_each_stage():
    """Request j of every stage sends shuffled prompt j mod (groups x prompts): whole
    prompts repeat with that period; a group's prompts share the system prompt's id."""
    w = build_inference_perf(inline([(2.0, 10), (2.0, 5)]), np.random.default_rng(1), REPO)
    p, stage = w.meta["prompt_index"], w.meta["stage"]
    assert sorted(p[:4].tolist()) == [0, 1, 2, 3]
    assert (p[4:20] == np.tile(p[:4], 4)).all()
    assert (p[stage == 1] == p[:10]).all()                  # request numbers restart
    ids = {int(pi): tuple(h) for pi, h in zip(p, w.hash_ids)}
    # hash block = the 64-token system prompt: unit 0 by group, units 1.. by prompt.
    assert w.meta["hash_block_tokens"] == 64 and len(ids[0]) == 2   # ceil(96 / 64)
    assert ids[0][0] == ids[1][0] != ids[2][0] == ids[3][0]
    assert len({h[1] for h in ids.values()}) == 4
    assert (w.prompt_tokens == 96).all() and (w.output_tokens == 8).all()


def test_same_seed_same_requests():
    a = build_inference_perf(inline([(3.0, 10)]), np.random.default_rng(7), REPO)
    b = build_inference_perf(inline([(3.0, 10)]), np.random.default_rng(7), REPO)
    assert (a.arrival_s == b.arrival_s).all()
    assert (a.meta["prompt_index"] == b.meta["prompt_index"]).all()


def test_profile_alias_keys_are_dropped_as_the_pinned_inference_perf_does():
    """The recorded profile asks num_unique_system_prompts 11 / num_users_per_system_prompt
    4; the version that ran it ignored those keys: its resolved config.yaml says 10 / 10.
    Reading the profile gives what the recording's config.yaml says."""
    d, ld, ignored = read_config(CODEGEN / "profile.yaml")
    d2, ld2, _ = read_config(CODEGEN / "results" / "config.yaml")
    assert d == d2 and ld == ld2
    assert (d.shared_prefix.num_groups, d.shared_prefix.num_prompts_per_group) == (10, 10)
    assert "data.shared_prefix.num_unique_system_prompts" in ignored
    d3, _, _ = read_config(CODEGEN / "profile.yaml", aliases=False)
    assert d3.shared_prefix.num_groups == 10
    with pytest.raises(LatsimError, match="enable_multi_turn_chat"):
        read_config(CODEGEN / "profile.yaml", aliases=True)


def test_config_that_is_not_shared_prefix_is_refused_naming_the_field(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("data: {type: random}\nload: {stages: [{rate: 1, duration: 1}]}\n")
    with pytest.raises(LatsimError, match=r"field 'data.type'.*shared_prefix.*'random'"):
        read_config(p)
    p.write_text("data: {type: shared_prefix}\nload: {stages: [{rate: -1, duration: 1}]}\n")
    with pytest.raises(LatsimError, match=r"field 'load.stages.0.rate'"):
        read_config(p)
    p.write_text("data: {type: shared_prefix, shared_prefix: {num_groups: 2000, "
                 "num_prompts_per_group: 1000}}\nload: {stages: [{rate: 1, duration: 1}]}\n")
    with pytest.raises(LatsimError, match=r"field 'data.shared_prefix'.*1,000,000"):
        read_config(p)


def test_prefix_cache_sees_system_prompts_and_repeated_prompts():
    """With requests far apart, a prompt's first request finds its group's system prompt
    cached (64 tokens = 4 blocks of 16) once the group was seen, a repeat finds the whole
    prompt but the block holding its last token ((96 - 1) // 16 = 5 blocks = 80 tokens),
    and a new group finds nothing."""
    from simulator.config.scenario import validate_scenario
    from simulator.loops.simulate import simulate
    from simulator.report.metrics import requests_table
    import yaml
    data = yaml.safe_load(SCENARIO)
    data["workload"] = inline([(0.5, 40)]).model_dump()
    data["seed"] = 1        # a draw whose closest arrivals are 0.17 s apart
    sc = validate_scenario(data)
    res = simulate(sc, base_dir=REPO)
    df = requests_table(res)
    w = res.workload
    # The precondition: each request is done long before the next arrives.
    assert np.diff(w.arrival_s).min() > 2 * df["e2el"].max()
    want, seen_p, seen_g = [], set(), set()
    for p in w.meta["prompt_index"].tolist():
        g = p // 2
        want.append(80 if p in seen_p else 64 if g in seen_g else 0)
        seen_p.add(p)
        seen_g.add(g)
    assert df["cached_tokens"].tolist() == want


# -- runs of aggregates ---------------------------------------------------------------------

def test_inference_perf_folder_read_in_ms_per_stage():
    rec = read_summary_run(MINI)
    assert rec.kind == "inference_perf" and rec.clock == "inference_perf"
    assert len(rec.stages) == 2 and rec.config == MINI / "results" / "config.yaml"
    s0 = rec.stages[0]
    assert s0["mean_ttft_ms"] == pytest.approx(30.0) and s0["p99_e2el_ms"] == pytest.approx(104.0)
    assert s0["requested_rate"] == 2.0 and s0["failures"] == 0
    assert rec.overall["count"] == 30 and not saturated(s0)
    wl = run_workload(rec)
    assert wl["kind"] == "inference_perf" and wl["tokenizer_inflation"] == 1.0   # 96 / 96


def test_inference_perf_per_request_records_recompute_the_overall(tmp_path):
    """per_request_lifecycle_metrics.json (inference-perf's records: start_time,
    end_time, info.output_token_times, error): request A sent at 0 s, lines at 0.1, 0.2,
    0.3, done 0.3; B at 1, lines 1.2, 1.4, 1.6, done 1.7; C failed. TTFT 100/200 ms, E2E
    300/700, TPOT (last - first) / (lines - 1) = 100/200, mean ITL 0.6 s / 4 gaps."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(MINI, run)
    rows = [{"start_time": 0.0, "end_time": 0.3, "request": "{}", "response": "",
             "info": {"input_tokens": 96, "output_tokens": 2,
                      "output_token_times": [0.1, 0.2, 0.3]}, "error": None},
            {"start_time": 1.0, "end_time": 1.7, "request": "{}", "response": "",
             "info": {"input_tokens": 96, "output_tokens": 2,
                      "output_token_times": [1.2, 1.4, 1.6]}, "error": None},
            {"start_time": 2.0, "end_time": 9.0, "request": "{}", "response": None,
             "info": None, "error": {"error_type": "timeout", "error_msg": ""}}]
    (run / "results" / "per_request_lifecycle_metrics.json").write_text(json.dumps(rows))
    o = read_summary_run(run).overall
    assert (o["count"], o["failures"]) == (2, 1) and saturated(o)
    assert o["mean_ttft_ms"] == pytest.approx(150.0) and o["mean_e2el_ms"] == pytest.approx(500.0)
    assert o["mean_tpot_ms"] == pytest.approx(150.0) and o["p90_tpot_ms"] == pytest.approx(190.0)
    assert o["mean_itl_ms"] == pytest.approx(150.0)
    rows[1]["end_time"] = "late"
    (run / "results" / "per_request_lifecycle_metrics.json").write_text(json.dumps(rows))
    with pytest.raises(LatsimError, match=r"field '\[1\].end_time'.*'late'"):
        read_summary_run(run)
    rows[1]["end_time"] = 1.7
    rows[0]["info"]["output_token_times"] = 5        # a number where the list goes
    (run / "results" / "per_request_lifecycle_metrics.json").write_text(json.dumps(rows))
    with pytest.raises(LatsimError, match=r"field '\[0\].info.output_token_times'.*5"):
        read_summary_run(run)


def test_vllm_bench_json_aggregates_recomputed_from_per_request_lists():
    """ttfts 0.1/0.2/0.3 s, itls [10,10] [20,20] [30] ms: E2E 120/240/330 ms, TPOT per
    request 10/20/30 ms, ITL pooled 10,10,20,20,30 (mean 18, median 20)."""
    rec = read_summary_run(VLLM_JSON)
    o = rec.overall
    assert rec.kind == "vllm_bench" and rec.config is None and run_workload(rec) is None
    assert o["mean_ttft_ms"] == pytest.approx(200.0)
    assert o["mean_e2el_ms"] == pytest.approx(230.0)
    assert o["median_e2el_ms"] == pytest.approx(240.0)
    assert o["mean_tpot_ms"] == pytest.approx(20.0)
    assert o["mean_itl_ms"] == pytest.approx(18.0) and o["median_itl_ms"] == pytest.approx(20.0)
    assert o["p90_ttft_ms"] == pytest.approx(280.0)          # linear, as np.percentile
    assert o["requested_rate"] == 1.0 and o["count"] == 3


def test_vllm_bench_json_without_lists_takes_its_stored_aggregates(tmp_path):
    d = json.loads(VLLM_JSON.read_text())
    for k in ("ttfts", "itls", "input_lens", "output_lens", "generated_texts", "errors"):
        d.pop(k)
    p = tmp_path / "r.json"
    p.write_text(json.dumps(d))
    o = read_summary_run(p).overall
    assert o["p99_ttft_ms"] == 298.0 and o["mean_e2el_ms"] == 230.0 and "p90_ttft_ms" not in o


def test_sim_aggregates_on_inference_perfs_clock():
    """inference-perf stamps 2N + 2 SSE lines: TPOT = (last - first) / (2N + 1); vllm
    bench: (last - first) / (N - 1). One request sent at 0, first token 0.1 s, last 0.4 s,
    N = 4."""
    df = pd.DataFrame({"arrival": [0.0], "first_delivered": [0.1], "last_delivered": [0.4],
                       "output_tokens": [4], "finished": [True]})
    ip = sim_aggregates(df, "inference_perf")
    vb = sim_aggregates(df, "vllm_bench")
    assert ip["mean_tpot_ms"] == pytest.approx(300.0 / 9) == ip["mean_itl_ms"]
    assert vb["mean_tpot_ms"] == pytest.approx(100.0)
    assert ip["mean_ttft_ms"] == pytest.approx(100.0) and ip["mean_e2el_ms"] == pytest.approx(400.0)
    # ITL percentiles are not compared on inference-perf's clock (blank-line gaps).
    keys = compare_aggregates({"mean_itl_ms": 1.0, "p99_itl_ms": 2.0}, ip, "inference_perf")
    assert list(keys) == ["mean_itl_ms"]


def test_saturation_verdicts():
    assert saturated({"failures": 3, "mean_ttft_ms": 10, "mean_tpot_ms": 5})
    assert saturated({"mean_ttft_ms": 501, "mean_tpot_ms": 5})      # over 100 TPOTs
    assert not saturated({"mean_ttft_ms": 499, "mean_tpot_ms": 5, "failures": 0})
    assert saturated({"requested_rate": 10, "achieved_rate": 9})
    # The recorded reasoning runs time out requests and queue for minutes.
    rec = read_summary_run(RUNS / "20260217-170634-llama-2-7b-tp1-reasoning")
    assert saturated(rec.stages[0]) and not saturated(read_summary_run(CODEGEN).stages[0])


def test_malformed_runs_are_one_line_errors(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(LatsimError, match="invalid JSON"):
        read_summary_run(p)
    p.write_text('{"a": 1}')
    with pytest.raises(LatsimError, match="not a `vllm bench serve"):
        read_summary_run(p)
    d = json.loads(VLLM_JSON.read_text())
    d.pop("ttfts")
    d["mean_ttft_ms"] = "fast"
    p.write_text(json.dumps(d))
    with pytest.raises(LatsimError, match=r"field 'mean_ttft_ms'.*'fast'"):
        read_summary_run(p)
    # The per-request lists' errors must be one per request (a short list was an
    # IndexError traceback, a number a TypeError).
    for errs in (["boom"], 3):
        d = json.loads(VLLM_JSON.read_text())
        d["errors"] = errs
        p.write_text(json.dumps(d))
        with pytest.raises(LatsimError, match=r"field 'errors': must be a list of one error"):
            read_summary_run(p)


# -- the CLI --------------------------------------------------------------------------------

@pytest.fixture
def scenario(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO)
    return p


def test_validate_run_on_an_inference_perf_folder(scenario, tmp_path):
    code, out = latsim("validate", "--run", MINI, scenario, "--out", tmp_path / "o")
    assert code == 0, out
    assert "inference-perf run of aggregates, 30 requests; workload from" in out
    assert "stage 1: healthy" in out and "mean TTFT" in out and "p99 E2EL" in out
    res = json.loads((tmp_path / "o" / "validation-inference_perf_mini.json").read_text())
    assert len(res["stages"]) == 2
    # The workload came from the folder's config: 10 + 20 requests, as its two stages.
    assert res["stages"][0]["sim"]["count"] == 10 and res["stages"][1]["sim"]["count"] == 20


def test_validate_run_on_a_vllm_bench_json(scenario):
    code, out = latsim("validate", "--run", VLLM_JSON, scenario)
    assert code == 0, out
    assert "vllm bench serve run of aggregates" in out and "workload from the scenario" in out
    assert "p90 ITL" in out


def test_validate_says_so_when_the_recording_saturated_and_latsim_does_not(scenario, tmp_path):
    run = tmp_path / "sat"
    (run / "results").mkdir(parents=True)
    for f in (MINI / "results").iterdir():
        d = f.read_text()
        if f.suffix == ".json":
            j = json.loads(d)
            j["failures"]["count"] = 4
            d = json.dumps(j)
        (run / "results" / f.name).write_text(d)
    code, out = latsim("validate", "--run", run, scenario)
    assert code == 1, out
    assert "saturated in the recording; latsim predicts a healthy server" in out


def test_calibrate_refuses_a_run_of_aggregates(scenario):
    for run in (MINI, VLLM_JSON):
        code, out = latsim("calibrate", scenario, "--run", run)
        assert code == 2
        lines = [ln for ln in out.splitlines() if ln.startswith("latsim: error:")]
        assert len(lines) == 1 and "no step cost can be fitted" in lines[0], out


# -- the benchmark --------------------------------------------------------------------------

def test_benchmark_scenario_takes_the_runs_launch_arguments():
    import sys
    sys.path.insert(0, str(REPO))
    from benchmarks.vllm_runs import scenario_for
    from simulator.config.scenario import validate_scenario
    run = RUNS / "20260217-202857-llama-2-70b-tp4-general"
    data, model = scenario_for(run, read_summary_run(run))
    assert model == "llama-2-70b"
    assert data["model"]["cost"] == {"kind": "roofline", "gpu": "h100-sxm", "tp": 4}
    eng = data["engine"]
    assert (eng["max_num_seqs"], eng["max_num_batched_tokens"]) == (128, 2048)
    assert eng["kv"]["max_model_len"] == 4096
    # Prompt lengths scaled by the recorded mean prompt_len over 100 + 447 drawn tokens.
    rec = read_summary_run(run)
    assert data["workload"]["tokenizer_inflation"] == pytest.approx(
        rec.overall["prompt_len_mean"] / 547, abs=1e-4)
    sc = validate_scenario(data, base_dir=run)
    assert sc.engine.kv.prefix_caching
    # vLLM v1's FULL_AND_PIECEWISE graphs: the preset turns them on for the roofline.
    assert sc.model.cost.piecewise_graphs
