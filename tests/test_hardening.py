"""One test per problem measured on a fresh clone: bad input ends in one error line (exit
2) before any work, never a traceback; results are written whole or not at all; a run
whose requests never finish says so and exits 1; big runs are sized before they start
and watched while they run; the README's examples work as written.

Most cases run the command line in this process (``simulator.cli.main.main``, the
console script's own entry point, so its one-line printer is what is tested); a few
run it as a subprocess to check what a user's terminal receives.
"""
from __future__ import annotations

import importlib
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from rich.console import Console

from conftest import REPO, make_scenario, make_scenario_dict
from simulator.errors import LatsimError, one_line, short_repr

BAD = REPO / "tests" / "data" / "bad"


def cli(argv, capsys) -> tuple[int, str, str]:
    """``latsim ARGV`` in this process: (exit code, stdout, stderr)."""
    from simulator.cli.main import main
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def error_line(err: str) -> str:
    """The one ``latsim: error:`` line on stderr (asserts there is exactly one)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("latsim: error: "), lines[0]
    assert len(lines[0]) < 4096 and "Traceback" not in err
    return lines[0]


def write(tmp_path: Path, data, name: str = "s.yaml") -> Path:
    """Write a scenario (a mapping, or YAML text) into ``tmp_path``."""
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def small(n: int = 30, **over) -> dict:
    """A valid scenario mapping of ``n`` requests (conftest's, with overrides)."""
    d = make_scenario_dict(**over)
    d["workload"]["num_requests"] = n
    return d


@pytest.fixture
def no_simulation(monkeypatch):
    """Make any simulation fail the test: the error must come before the run."""
    import simulator.loops.simulate as sim

    def boom(*a, **k):
        """Stands in for ``simulate``: reaching it fails the test."""
        raise AssertionError("the run started although its input was bad")
    monkeypatch.setattr(sim, "simulate", boom)


# -- bad input reaching Python tracebacks --------------------------------------------------

def test_binary_file_as_scenario(capsys):
    """A binary or non-UTF-8 scenario is one error line, not a UnicodeDecodeError."""
    code, _, err = cli(["run", BAD / "scenarios" / "binary-nul.yaml"], capsys)
    assert code == 2 and "not a text file" in error_line(err)
    code, _, err = cli(["run", BAD / "scenarios" / "not-utf8.yaml"], capsys)
    assert code == 2 and "not a UTF-8 text file (byte 0xe9" in error_line(err)


def test_directory_as_scenario(capsys, tmp_path):
    """A folder given as the scenario is one error line."""
    code, _, err = cli(["run", tmp_path], capsys)
    assert code == 2 and "is a folder" in error_line(err)


def test_negative_seed_in_the_scenario_and_on_the_command_line(capsys, tmp_path):
    """``seed: -1`` and ``--seed -1`` are refused (numpy would raise)."""
    p = write(tmp_path, {**small(), "seed": -1})
    code, _, err = cli(["run", p], capsys)
    assert code == 2 and "'seed'" in error_line(err) and "(got -1)" in err
    code, _, err = cli(["run", write(tmp_path, small(), "ok.yaml"), "--seed", "-1"], capsys)
    assert code == 2 and error_line(err) == "latsim: error: --seed: must be >= 0 (got -1)"


def test_trace_cell_of_1e30_names_line_and_column(capsys):
    """A token count of 1e30 is refused with its line and column, not cast to garbage."""
    code, _, err = cli(["trace", "summarize", BAD / "traces" / "csv-token-1e30.csv"], capsys)
    line = error_line(err)
    assert code == 2 and "csv-token-1e30.csv:2: column 'prompt_tokens'" in line
    assert "must be <= 1,000,000,000 (got '1e30')" in line


@pytest.mark.parametrize("case", ["a file", "under a file", "not writable"])
def test_bad_out_is_refused_before_the_run(capsys, tmp_path, monkeypatch, no_simulation, case):
    """``--out`` that is a file, under a file or not writable fails before anything runs."""
    f = tmp_path / "afile"
    f.write_text("x")
    out = {"a file": f, "under a file": f / "sub", "not writable": tmp_path / "ro" / "out"}[case]
    if case == "not writable":
        import simulator.report.files as files
        (tmp_path / "ro").mkdir()
        real = files.os.access
        monkeypatch.setattr(files.os, "access",
                            lambda p, m: False if Path(p) == tmp_path / "ro" else real(p, m))
    code, _, err = cli(["run", write(tmp_path, small()), "--out", out], capsys)
    line = error_line(err)
    assert code == 2 and line.startswith("latsim: error: --out: ")
    assert {"a file": "exists and is not a folder", "under a file": "is a file",
            "not writable": "not writable"}[case] in line


def test_out_that_holds_files_needs_force_and_force_keeps_other_files(capsys, tmp_path):
    """A non-empty ``--out`` needs ``--force``, which replaces the results and nothing else."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "requests-old.csv").write_text("a stale table from an earlier run\n")
    p = write(tmp_path, small())
    code, _, err = cli(["run", p, "--out", out], capsys)
    assert code == 2 and "--force" in error_line(err)
    code, out_text, err = cli(["run", p, "--out", out, "--force"], capsys)
    assert code == 0, err
    assert sorted(f.name for f in out.iterdir()) == [
        "notes.txt", "requests.csv", "scenario.yaml", "summary.json", "timeseries.csv"]
    assert not list(tmp_path.glob(".out.partial-*"))


def test_an_interrupted_run_leaves_no_table_that_looks_whole(capsys, tmp_path, monkeypatch):
    """Ctrl-C while writing leaves no ``--out`` folder and no partial files."""
    import simulator.report.files as files

    def half_then_interrupt(res, path, fmt="csv", rows=0):
        """Write half a table, then behave as Ctrl-C does."""
        Path(path).write_text("rid,priority\n0,1\n")   # half a table...
        raise KeyboardInterrupt                          # ...then Ctrl-C
    monkeypatch.setattr(files, "write_requests", half_then_interrupt)
    code, _, err = cli(["run", write(tmp_path, small()), "--out", tmp_path / "out"], capsys)
    assert code == 130 and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_a_trillion_requests_are_refused_at_once(capsys, tmp_path, monkeypatch):
    """``num_requests: 1e12`` is refused from the estimate, before any array is made."""
    import simulator.workload as workload

    def never(*a, **k):
        """Stands in for the workload builder: reaching it fails the test."""
        raise AssertionError("the workload was built")
    monkeypatch.setattr(workload, "build_workload", never)
    d = small()
    d["workload"]["num_requests"] = 10**12
    d["workload"]["arrival"]["rate"] = 1e5      # a span simulated time can hold (1e7 s)
    code, _, err = cli(["run", write(tmp_path, d)], capsys)
    line = error_line(err)
    assert code == 2 and "1,000,000,000,000 requests need about" in line and "--yes" in line


def test_yes_runs_past_the_memory_estimate(capsys, tmp_path, monkeypatch):
    """The memory estimate refuses a run; ``--yes`` runs it anyway."""
    import simulator.errors as errors
    monkeypatch.setattr(errors, "available_memory", lambda: 2**20)   # a 1 MiB machine
    p = write(tmp_path, small(20))
    code, _, err = cli(["run", p], capsys)
    assert code == 2 and "pass --yes" in error_line(err)
    code, out, err = cli(["run", p, "--yes"], capsys)
    assert code == 0, err


def test_profile_whose_decode_rows_are_all_nan(capsys, tmp_path):
    """A profile whose decode times are all NaN is refused, naming the row."""
    d = small()
    d["model"]["cost"]["path"] = str(BAD / "profiles" / "decode-all-nan.json")
    code, _, err = cli(["run", write(tmp_path, d)], capsys)
    assert code == 2 and "field 'decode[0].ms'" in error_line(err) and "(got nan)" in err


# -- bad input accepted silently -------------------------------------------------------------

def test_infinite_rate_is_refused(capsys, tmp_path):
    """``rate: .inf`` is refused, not accepted silently."""
    code, _, err = cli(["run", write(tmp_path, small()), "--set",
                        "workload.arrival.rate=.inf"], capsys)
    line = error_line(err)
    assert code == 2 and "'workload.arrival.rate': must be a finite number (got inf)" in line


def test_profile_row_with_nan_ms_is_refused(capsys, tmp_path):
    """A profile row with ``ms: NaN`` is refused, not accepted silently."""
    d = small()
    d["model"]["cost"]["path"] = str(BAD / "profiles" / "prefill-ms-nan.json")
    code, _, err = cli(["run", write(tmp_path, d)], capsys)
    assert code == 2 and "field 'prefill[0].ms'" in error_line(err)


def test_kv_cache_too_small_for_every_request_is_refused_before_the_run(capsys, tmp_path,
                                                                         no_simulation):
    """A KV cache no request fits in is an error before the run, not 0 completed and exit 0."""
    d = small()
    d["engine"]["kv"] = {"num_blocks": 2}
    code, _, err = cli(["run", write(tmp_path, d)], capsys)
    line = error_line(err)
    assert code == 2 and "no request can ever run" in line and "all 30" in line


def test_requests_too_large_for_the_kv_cache_are_counted_before_and_fail_the_run(capsys,
                                                                                 tmp_path):
    """Requests the KV cache can never hold are counted before the run, reported after
    it, and exit 1."""
    d = small(60)
    d["engine"]["kv"] = {"num_blocks": 20}        # 320 tokens: the longest requests cannot run
    p = write(tmp_path, d)
    from simulator.config.scenario import load_scenario
    from simulator.loops.simulate import never_fit, simulate
    sc, base = load_scenario(p)
    res = simulate(sc, base_dir=base)
    expect = int(res.rec.rejected.sum())
    assert 0 < expect < 60
    assert never_fit(sc, res.workload)["over_capacity"] == expect
    code, out, err = cli(["run", p, "--out", tmp_path / "o"], capsys)
    assert code == 1 and err == ""
    text = " ".join(out.split())
    warn = text.index(f"warning: {expect} of 60 requests can never run")
    assert warn < text.index("simulated in")                 # said before the run
    assert f"not finished: {expect} rejected: too large for the KV cache" in text
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["overall"]["rejected"] == expect          # the results are still written


@pytest.mark.parametrize("alloc", [{"allocation": "paged"},
                                   {"allocation": "contiguous", "max_model_len": 300},
                                   {"allocation": "paged", "max_model_len": 200,
                                    "watermark": 0.5}])
def test_never_fit_counts_exactly_what_the_run_rejects(alloc):
    """The pre-run count equals the run's rejections, paged or contiguous, with a watermark."""
    from simulator.loops.simulate import never_fit, simulate
    d = small(80)
    d["engine"]["kv"] = {"num_blocks": 24, **alloc}
    from simulator.config.scenario import validate_scenario
    sc = validate_scenario(d)
    res = simulate(sc)
    nf = never_fit(sc, res.workload)
    assert nf["over_capacity"] + nf["over_max_model_len"] == int(res.rec.rejected.sum())


def test_requests_cut_by_max_sim_time_fail_the_run_and_say_why(capsys, tmp_path):
    """Requests still running at ``max_sim_time_s`` are explained, and the run exits 1."""
    d = small(200)
    d["max_sim_time_s"] = 10.0
    code, out, _ = cli(["run", write(tmp_path, d)], capsys)
    text = " ".join(out.split())
    m = re.search(r"not finished: ([\d,]+) still queued or running when the clock stopped at "
                  r"max_sim_time_s = 10 s", text)
    assert code == 1 and m
    assert re.search(rf"not finished\s*│\s*{m.group(1)}", out)


def test_clients_that_disconnect_are_explained_but_do_not_fail_the_run(capsys, tmp_path):
    """Requests cancelled by their clients (as the scenario asks) are explained; exit 0."""
    d = small(40)
    d["stream"] = {**d["stream"], "disconnect": {
        "probability": 1.0, "after_first_token": {"kind": "constant", "s": 0.0}}}
    code, out, err = cli(["run", write(tmp_path, d)], capsys)
    assert code == 0, err
    assert "cancelled after their clients disconnected" in " ".join(out.split())


# -- resource blow-ups ----------------------------------------------------------------------

def test_billion_laughs_is_refused_from_the_node_graph():
    """A YAML bomb and a recursive alias are refused while parsing, before expansion."""
    from simulator.config.scenario import read_yaml
    with pytest.raises(LatsimError, match="YAML aliases expand the document by 926,177,086"):
        read_yaml(BAD / "scenarios" / "billion-laughs.yaml")
    with pytest.raises(LatsimError, match="refers to itself"):
        read_yaml(BAD / "scenarios" / "recursive-alias.yaml")


def test_ordinary_aliases_still_work(tmp_path):
    """An anchor used a few times is a normal YAML feature, not an attack."""
    from simulator.config.scenario import load_scenario
    p = tmp_path / "a.yaml"
    p.write_text(yaml.safe_dump(small()).replace(
        "workload:\n", "workload:\n  classes: [{name: a, share: &s 2.0}, {name: b, share: *s}]\n",
        1))
    sc, _ = load_scenario(p)
    assert [(c.name, c.share) for c in sc.workload.classes] == [("a", 2.0), ("b", 2.0)]


def test_a_value_is_shortened_in_one_place():
    """``LatsimError`` shortens values and escapes control characters, whatever their size."""
    e = LatsimError("bad", source="f.yaml", field="name", value="x" * 2_000_000, has_value=True)
    assert len(str(e)) < 200 and "(2,000,000 characters)" in str(e)
    huge = [list(range(1000))] * 100_000     # shared rows, like YAML aliases
    assert len(short_repr(huge)) <= 120
    assert one_line("a\nb\r\x00c") == "a b \\x00c"
    assert len(one_line("y" * 10**6)) <= 1000


def test_a_two_megabyte_value_costs_one_short_line(tmp_path):
    """A 2 MB value costs one line under 4 KB on a real stderr."""
    d = small()
    d["name"] = "n" * 2_000_000
    r = subprocess.run([sys.executable, "-m", "simulator.cli", "run", write(tmp_path, d)],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and len(r.stderr) < 4096
    assert "field 'name'" in error_line(r.stderr)


class _Rec:
    """A recorder as the progress watcher sees it."""

    def __init__(self, n):
        self.last_delivered = np.full(n, np.nan)
        self.rejected = np.zeros(n, dtype=bool)
        self.cancelled = np.zeros(n, dtype=bool)


def _wait_for(cond, what: str):
    """Poll ``cond`` until it holds (a behaviour check, not a speed one: the bound is
    generous and only stops a broken watcher from hanging the suite)."""
    for _ in range(600):
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"never saw {what}")


def test_a_long_run_announces_compiling_and_shows_progress(monkeypatch):
    """The run watcher says the loop is compiling, then how many requests are settled."""
    m = importlib.import_module("simulator.cli.run")
    monkeypatch.setattr(m, "compiled_loop_cached", lambda: False)
    buf = io.StringIO()
    watch = m.RunProgress("chunked", 1000, Console(file=buf, force_terminal=False, width=200))
    watch.DELAY_S, watch.NOTE_S = 0.0, 0.0
    rec = _Rec(1000)
    try:
        watch("compiled", rec)
        assert "compiling the event loop" in buf.getvalue()   # said when it starts
        _wait_for(lambda: "chunked: compiling the event loop," in buf.getvalue(),
                  "a compiling line")
        rec.last_delivered[:400] = 1.0
        rec.rejected[400:500] = True
        _wait_for(lambda: "500 of 1,000 requests settled" in buf.getvalue(), "progress")
    finally:
        watch.close()
    assert not watch._thread.is_alive()


def test_simulate_hands_its_recorder_to_the_progress_callback():
    """``simulate(progress=...)`` is called once with the loop's name and the run's recorder."""
    from simulator.loops.simulate import simulate
    seen = []
    res = simulate(make_scenario(), progress=lambda loop, rec: seen.append((loop, rec)))
    assert [loop for loop, _ in seen] == ["simpy"] and seen[0][1] is res.rec


def test_the_requests_table_is_streamed_in_chunks_exactly(tmp_path):
    """Chunked CSV is byte for byte pandas' CSV; chunked Parquet reads back as the same frame."""
    from simulator.loops.simulate import simulate
    from simulator.config.scenario import validate_scenario
    from simulator.report.metrics import requests_table
    from simulator.report.files import write_requests
    d = small(57)
    d["workload"]["classes"] = [{"name": "P0, urgent", "share": 1}, {"name": "P1", "share": 2}]
    res = simulate(validate_scenario(d))
    df = requests_table(res)
    write_requests(res, tmp_path / "r.csv", "csv", rows=10)
    assert (tmp_path / "r.csv").read_text() == df.to_csv(index=False, float_format="%.9g")
    write_requests(res, tmp_path / "r.parquet", "parquet", rows=10)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "r.parquet"), df)


def test_the_summary_without_the_table_is_the_same_summary():
    """The lean summary (no full table) equals the summary from the full table."""
    from simulator.loops.simulate import simulate
    from simulator.report.output import run_outputs, run_summary
    d = small(80)
    d["workload"]["classes"] = [{"name": "a", "share": 1, "slo": {"ttft_ms": 50}},
                                {"name": "b", "share": 1}]
    d["engine"]["kv"] = {"num_blocks": 30}
    from simulator.config.scenario import validate_scenario
    res = simulate(validate_scenario(d))
    dump = lambda o: json.dumps(o, sort_keys=True, default=str)   # noqa: E731
    assert dump(run_summary(res)) == dump(run_outputs(res)[1])
    from simulator.report.output import summary_frame
    assert len(summary_frame(res, rows=7)) == 80          # chunk by chunk, every row


def test_big_runs_write_parquet_and_plots_need_csv(capsys, tmp_path):
    """Above the CSV limit the table is Parquet; a bad ``--table-format`` is one line."""
    from simulator.report.files import REQUESTS_CSV_MAX, table_format
    assert table_format("auto", REQUESTS_CSV_MAX) == "csv"
    assert table_format("auto", REQUESTS_CSV_MAX + 1) == "parquet"
    assert table_format("csv", 10**7) == "csv"
    code, _, err = cli(["run", write(tmp_path, small()), "--table-format", "xml"], capsys)
    assert code == 2 and "--table-format" in error_line(err)
    code, _, err = cli(["run", write(tmp_path, small()), "--table-format", "parquet", "--out",
                        tmp_path / "o"], capsys)
    assert code == 0 and (tmp_path / "o" / "requests.parquet").exists(), err


def test_tls_version_as_a_number_is_read_as_the_version(capsys, tmp_path):
    """``--set network.tls=1.2`` (a YAML number) means TLS 1.2."""
    from simulator.config.scenario import load_scenario
    p = write(tmp_path, small())
    for v in ("1.2", "1.3"):
        sc, _ = load_scenario(p, [f"network.tls={v}"])
        assert sc.network.tls == v
    with pytest.raises(LatsimError, match="network.tls"):
        load_scenario(p, ["network.tls=1.1"])


# -- the README's examples ------------------------------------------------------------------

def _readme_commands(word: str) -> list[str]:
    """Every ``latsim WORD`` command in README.md's code blocks (continuations joined)."""
    text = (REPO / "README.md").read_text()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        cmds += [ln.strip() for ln in joined.splitlines()
                 if ln.strip().startswith(f"latsim {word} ")]
    return cmds


def test_every_readme_sweep_example_names_its_out_folder():
    """Every ``latsim sweep`` example in the README has the ``--out`` sweep requires."""
    cmds = _readme_commands("sweep")
    assert any("slow-clients" in c for c in cmds)
    for c in cmds:
        assert "--out" in c, c


def test_plots_without_out_fail_before_the_run(capsys, tmp_path, no_simulation):
    """``--plots`` without ``--out`` fails before the run, not after it."""
    code, _, err = cli(["run", write(tmp_path, small()), "--plots"], capsys)
    assert code == 2 and error_line(err).startswith("latsim: error: --plots: --plots needs --out")


def test_unknown_kinds_are_named_not_a_format_placeholder(capsys, tmp_path):
    """Unknown kinds are quoted in the message, never a literal ``{kind!r}``."""
    for key, val in (("workload.arrival.kind", "weibul"), ("workload.kind", "replay"),
                     ("workload.prompt_tokens.kind", "zipf")):
        code, _, err = cli(["run", write(tmp_path, small()), "--set", f"{key}={val}"], capsys)
        line = error_line(err)
        assert code == 2 and f"'{val}'" in line and "{kind" not in line and "!r}" not in line


def test_a_bad_grid_is_reported_as_grid(capsys, tmp_path):
    """A malformed ``--grid`` is reported as ``--grid``, not ``--set``."""
    code, _, err = cli(["sweep", write(tmp_path, small()), "--grid", "engine.policy",
                        "--out", tmp_path / "o"], capsys)
    assert code == 2 and error_line(err).startswith("latsim: error: --grid: must look like")


def test_version(capsys):
    """``latsim --version`` prints the installed version."""
    from importlib.metadata import version
    code, out, _ = cli(["--version"], capsys)
    assert code == 0 and out.strip() == f"latsim {version('latsim')}"


def test_tables_at_80_columns_never_split_a_number():
    """Five runs side by side at 80 columns: split into tables that fit, every number whole."""
    from simulator.loops.simulate import simulate
    from simulator.report.output import run_summary
    from simulator.report.tables import fmt, print_run
    from simulator.config.scenario import validate_scenario
    d = small(60)
    d["workload"]["classes"] = [{"name": "P0", "share": 1}, {"name": "P1", "share": 1}]
    outs = {}
    for label, pol in (("fifo", "fifo"), ("chunked", "chunked"), ("aging", "priority_aging"),
                       ("fair", "fair_score"), ("chunked-again", "chunked")):
        d["engine"]["policy"] = pol
        outs[label] = run_summary(simulate(validate_scenario(d)))
    buf = io.StringIO()
    print_run(Console(file=buf, width=80, force_terminal=False), outs)
    text = buf.getvalue()
    assert max(len(ln) for ln in text.splitlines()) <= 80
    cells = set(text.replace("│", " ").split())
    for o in outs.values():
        for key in ("p99_e2el_ms", "median_ttft_ms", "mean_t_decode_ms", "output_throughput"):
            assert fmt(o["overall"][key]) in cells, key
        assert o["overall"]["diagnosis"] in cells
    for label in outs:
        assert label in cells


# -- every error path goes through the one-line printer --------------------------------------

def test_usage_errors_are_one_line(capsys):
    """Typer's usage errors are one line, exit 2, not a box."""
    for argv in (["run", "--bogus"], ["run"], ["run", "x.yaml", "--seed", "abc"],
                 ["trace", "summarize"], ["nosuchcommand"]):
        code, _, err = cli(argv, capsys)
        assert code == 2 and error_line(err), argv


def test_a_bug_is_one_line_and_exit_70(capsys, monkeypatch):
    """An unexpected exception is one 'internal error' line, exit 70."""
    m = importlib.import_module("simulator.cli.run")

    def bug(*a, **k):
        """A command that fails the way a bug does."""
        raise RuntimeError("something\nunexpected")
    monkeypatch.setattr(m, "_run", bug)
    monkeypatch.delenv("LATSIM_DEBUG", raising=False)
    code, _, err = cli(["run", "x.yaml"], capsys)
    line = error_line(err)
    assert code == 70 and "internal error" in line and "RuntimeError: something unexpected" in line


def test_sweep_out_and_size_are_checked_before_any_point_runs(tmp_path, monkeypatch):
    """A sweep's ``--out`` and its points' memory are checked before any point runs."""
    import simulator.planning.sweep as sweep
    monkeypatch.setattr(sweep, "make_executor", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("a point ran")))
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(LatsimError, match="--out: exists and is not a folder"):
        sweep.run_sweep(small(), REPO, [sweep.parse_axis("engine.policy=fifo")], f)
    big = small()
    big["workload"]["num_requests"] = 10**12
    big["workload"]["arrival"]["rate"] = 1e5
    with pytest.raises(LatsimError, match="--grid: running 1 point"):
        sweep.run_sweep(big, REPO, [sweep.parse_axis("engine.policy=fifo")], tmp_path / "o",
                        workers=1)


def test_validation_on_a_busy_cpu_box_says_the_errors_measure_the_load(capsys, monkeypatch):
    """Wall-clock validation on a loaded 2-core box read as -60% TTFT error with no word
    of why: a load average over half the cores now prints a warning first."""
    import importlib
    import os

    M = importlib.import_module("simulator.cli.engine")
    monkeypatch.delenv("LATSIM_NO_LOAD_WARNING", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.8, 1.0, 1.0))
    M._warn_if_busy("cpu")
    assert "validate on a quiet machine" in capsys.readouterr().out
    M._warn_if_busy("cuda")       # a GPU's step times do not share the host's cores
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    M._warn_if_busy("cpu")
    assert capsys.readouterr().out == ""


# -- result files: checked before any work, never replaced unasked -------------------------

RUN50 = REPO / "data" / "h200-refbench" / "runs" / "load50-fifo"
SCEN50 = REPO / "scenarios" / "refbench-load50-fifo.yaml"


@pytest.mark.parametrize("cmd", [
    ["plan", "{s}", "--cost-per-gpu-hour", "2", "--search", "cluster.replicas=1:2",
     "--no-headroom", "--workers", "1"],
    ["calibrate", SCEN50, "--run", RUN50, "--no-sim"],
    ["validate", "--run", RUN50, SCEN50],
    ["sweep", "{s}", "--grid", "engine.max_num_seqs=8,16", "--workers", "1"],
    ["bench", "--url", "http://127.0.0.1:1", "--limit", "1"],
    ["trace", "convert", REPO / "tests" / "data" / "azure_conv_head40.csv"],
], ids=["plan", "calibrate", "validate", "sweep", "bench", "trace-convert"])
def test_an_unwritable_out_is_refused_before_any_work(tmp_path, capsys, cmd):
    """``--out`` under a file, or where nothing can be made (``/proc``, whatever the
    permission bits say to root), is one error line naming --out before anything runs
    (it was found only when writing: exit 70 'a bug in latsim', the results lost)."""
    s = write(tmp_path, small(20))
    argv = [str(a).replace("{s}", str(s)) for a in cmd]
    afile = tmp_path / "afile"
    afile.write_text("x")
    name = "x.json" if cmd[0] == "calibrate" else "x.csv" if cmd[0] == "trace" else "x"
    for bad in (afile / name, Path("/proc") / name):
        code, out, err = cli(argv + ["--out", bad], capsys)
        assert code == 2 and "--out" in error_line(err), err
        assert "Latency" not in out and "real vs simulated" not in out    # nothing ran


def test_earlier_results_are_replaced_only_with_force(tmp_path, capsys):
    """``plan``, ``bench`` and ``trace convert`` refuse to replace earlier results unless
    ``--force`` (as ``run``, ``sweep`` and ``calibrate`` do); ``trace convert`` never
    writes over the trace it reads."""
    s = write(tmp_path, small(20))
    old = tmp_path / "old"
    old.mkdir()
    (old / "summary.json").write_text("{}")
    code, _, err = cli(["plan", s, "--cost-per-gpu-hour", "2", "--search",
                        "cluster.replicas=1:2", "--no-headroom", "--workers", "1",
                        "--out", old], capsys)
    assert code == 2 and "--force" in error_line(err)
    code, _, err = cli(["bench", "--url", "http://127.0.0.1:1", "--limit", "1", "--out", old],
                       capsys)
    assert code == 2 and "--force" in error_line(err)
    assert (old / "summary.json").read_text() == "{}"
    src = tmp_path / "t.csv"
    src.write_text((REPO / "tests" / "data" / "azure_conv_head40.csv").read_text())
    code, _, err = cli(["trace", "convert", src, "--out", src, "--limit", "3"], capsys)
    assert code == 2 and "the file being read" in error_line(err)
    dst = tmp_path / "c.csv"
    assert cli(["trace", "convert", src, "--out", dst], capsys)[0] == 0
    code, _, err = cli(["trace", "convert", src, "--out", dst, "--limit", "3"], capsys)
    assert code == 2 and "--force" in error_line(err)
    assert cli(["trace", "convert", src, "--out", dst, "--limit", "3", "--force"], capsys)[0] == 0
    assert len(pd.read_csv(dst)) == 3


def test_a_workload_that_draws_no_request_is_refused(tmp_path, capsys, no_simulation):
    """``duration_s`` too short for a single arrival is bad input naming the field (a run
    of nothing reported 'no requests completed' and exited 0)."""
    d = small()
    d["workload"].pop("num_requests")
    d["workload"]["duration_s"] = 0.001
    code, _, err = cli(["run", write(tmp_path, d)], capsys)
    line = error_line(err)
    assert code == 2 and "s.yaml" in line and "workload.duration_s" in line and "0.001" in line


def test_error_lines_name_fields_as_written_and_quote_once(tmp_path, capsys, no_simulation):
    """A bad entry under ``policies`` is named by its path in the file (not pydantic's
    validator tag), and a bad draft model quotes the value once."""
    d = small()
    d["policies"] = [{"policy": "nope"}]
    line = error_line(cli(["run", write(tmp_path, d)], capsys)[2])
    assert "field 'policies.0.policy'" in line and "function-" not in line
    d = small()
    d["engine"]["speculative"] = {"method": "draft", "k": 4, "acceptance": 0.7,
                                  "draft_model": "nope"}
    line = error_line(cli(["run", write(tmp_path, d)], capsys)[2])
    assert "draft_model" in line and line.count("(got 'nope')") == 1


@pytest.mark.parametrize("dist,what", [
    ({"kind": "lognormal", "mean": 5000, "cv": 1.0, "max": 100}, "median"),
    ({"kind": "exponential", "mean": 5, "min": 50}, "median"),
    ({"kind": "constant", "value": 300, "max": 200}, "value"),
    ({"kind": "uniform", "low": 600, "high": 900, "max": 500}, "median"),
])
def test_a_length_distribution_clipped_into_a_constant_is_refused(tmp_path, capsys,
                                                                  no_simulation, dist, what):
    """A length whose median (or value) lies outside its own min..max drew the bound for
    most requests (a lognormal of mean 5000 with max 100: all 100). A heavy tail cut at
    max is allowed: mean 1000, cv 3 (median 316) under max 900."""
    d = small()
    d["workload"]["prompt_tokens"] = dist
    line = error_line(cli(["run", write(tmp_path, d)], capsys)[2])
    assert "workload.prompt_tokens" in line and f"its {what}" in line and "outside" in line
    from simulator.config.scenario import validate_scenario
    d["workload"]["prompt_tokens"] = {"kind": "lognormal", "mean": 1000, "cv": 3, "max": 900}
    validate_scenario(d)


def test_a_ctrl_c_while_the_run_watcher_starts_leaves_it_closable(monkeypatch):
    """Ctrl-C landing as the watcher's thread is made but not yet started: ``close`` (the
    run's cleanup) must not join a thread never started (RuntimeError: the interrupted
    run exited 70, an internal error, instead of 130; seen once in a loaded suite run)."""
    import threading
    m = importlib.import_module("simulator.cli.run")

    def start(self):
        raise KeyboardInterrupt
    monkeypatch.setattr(threading.Thread, "start", start)
    watch = m.RunProgress("chunked", 1000, Console(file=io.StringIO(), force_terminal=False))
    with pytest.raises(KeyboardInterrupt):
        watch("simpy", _Rec(1000))
    watch.close()                                 # no RuntimeError
