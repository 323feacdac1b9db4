"""A recorded run folder with bad input (``latsim calibrate --run``, ``latsim validate
--run``; ``simulator.cost.calibration.read_recorded_run``): one line naming the file,
the field and the value, exit 2, before any work; a valid copy of the published run
still reads.

Each case copies the published ``load50-fifo`` run into ``tmp_path`` and breaks one
thing in one of its files: ``requests.csv``, ``trace.csv``, ``tokens.csv`` and the step
log ``iterations.csv``. Most are read directly (fast); a few go through the CLI.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pandas as pd
import pytest

from conftest import REPO
from simulator.cost.calibration import read_recorded_run
from simulator.errors import LatsimError

RUN = REPO / "data" / "h200-refbench" / "runs" / "load50-fifo"
SCEN = REPO / "scenarios" / "refbench-load50-fifo.yaml"


def latsim(*args):
    """Run the CLI in-process; ``(exit code, stdout and stderr)``."""
    from typer.testing import CliRunner

    from simulator.cli.main import app
    r = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    return r.exit_code, r.output


def copy_run(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    for f in RUN.glob("*.csv"):
        shutil.copy(f, folder / f.name)
    return folder


def frame(fn):
    """An edit of one file as a DataFrame: ``fn(df)`` changes it in place or returns
    the new one."""
    def edit(path):
        df = pd.read_csv(path)
        new = fn(df)
        (df if new is None else new).to_csv(path, index=False)
    return edit


def set_cell(col, row, value):
    """Cell ``(row, col)`` (row 0: the first data row) set to ``value`` (text too)."""
    def fn(df):
        df[col] = df[col].astype(object)
        df.loc[row, col] = value
    return frame(fn)


def append_row(row):
    """The data row ``row`` appended again (a duplicate)."""
    def edit(path):
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(lines) + lines[row + 1])
    return edit


def header_only(path):
    path.write_text(path.read_text().splitlines()[0] + "\n")


def folder_instead(path):
    path.unlink()
    path.mkdir()


def pipe_instead(path):
    """A named pipe where the file was: reading it would block forever (no writer)."""
    path.unlink()
    os.mkfifo(path)


def link_loop(path):
    """A symbolic link to a link back to it: 'too many levels of symbolic links'."""
    path.unlink()
    os.symlink(path.name + ".b", path)
    os.symlink(path.name, path.with_name(path.name + ".b"))


def latin1_bytes(path):
    """A row with a latin-1 'é' (byte 0xe9): not UTF-8."""
    path.write_bytes(path.read_bytes() + "caf\xe9\n".encode("latin-1"))


def contradicting_log(df):
    """Every step's decode count and contexts taken from another step: the log no longer
    fits the run's trace and tokens (as a log of another run)."""
    for c in ("n_decode", "max_decode_context", "sum_decode_context", "n_prefill_seqs"):
        df[c] = df[c].sample(frac=1.0, random_state=0).to_numpy()


def shifted_log(df):
    """Every step 0.5 s later: every first token off by 0.5 s, the counts all right."""
    df["start_s"] += 0.5
    df["end_s"] += 0.5


def swap_rows(a, b, cols=None):
    """Rows ``a`` and ``b`` swapped (in ``cols`` only, when given)."""
    def fn(df):
        c = cols or list(df.columns)
        df.loc[[a, b], c] = df.loc[[b, a], c].to_numpy()
    return frame(fn)


def drop_column(col):
    return frame(lambda df: df.drop(columns=col))


def overlap(df):
    """Step 10 starts while step 9 still runs."""
    df.loc[10, "start_s"] = (df.loc[9, "start_s"] + df.loc[9, "end_s"]) / 2


def end_before_start(df):
    df.loc[5, "end_s"] = df.loc[5, "start_s"] - 0.001


def two_policies(df):
    df["policy"] = df["policy"].astype(object)
    df.loc[7, "policy"] = "chunked"


def token_before_arrival(df):
    # Request 0's first token (row 0 of tokens.csv) before it arrived.
    df.loc[0, "time_s"] = 0.1


def token_beyond_output(df):
    df.loc[0, "token_index"] = 463           # request 0 has 463 output tokens


# (file, edit, field in the message or None, words the message must hold)
CASES = {
    # requests.csv
    "requests-duplicate-id": ("requests.csv", append_row(1), "request_id (row 231)",
                              ["duplicate request_id", "got 1"]),
    "requests-header-only": ("requests.csv", header_only, None, ["no requests"]),
    "requests-unknown-id": ("requests.csv", set_cell("request_id", 4, 9999),
                            "request_id (row 5)", ["trace.csv does not list", "9999"]),
    "requests-id-text": ("requests.csv", set_cell("request_id", 4, "x5"),
                         "request_id (row 5)", ["not a number", "x5"]),
    "requests-prompt-disagrees": ("requests.csv", set_cell("prompt_tokens", 5, 999),
                                  "prompt_tokens (row 6)", ["request 5", "trace.csv", "999"]),
    "requests-output-disagrees": ("requests.csv", set_cell("output_tokens", 2, 7),
                                  "output_tokens (row 3)", ["request 2", "trace.csv", "7"]),
    "requests-scheduled-text": ("requests.csv", set_cell("first_scheduled_s", 3, "soon"),
                                "first_scheduled_s (row 4)", ["not a number", "soon"]),
    "requests-scheduled-negative": ("requests.csv", set_cell("first_scheduled_s", 3, -2.0),
                                    "first_scheduled_s (row 4)", ["at least 0", "-2.0"]),
    "requests-two-policies": ("requests.csv", frame(two_policies), "policy (row 8)",
                              ["more than one serving policy", "chunked"]),
    # trace.csv
    "trace-is-a-folder": ("trace.csv", folder_instead, None, ["is a folder, not a trace"]),
    "trace-header-only": ("trace.csv", header_only, None, ["no requests"]),
    "trace-duplicate-id": ("trace.csv", set_cell("request_id", 6, 5), "request_id (row 7)",
                           ["duplicate request_id", "row 6", "got 5"]),
    "trace-negative-arrival": ("trace.csv", set_cell("arrival_s", 0, -1.0), "arrival_s (row 1)",
                               ["at least 0", "-1.0"]),
    "trace-inf-arrival": ("trace.csv", set_cell("arrival_s", 229, "inf"),
                          "arrival_s (row 230)", ["not a finite number"]),
    "trace-zero-prompt": ("trace.csv", set_cell("prompt_tokens", 3, 0), "prompt_tokens (row 4)",
                          ["at least 1", "got 0"]),
    "trace-negative-output": ("trace.csv", set_cell("output_tokens", 8, -3),
                              "output_tokens (row 9)", ["at least 1", "-3"]),
    "trace-fractional-prompt": ("trace.csv", set_cell("prompt_tokens", 2, 12.5),
                                "prompt_tokens (row 3)", ["whole number", "12.5"]),
    "trace-negative-priority": ("trace.csv", set_cell("priority", 1, -1), "priority (row 2)",
                                ["at least 0"]),
    # tokens.csv
    "tokens-negative-time": ("tokens.csv", set_cell("time_s", 5, -0.5), "time_s (row 6)",
                             ["at least 0", "-0.5"]),
    "tokens-nan-time": ("tokens.csv", set_cell("time_s", 5, np.nan), "time_s (row 6)",
                        ["empty or NaN", "got nan"]),
    "tokens-text-time": ("tokens.csv", set_cell("time_s", 5, "later"), "time_s (row 6)",
                         ["not a number", "later"]),
    "tokens-duplicate": ("tokens.csv", append_row(9), "token_index (row 39906)",
                         ["duplicate token", "listed twice"]),
    "tokens-unknown-request": ("tokens.csv", set_cell("request_id", 2, 777),
                               "request_id (row 3)", ["does not list", "got 777"]),
    "tokens-negative-index": ("tokens.csv", set_cell("token_index", 3, -1),
                              "token_index (row 4)", ["at least 0"]),
    "tokens-beyond-output": ("tokens.csv", frame(token_beyond_output), "token_index (row 1)",
                             ["463 output_tokens", "got 463"]),
    "tokens-before-arrival": ("tokens.csv", frame(token_before_arrival), "time_s (row 1)",
                              ["before its request arrived", "0.1"]),
    # iterations.csv
    "iterations-text-start": ("iterations.csv", set_cell("start_s", 1, "abc"), "start_s (row 2)",
                              ["not a number", "abc"]),
    "iterations-nan-start": ("iterations.csv", set_cell("start_s", 4, np.nan), "start_s (row 5)",
                             ["empty or NaN"]),
    "iterations-inf-end": ("iterations.csv", set_cell("end_s", 4, "inf"), "end_s (row 5)",
                           ["not a finite number"]),
    "iterations-negative-start": ("iterations.csv", set_cell("start_s", 0, -1.0),
                                  "start_s (row 1)", ["at least 0"]),
    "iterations-end-before-start": ("iterations.csv", frame(end_before_start), "end_s (row 6)",
                                    ["ends before it starts"]),
    "iterations-unordered": ("iterations.csv", swap_rows(10, 11), "start_s (row 12)",
                             ["increasing start order"]),
    "iterations-overlap": ("iterations.csv", frame(overlap), "start_s (row 11)",
                           ["before the one before it ended"]),
    "iterations-fractional-decode": ("iterations.csv", set_cell("n_decode", 3, 1.5),
                                     "n_decode (row 4)", ["whole number", "1.5"]),
    "iterations-negative-prefill": ("iterations.csv", set_cell("n_prefill_tokens", 3, -4),
                                    "n_prefill_tokens (row 4)", ["at least 0", "-4"]),
    "iterations-fractional-seqs": ("iterations.csv", set_cell("n_prefill_seqs", 0, 0.5),
                                   "n_prefill_seqs (row 1)", ["whole number"]),
    "iterations-negative-context": ("iterations.csv", set_cell("max_decode_context", 7, -1),
                                    "max_decode_context (row 8)", ["at least 0"]),
    "iterations-fractional-context": ("iterations.csv", set_cell("sum_decode_context", 7, 3.25),
                                      "sum_decode_context (row 8)", ["whole number"]),
    "iterations-text-running": ("iterations.csv", set_cell("n_running", 7, "many"),
                                "n_running (row 8)", ["not a number", "many"]),
    "iterations-is-a-folder": ("iterations.csv", folder_instead, None,
                               ["is a folder, not a step log"]),
    "iterations-header-only": ("iterations.csv", header_only, None, ["no steps"]),
    # A step log that contradicts the run: refused, saying how far off (check_step_log).
    "iterations-contradict-every-step": ("iterations.csv", frame(contradicting_log), None,
                                         ["contradicts the run's trace and tokens",
                                          "of 3,158 steps (99%)", "prefill sequence counts"]),
    "iterations-shifted": ("iterations.csv", frame(shifted_log), None,
                           ["first tokens of 230 of 230 requests (100%)", "0.5 s off",
                            "over 1% is refused"]),
    "iterations-missing-column": ("iterations.csv", drop_column("n_decode"), "n_decode",
                                  ["missing columns: n_decode"]),
}


# Files that are not what they claim, in each of the folder's files: refused by the one
# vetting of the folder's files before any is read (recorded._vet_files).
for _name, _what in (("trace.csv", "trace"), ("requests.csv", "requests"),
                     ("tokens.csv", "tokens"), ("iterations.csv", "step log")):
    _stem = _name.split(".")[0]
    CASES[f"{_stem}-is-a-pipe"] = (_name, pipe_instead, None,
                                   ["is not a regular file", f"not a {_what}"])
    CASES[f"{_stem}-is-a-link-loop"] = (_name, link_loop, None,
                                        ["Too many levels of symbolic links"])
    CASES[f"{_stem}-latin1"] = (_name, latin1_bytes, None,
                                ["not a UTF-8 text file (byte 0xe9"])
CASES["other-json-is-a-pipe"] = ("notes.json", lambda p: os.mkfifo(p), None,
                                 ["is not a regular file"])   # the digest reads it


def _break(tmp_path, case):
    name, edit, field, words = CASES[case]
    folder = copy_run(tmp_path)
    edit(folder / name)
    return folder, name, field, words


def _check_message(msg, folder, name, field, words):
    assert "\n" not in msg
    assert msg.startswith(str(folder / name) + ":"), msg
    if field is not None:
        assert f"field '{field}'" in msg, msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_run_folder_is_one_line(tmp_path, case):
    folder, name, field, words = _break(tmp_path, case)
    with pytest.raises(LatsimError) as e:
        read_recorded_run(folder)
    _check_message(str(e.value), folder, name, field, words)


def test_valid_copy_reads_as_the_published_run(tmp_path):
    folder = copy_run(tmp_path)
    a, b = read_recorded_run(RUN), read_recorded_run(folder)
    assert len(b) == 230 and b.policy == "fifo" and b.steps is not None
    for k in ("rid", "arrival", "prompt", "output", "priority", "scheduled", "first_token",
              "last_token", "finished"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    assert a.real == b.real
    np.testing.assert_array_equal(a.steps.start_s, b.steps.start_s)
    assert a.steps.chunks == b.steps.chunks and a.steps.check == b.steps.check


def test_missing_iterations_is_fine(tmp_path):
    folder = copy_run(tmp_path)
    (folder / "iterations.csv").unlink()
    run = read_recorded_run(folder)
    assert run.steps is None and any("no iterations.csv" in n for n in run.notes)


@pytest.mark.parametrize("missing", ["tokens.csv", "trace.csv"])
def test_refbench_folder_missing_a_file_names_it(tmp_path, missing):
    folder = copy_run(tmp_path)
    (folder / missing).unlink()
    with pytest.raises(LatsimError) as e:
        read_recorded_run(folder)
    msg = str(e.value)
    assert msg.startswith(f"{folder / missing}: file not found"), msg
    assert "'rid'" not in msg


def bench_run(tmp_path, **over):
    """A small run in the bench format (``latsim bench --out``: ``requests.csv``)."""
    folder = tmp_path / "bench"
    folder.mkdir(parents=True)
    cols = {"rid": [0, 1, 2], "prompt_tokens": [10, 12, 8], "output_tokens": [4, 4, 3],
            "arrival": [0.0, 0.1, 0.2], "first_token": [0.05, 0.15, 0.26],
            "last_token": [0.2, 0.3, 0.35]}
    cols.update(over)
    pd.DataFrame(cols).to_csv(folder / "requests.csv", index=False)
    return folder


@pytest.mark.parametrize("over, field, words", [
    ({"rid": [0, 1, 1]}, "rid (row 3)", ["duplicate rid", "row 2"]),
    ({"prompt_tokens": [10, 12.5, 8]}, "prompt_tokens (row 2)", ["whole number"]),
    ({"output_tokens": [4, 0, 3]}, "output_tokens (row 2)", ["at least 1"]),
    ({"arrival": [0.0, np.inf, 0.2]}, "arrival (row 2)", ["not a finite number"]),
])
def test_bench_folder_bad_input(tmp_path, over, field, words):
    assert len(read_recorded_run(bench_run(tmp_path / "ok")).rid) == 3
    folder = bench_run(tmp_path, **over)
    with pytest.raises(LatsimError) as e:
        read_recorded_run(folder)
    _check_message(str(e.value), folder, "requests.csv", field, words)


def _one_error_line(text):
    lines = [ln for ln in text.splitlines() if ln.startswith("latsim: error:")]
    assert len(lines) == 1, text
    assert "internal error" not in text and "Traceback" not in text
    return lines[0][len("latsim: error: "):]


@pytest.mark.parametrize("case", ["requests-duplicate-id", "requests-header-only",
                                  "iterations-text-start", "trace-negative-arrival",
                                  "iterations-missing-column", "tokens-duplicate",
                                  "requests-prompt-disagrees"])
def test_cli_calibrate_rejects(tmp_path, case):
    folder, name, field, words = _break(tmp_path, case)
    out = tmp_path / "out.json"
    code, text = latsim("calibrate", SCEN, "--run", folder, "--out", out, "--no-sim")
    assert code == 2, text
    _check_message(_one_error_line(text), folder, name, field, words)
    assert not out.exists()


@pytest.mark.parametrize("case", ["trace-negative-arrival", "iterations-end-before-start",
                                  "tokens-negative-time"])
def test_cli_validate_rejects(tmp_path, case):
    folder, name, field, words = _break(tmp_path, case)
    code, text = latsim("validate", "--run", folder, SCEN)
    assert code == 2, text
    _check_message(_one_error_line(text), folder, name, field, words)


def test_cli_missing_tokens_names_the_file(tmp_path):
    folder = copy_run(tmp_path)
    (folder / "tokens.csv").unlink()
    code, text = latsim("validate", "--run", folder, SCEN)
    assert code == 2
    line = _one_error_line(text)
    assert re.match(re.escape(str(folder / "tokens.csv")) + r": file not found", line), line


def test_cli_valid_copy_calibrates(tmp_path):
    """The valid copy: exit 0 (facts only, no simulations: the quickest full read)."""
    folder = copy_run(tmp_path)
    code, text = latsim("calibrate", SCEN, "--run", folder, "--facts-only", "--no-sim")
    assert code == 0, text
    assert "latsim: error" not in text


def test_a_run_whose_request_ids_do_not_follow_arrival_order_validates_alike(tmp_path):
    """Request ids are names, not an order: the published fifo run with its ids shuffled
    (the same bijection in trace.csv, requests.csv and tokens.csv, rows in the new id
    order) reads in arrival order and gives ``validate --run`` the same real and
    simulated P50/P99 and the same step errors to the last digit."""
    from simulator.config.scenario import load_scenario
    from simulator.cost.calibration import RunCase, match_policy, validate_recorded
    folder = copy_run(tmp_path)
    trace = pd.read_csv(folder / "trace.csv")
    new_id = dict(zip(trace["request_id"],
                      np.random.default_rng(5).permutation(len(trace)) + 1000))
    for name in ("trace.csv", "requests.csv", "tokens.csv"):
        df = pd.read_csv(folder / name)
        df["request_id"] = df["request_id"].map(new_id)
        df.sort_values(["request_id"] + (["token_index"] if name == "tokens.csv" else []),
                       kind="stable").to_csv(folder / name, index=False)
    shuffled = read_recorded_run(folder)
    assert (np.diff(shuffled.arrival) >= 0).all()
    assert not (np.diff(shuffled.rid) > 0).all()
    sc, base = load_scenario(SCEN)
    out = []
    for run in (read_recorded_run(RUN), shuffled):
        label, psc = match_policy(sc, run, str(SCEN))
        out.append(validate_recorded(RunCase(run, label, psc), base_dir=base))
    assert out[0]["real"] == out[1]["real"]
    assert out[0]["errors"] == out[1]["errors"]
    assert out[0]["step_errors"] == out[1]["step_errors"]


# -- a `latsim bench --out` folder's summary.json ----------------------------------------

def bench_like(tmp_path):
    """A bench-format folder (requests.csv with rid, arrival, first_token, ...; no
    tokens.csv, so its P50/P99 come from summary.json) made from the published run."""
    folder = tmp_path / "bench"
    folder.mkdir()
    read_recorded_run(RUN).requests_table().to_csv(folder / "requests.csv", index=False)
    keys = {f"{q}_{m}_ms": 1.0 + i for i, (q, m) in enumerate(
        (q, m) for m in ("ttft", "tpot", "itl", "e2el") for q in ("median", "p99"))}
    (folder / "summary.json").write_text(json.dumps({"overall": keys}))
    return folder


def test_a_bench_folder_reads_its_summary(tmp_path):
    run = read_recorded_run(bench_like(tmp_path))
    assert run.kind == "bench" and run.real["median_ttft_ms"] == 1.0
    assert run.real["p99_e2el_ms"] == 8.0


@pytest.mark.parametrize("text, words", [
    ("[1, 2]", ["must be a JSON object", "got [1, 2]"]),
    ('{"overall": [1, 2]}', ["field 'overall'", "must be a JSON object", "got [1, 2]"]),
    ('{"overall": "fast"}', ["field 'overall'", "got 'fast'"]),
    ("[" * 100_000 + "]" * 100_000, ["invalid JSON: nested too deeply"]),
    ('{"overall": {"median_ttft_ms": NaN', ["invalid JSON at line 1"]),
    (b'{"overall": "caf\xe9"}', ["not a UTF-8 text file (byte 0xe9 at offset 16)"]),
    ("pipe", ["is not a regular file", "not a bench summary"]),
    ("loop", ["Too many levels of symbolic links"]),
], ids=["list", "overall-list", "overall-text", "deep", "cut", "latin1", "pipe", "loop"])
def test_a_bench_summary_that_is_not_one_is_refused(tmp_path, text, words):
    """summary.json of the wrong JSON type, too deep, not UTF-8, or a pipe / link loop
    where the file should be: one line naming it (before: an AttributeError, a
    RecursionError, or a read blocked forever on the pipe)."""
    folder = bench_like(tmp_path)
    sj = folder / "summary.json"
    if text == "pipe":
        pipe_instead(sj)
    elif text == "loop":
        link_loop(sj)
    elif isinstance(text, bytes):
        sj.write_bytes(text)
    else:
        sj.write_text(text)
    with pytest.raises(LatsimError) as e:
        read_recorded_run(folder)
    msg = str(e.value)
    assert msg.startswith(str(sj) + ":") and "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("case", ["requests-is-a-pipe", "iterations-is-a-link-loop",
                                  "iterations-contradict-every-step"])
def test_cli_calibrate_refuses_a_folder_file_that_is_not_one(tmp_path, case):
    """Through the CLI: exit 2 and one line, no profile written (a pipe used to block
    calibrate forever; a contradicting step log used to be calibrated on)."""
    folder, name, field, words = _break(tmp_path, case)
    out = tmp_path / "out.json"
    code, text = latsim("calibrate", SCEN, "--run", folder, "--out", out, "--no-sim")
    assert code == 2, text
    _check_message(_one_error_line(text), folder, name, field, words)
    assert not out.exists()
