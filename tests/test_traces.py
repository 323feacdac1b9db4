"""Trace replay: readers, replay options, bad input, the CLI, and the real traces' figures.

Tests on the real files read them from the repository's ``data/`` folder and check
the figures tabulated in the READMEs there; a missing file fails the test, never skips it.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simulator.errors import LatsimError
from simulator.config.registry import WORKLOADS
from simulator.config import plugins  # noqa: F401  (registers kind: trace)
from simulator.workload.traces import TraceWorkload, build_trace, summarize_workload

HERE = Path(__file__).resolve().parent
FIX = HERE / "data"
DATA = HERE.parent / "data"  # the public data shipped with the repository


def build(path, rng_seed=0, **kw):
    cfg = TraceWorkload(path=str(path), **kw)
    return build_trace(cfg, np.random.default_rng(rng_seed), FIX)


def one_line(err: LatsimError) -> str:
    msg = str(err)
    assert "\n" not in msg
    return msg


# --------------------------------------------------------------------------- fixtures

def test_azure_and_vidur_slices_agree():
    az = build("azure_conv_head40.csv")
    vi = build("vidur_splitwise_conv_head40.csv")
    assert len(az) == len(vi) == 40
    assert az.meta["format"] == "azure" and vi.meta["format"] == "vidur"  # auto-detected
    assert az.arrival_s[0] == 0.0
    np.testing.assert_allclose(az.arrival_s, vi.arrival_s, atol=1e-6)
    np.testing.assert_array_equal(az.prompt_tokens, vi.prompt_tokens)
    np.testing.assert_array_equal(az.output_tokens, vi.output_tokens)
    assert az.prompt_tokens[:2].tolist() == [374, 396] and az.output_tokens[:2].tolist() == [44, 109]
    assert az.hash_ids is None and set(az.priority) == {0}


@pytest.mark.parametrize("frac", ["", ".5", ".000", ".0000000"])
def test_azure_timestamps_in_seconds_whatever_their_decimals(tmp_path, frac):
    """Rows 3 s apart span 42 s whether their timestamps carry 0, 1, 3 or 7 decimals
    (pandas parses them at a unit it picks from the digits; read as nanoseconds, a
    millisecond-stamped trace ran 1000 times too fast)."""
    rows = [f"2023-11-16 18:00:{10 + 3 * i:02d}{frac},500,50" for i in range(15)]
    p = tmp_path / "az.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    w = build(p, format="azure")
    np.testing.assert_allclose(w.arrival_s, 3.0 * np.arange(15), rtol=0, atol=1e-9)


def test_mooncake_slice_carries_hash_ids():
    wl = build("mooncake_conv_head30.jsonl")
    lines = [json.loads(x) for x in (FIX / "mooncake_conv_head30.jsonl").read_text().splitlines()]
    assert len(wl) == 30 and wl.meta["format"] == "mooncake"
    np.testing.assert_allclose(wl.arrival_s, [(r["timestamp"] - lines[0]["timestamp"]) / 1000 for r in lines])
    for h, r, p in zip(wl.hash_ids, lines, wl.prompt_tokens):
        assert isinstance(h, np.ndarray) and h.dtype == np.int64
        assert h.tolist() == r["hash_ids"] and len(h) == math.ceil(p / 512)


def test_canonical_csv_priorities_and_hashes():
    classes = [{"name": "interactive"}, {"name": "batch"}]
    wl = build("canonical_small.csv", classes=classes)
    assert wl.arrival_s.tolist() == [0.0, 0.5, 0.5, 2.25, 3.0]  # re-zeroed at the first request
    assert wl.priority.tolist() == [0, 1, 1, 0, 0]
    assert wl.class_names == ("interactive", "batch")
    assert [h.tolist() for h in wl.hash_ids] == [[0, 1], [0], [], [0, 1, 2], [7, 8, 9]]


def test_canonical_class_names_need_a_classes_list(tmp_path):
    with pytest.raises(LatsimError) as e:
        build("canonical_small.csv")
    assert re.search(r"canonical_small\.csv:2: column 'priority': unknown class 'interactive'",
                     one_line(e.value))
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens,priority\n0,5,5,P2\n1,5,5,prio0\n")
    wl = build(p)
    assert wl.priority.tolist() == [2, 0] and wl.class_names == ("P0", "P1", "P2")


def test_classes_drawn_by_share_deterministically():
    classes = [{"name": "P0", "share": 0.2}, {"name": "P1", "share": 0.8}]
    a = build("azure_conv_head40.csv", rng_seed=3, classes=classes)
    b = build("azure_conv_head40.csv", rng_seed=3, classes=classes)
    assert a.priority.tolist() == b.priority.tolist()
    assert set(a.priority) <= {0, 1} and a.class_names == ("P0", "P1")


def test_speedup_window_limit_rate():
    base = build("vidur_splitwise_conv_head40.csv")
    fast = build("vidur_splitwise_conv_head40.csv", speedup=4.0)
    np.testing.assert_allclose(fast.arrival_s, base.arrival_s / 4)
    assert build("vidur_splitwise_conv_head40.csv", rate_scale=4.0).arrival_s.tolist() == fast.arrival_s.tolist()
    raw = pd.read_csv(FIX / "vidur_splitwise_conv_head40.csv")
    win = build("vidur_splitwise_conv_head40.csv", window=[20, 60])
    sel = raw[(raw.arrived_at >= 20) & (raw.arrived_at < 60)]
    assert len(win) == len(sel) and win.arrival_s[0] == 0
    np.testing.assert_allclose(win.arrival_s, sel.arrived_at - sel.arrived_at.iloc[0])
    assert win.prompt_tokens.tolist() == sel.num_prefill_tokens.tolist()
    lim = build("vidur_splitwise_conv_head40.csv", limit=7)
    assert lim.prompt_tokens.tolist() == raw.num_prefill_tokens[:7].tolist()
    r = build("vidur_splitwise_conv_head40.csv", rate=10.0)
    assert summarize_workload(r)["mean_rate"] == pytest.approx(10.0, rel=1e-9)
    assert summarize_workload(r)["iat_cv"] == pytest.approx(summarize_workload(base)["iat_cv"])


def test_token_limits_clip_or_drop():
    wl = build("mooncake_conv_head30.jsonl", max_prompt_tokens=2000, max_output_tokens=100)
    assert len(wl) == 30 and wl.prompt_tokens.max() <= 2000 and wl.output_tokens.max() <= 100
    assert all(len(h) == math.ceil(p / 512) for h, p in zip(wl.hash_ids, wl.prompt_tokens))
    full = build("mooncake_conv_head30.jsonl")
    assert all(h.tolist() == f[:len(h)].tolist() for h, f in zip(wl.hash_ids, full.hash_ids))
    dropped = build("mooncake_conv_head30.jsonl", max_prompt_tokens=8000, over_limit="drop")
    assert len(dropped) == int((full.prompt_tokens <= 8000).sum()) > 0


def test_spread_ties_keeps_order_inside_each_bucket():
    full = build("mooncake_conv_head30.jsonl")
    wl = build("mooncake_conv_head30.jsonl", spread_ties_s=3.0, rng_seed=1)
    assert np.all(np.diff(wl.arrival_s) >= 0)
    assert np.all((wl.arrival_s >= full.arrival_s) & (wl.arrival_s < full.arrival_s + 3.0))
    assert wl.prompt_tokens.tolist() == full.prompt_tokens.tolist()


def test_registry_and_relative_paths(tmp_path):
    cfg = WORKLOADS.validate({"kind": "trace", "path": "data/azure_conv_head40.csv", "speedup": 2})
    wl = WORKLOADS.build(cfg, np.random.default_rng(0), HERE)
    assert len(wl) == 40
    for bad in ({"speedup": 2, "rate": 3}, {"window": [5, 5]}, {"speedup": 0}, {"format": "x"}):
        with pytest.raises(Exception):
            WORKLOADS.validate({"kind": "trace", "path": "x.csv", **bad})


def test_scenario_files_validate_and_resolve():
    config = pytest.importorskip("simulator.config.scenario", reason="the scenario schema is not importable yet")
    for name in ("azure-conv", "azure-code", "mooncake-conv"):
        path = HERE.parent / "scenarios" / f"{name}.yaml"
        sc, base = config.load_scenario(path)
        assert sc.workload.kind == "trace" and set(sc.policies) == {"fifo", "chunked", "priority_aging"}
        assert (base / sc.workload.path).resolve().is_relative_to(DATA)
        wl = WORKLOADS.build(sc.workload, np.random.default_rng(0), base)
        assert 100 < len(wl) < 20000


# --------------------------------------------------------------------------- bad input

def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("name,text,kw,pattern", [
    ("a.csv", "TIMESTAMP,ContextTokens,GenTokens\n2023-11-16 18:00:00.0,5,5\n", {"format": "azure"},
     r"a\.csv:1: column 'GeneratedTokens': missing from the header.*did you mean 'GenTokens'"),
    ("c.csv", "arrival_s,prompt_tokens,output_tokens,arrival_s\n0,5,5,9\n", {},
     r"c\.csv:1: column 'arrival_s': named 2 times in the header"),
    ("v.csv", "arrived,num_prefill_tokens,num_decode_tokens\n0,5,5\n", {},
     r"v\.csv:1: column 'arrived_at': missing from the header.*did you mean 'arrived'"),
    ("v.csv", "time,prompt,output\n0,5,5\n", {},
     r"v\.csv:1: cannot tell the trace format from the header \(columns: time, prompt, output\)"),
    ("c.csv", "prompt_tokens,output_tokens\n5,5\n", {},
     r"c\.csv:1: column 'arrival_s': missing from the header"),
    ("v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,5\n2,5,5\n1,5,5\n", {},
     r"v\.csv:4: column 'arrived_at': timestamps go backwards .*sort: true"),
    ("v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,5\n-1,5,5\n", {},
     r"v\.csv:3: column 'arrived_at': must be >= 0"),
    ("c.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,5\n1,5,many\n", {},
     r"c\.csv:3: column 'output_tokens': not a number \('many'\)"),
    ("c.csv", "arrival_s,prompt_tokens,output_tokens\n0,5.5,5\n", {},
     r"c\.csv:2: column 'prompt_tokens': not a whole number"),
    ("c.csv", "arrival_s,prompt_tokens,output_tokens\n0,0,5\n", {},
     r"c\.csv:2: column 'prompt_tokens': must be >= 1"),
    ("c.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,5\n\n2,5,5\n", {},
     r"c\.csv:3: column 'arrival_s': empty"),
    ("c.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,\n", {},
     r"c\.csv:2: column 'output_tokens': empty"),
    ("c.csv", "arrival_s,prompt_tokens,output_tokens,priority\n0,5,5,\n", {},
     r"c\.csv:2: column 'priority': empty"),
    ("c.csv", "arrival_s,prompt_tokens,output_tokens,prefix_hashes\n0,600,5,1 x\n", {},
     r"c\.csv:2: column 'prefix_hashes': expected space-separated integers"),
    ("c.csv", "arrival_s,prompt_tokens,output_tokens,prefix_hashes\n0,600,5,1 2\n1,600,5,1\n", {},
     r"c\.csv:3: column 'prefix_hashes': 1 hash blocks but a 600-token prompt needs ceil\(600/512\) = 2"),
    ("z.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n", {},
     r"z\.csv:2: column 'TIMESTAMP': not a date-time"),
    ("e.csv", "", {}, r"e\.csv: file is empty"),
    ("h.csv", "arrival_s,prompt_tokens,output_tokens\n", {}, r"h\.csv: no requests \(the file has only a header\)"),
    ("m.jsonl", "", {}, r"m\.jsonl: file is empty"),
    ("m.jsonl", "\n\n", {}, r"m\.jsonl: file is empty \(no JSON lines\)"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1,\n', {},
     r"m\.jsonl:2: invalid JSON"),
    ("m.jsonl", '{"timestamp": 0, "input_len": 5, "output_length": 1}\n', {},
     r"m\.jsonl:1: column 'input_length': missing key.*did you mean 'input_len'"),
    ("m.jsonl", '{"timestamp": 0, "input_length": "five", "output_length": 1}\n', {},
     r"m\.jsonl:1: column 'input_length': not a number"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
                '{"timestamp": 3, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2]}\n', {},
     r"m\.jsonl:2: column 'hash_ids': 2 hash blocks but a 1100-token prompt needs ceil\(1100/512\) = 3"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}\n', {},
     r"m\.jsonl:1: column 'hash_ids': expected a list of integers"),
    ("m.jsonl", '{"timestamp": 5, "input_length": 5, "output_length": 1}\n'
                '{"timestamp": 4, "input_length": 5, "output_length": 1}\n', {},
     r"m\.jsonl:2: column 'timestamp': timestamps go backwards"),
    ("w.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,5\n", {"window": [10, 20]},
     r"w\.csv: field 'window': window \[10, 20\) selects no requests"),
])
def test_bad_input_is_one_line_with_file_line_column(tmp_path, name, text, kw, pattern):
    p = _write(tmp_path, name, text)
    with pytest.raises(LatsimError) as e:
        build(p, **kw)
    msg = one_line(e.value)
    assert str(p.parent) in msg
    assert re.search(pattern, msg), msg


def test_missing_path_and_folder(tmp_path):
    with pytest.raises(LatsimError, match=r"nope\.csv: file not found"):
        build(tmp_path / "nope.csv")
    with pytest.raises(LatsimError, match="nope.csv: file not found"):
        build(tmp_path / "nope.csv", format="azure")
    with pytest.raises(LatsimError, match="is a folder"):
        build(tmp_path, format="csv")


def test_unsorted_sorts_with_a_warning_when_asked(tmp_path):
    p = _write(tmp_path, "u.csv", "arrival_s,prompt_tokens,output_tokens\n0,1,1\n2,2,2\n1,3,3\n2,4,4\n")
    with pytest.warns(UserWarning, match=r"u\.csv: 1 rows out of time order \(first on line 4\)"):
        wl = build(p, sort=True)
    assert wl.arrival_s.tolist() == [0, 1, 2, 2] and wl.prompt_tokens.tolist() == [1, 3, 2, 4]


def test_lengths_only_file_gets_a_hint(tmp_path):
    p = _write(tmp_path, "l.csv", "num_prefill_tokens,num_decode_tokens\n5,5\n")
    with pytest.raises(LatsimError, match="lengths-only file"):
        build(p)


# --------------------------------------------------------------------------- CLI

def test_cli_summarize_and_convert_round_trip(tmp_path):
    from typer.testing import CliRunner
    from simulator.cli.trace import trace_app
    runner = CliRunner()
    res = runner.invoke(trace_app, ["summarize", str(FIX / "mooncake_conv_head30.jsonl")])
    assert res.exit_code == 0, res.output
    assert "requests" in res.output and "30" in res.output and "dispersion" in res.output
    out = tmp_path / "o.csv"
    res = runner.invoke(trace_app, ["convert", str(FIX / "mooncake_conv_head30.jsonl"), "--out", str(out),
                                    "--speedup", "2"])
    assert res.exit_code == 0, res.output
    assert pd.read_csv(out).columns.tolist() == ["arrival_s", "prompt_tokens", "output_tokens",
                                                 "priority", "prefix_hashes"]
    back = build(out)
    orig = build("mooncake_conv_head30.jsonl", speedup=2)
    assert back.meta["format"] == "csv"
    assert back.arrival_s.tolist() == orig.arrival_s.tolist()  # full precision
    assert back.prompt_tokens.tolist() == orig.prompt_tokens.tolist()
    assert [h.tolist() for h in back.hash_ids] == [h.tolist() for h in orig.hash_ids]
    res = runner.invoke(trace_app, ["convert", str(FIX / "azure_conv_head40.csv"),
                                    "--out", str(tmp_path / "o2.csv"), "--window", "5,x"])
    assert isinstance(res.exception, LatsimError) and "--window" in str(res.exception)
    res = runner.invoke(trace_app, ["summarize", str(tmp_path / "none.csv")])
    assert isinstance(res.exception, LatsimError) and "file not found" in str(res.exception)


# --------------------------------------------------------------------------- real traces

# data/azure_llm_2023/README.md and data/mooncake/README.md: rows, span, mean rate, IAT CV,
# disp@1s, disp@60s, peak/mean@60s,
# input mean/p50/p90/p99/max, output mean/p50/p90/p99/max, (blocks, reuse)
README = {
    "azure_llm_2023/AzureLLMInferenceTrace_code.csv": dict(
        requests=8819, span_s=3436, mean_rate=2.57, iat_cv=13.15, disp_1s=13.2, disp_60s=160.5,
        peak_mean_60s=4.16, prompt_mean=2048, prompt_p50=1469, prompt_p90=5188, prompt_p99=7436,
        prompt_max=7437, output_mean=27.9, output_p50=13, output_p90=55, output_p99=251, output_max=1899),
    "azure_llm_2023/AzureLLMInferenceTrace_conv.csv": dict(
        requests=19366, span_s=3502, mean_rate=5.53, iat_cv=1.09, disp_1s=1.39, disp_60s=20.6,
        peak_mean_60s=1.54, prompt_mean=1155, prompt_p50=1020, prompt_p90=2735, prompt_p99=4142,
        prompt_max=14050, output_mean=211, output_p50=129, output_p90=424, output_p99=601, output_max=1000),
    "mooncake/conversation_trace.jsonl": dict(
        requests=12031, span_s=3537, mean_rate=3.40, iat_cv=3.03, disp_1s=7.89, disp_60s=2.85,
        peak_mean_60s=1.21, prompt_mean=12035, prompt_p50=6909, prompt_p90=27367, prompt_p99=85400,
        prompt_max=126195, output_mean=343, output_p50=350, output_p90=597, output_p99=1119,
        output_max=2000, blocks=288500, block_reuse=0.366),
    "mooncake/synthetic_trace.jsonl": dict(
        requests=3993, span_s=1022, mean_rate=3.91, iat_cv=1.01, disp_1s=1.09, disp_60s=12.98,
        peak_mean_60s=1.23, prompt_mean=15325, prompt_p50=11587, prompt_p99=66456, prompt_max=191378,
        output_mean=149, output_p50=69, output_p99=768, output_max=893, blocks=121877, block_reuse=0.640),
}
# Vidur's re-encoding of the Azure files (vidur/processed_traces/splitwise_*.csv) is not
# shipped; its reader is checked on the first 40 rows (test_azure_and_vidur_slices_agree).


@pytest.mark.parametrize("rel", list(README))
def test_real_trace_matches_readme(rel):
    # How long reading takes is measured by benchmarks/trace_read.py, not asserted here.
    wl = build_trace(TraceWorkload(path=rel), np.random.default_rng(0), DATA)
    s = summarize_workload(wl)
    for key, want in README[rel].items():
        # The README prints 3-4 significant figures: half a unit of its last digit, at most 0.5%.
        assert s[key] == pytest.approx(want, rel=5e-3), f"{rel}: {key} = {s[key]}, README {want}"


def _file_columns(path: Path):
    if path.suffix == ".jsonl":
        recs = [json.loads(x) for x in path.read_text().splitlines()]
        return (np.array([r["timestamp"] for r in recs]) / 1000, [r["input_length"] for r in recs],
                [r["output_length"] for r in recs])
    df = pd.read_csv(path)
    t = pd.to_datetime(df.iloc[:, 0]).astype("int64").to_numpy() / 1e9 if df.columns[0] == "TIMESTAMP" \
        else df.iloc[:, 0].to_numpy()
    return t, df.iloc[:, 1].tolist(), df.iloc[:, 2].tolist()


@pytest.mark.parametrize("rel", ["azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
                                 "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
                                 "mooncake/conversation_trace.jsonl"])
def test_replay_keeps_every_request_in_order(rel):
    t, p, o = _file_columns(DATA / rel)
    wl = build_trace(TraceWorkload(path=rel), np.random.default_rng(0), DATA)
    assert wl.prompt_tokens.tolist() == p and wl.output_tokens.tolist() == o
    np.testing.assert_allclose(wl.arrival_s, t - t[0], atol=1e-6)


@pytest.mark.parametrize("rel", ["azure_llm_2023/AzureLLMInferenceTrace_code.csv",
                                 "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"])
def test_real_speedup_and_rate_hit_their_targets(rel):
    rng = np.random.default_rng(0)
    base = summarize_workload(build_trace(TraceWorkload(path=rel), rng, DATA))
    fast = summarize_workload(build_trace(TraceWorkload(path=rel, speedup=2.5), rng, DATA))
    assert fast["mean_rate"] == pytest.approx(2.5 * base["mean_rate"], rel=0.01)
    assert fast["span_s"] == pytest.approx(base["span_s"] / 2.5, rel=0.01)
    assert fast["iat_cv"] == pytest.approx(base["iat_cv"], rel=1e-9)  # burst structure kept
    win = summarize_workload(build_trace(TraceWorkload(path=rel, window=[600, 1800], rate=12.0), rng, DATA))
    assert win["mean_rate"] == pytest.approx(12.0, rel=0.01)
    assert win["span_s"] < 1200
