"""Nothing lost, nothing left behind: a killed sweep leaves no pool worker running, a
full disk leaves no half-written result (the results are staged and moved into place),
and an interrupted command says on one line what it kept.

The processes here are real (``python -m simulator.cli``) and killed or interrupted
mid-way; every wait is a poll with a generous bound, never a speed assertion."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, make_scenario_dict

LINUX_PROC = Path("/proc/self/stat").exists()


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _latsim(args, **kw) -> subprocess.Popen:
    """``latsim ARGS`` as a child process, with Ctrl-C delivered as a terminal would (a
    child started from a background shell inherits SIGINT ignored: reset it)."""
    return subprocess.Popen([sys.executable, "-m", "simulator.cli", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            **kw)


def _stat(pid: int):
    """(state, parent pid) of a process from /proc, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def _children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = _stat(int(d.name))
            if st is not None and st[1] == pid and st[0] != "Z":
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")   # a zombie has exited


def _poll(cond, timeout: float, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()


def _scenario(tmp_path: Path, n: int = 300) -> Path:
    d = make_scenario_dict()
    d["workload"]["num_requests"] = n
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


# -- 1. a killed sweep takes its workers with it ------------------------------------------

@pytest.mark.skipif(not LINUX_PROC or (os.cpu_count() or 1) < 2,
                    reason="needs /proc and two cores (a pool of two workers)")
def test_sigkill_of_a_sweep_leaves_no_worker_running(tmp_path):
    """``kill -9`` of ``latsim sweep`` cannot shut its pool down: the workers must die
    with it (they would run on, re-parented to 1, each holding a point's memory)."""
    sc = _scenario(tmp_path, 2000)
    proc = _latsim(["sweep", sc, "--grid", "workload.rate=1:40", "--workers", "2",
                    "--out", tmp_path / "out"])
    workers: list[int] = []
    try:
        assert _poll(lambda: len(_children(proc.pid)) >= 2 or proc.poll() is not None, 120), \
            "the sweep's pool never started"
        workers = _children(proc.pid)
        assert len(workers) >= 2 and proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        # Bounded, generous: the kernel kills them at once; 60 s is not a speed claim.
        assert _poll(lambda: not any(_alive(w) for w in workers), 60), \
            f"workers still running after their sweep was killed: {workers}"
    finally:
        for w in workers:       # a failed test leaves nothing running either
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


_POOL_FROM_A_THREAD = """
import sys, threading, time
sys.path[:0] = [{repo!r}]
from simulator.planning.executors import LocalExecutor
box = []
t = threading.Thread(target=lambda: box.append(LocalExecutor(2)))
t.start(); t.join()                       # the thread that made the pool has ended
ex = box[0]
assert [r for _, r in ex.imap_unordered([])] == []
print(" ".join(str(p) for p in ex._pool._processes), flush=True)
ex._pool.submit(int, 1).result()          # the workers still serve
print("served", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not LINUX_PROC or (os.cpu_count() or 1) < 2,
                    reason="needs /proc and two cores (a pool of two workers)")
def test_a_pool_made_off_the_main_thread_serves_then_dies_with_its_parent(tmp_path):
    """The kernel's parent-death signal fires when the *thread* that made a worker ends:
    a pool made by another thread must not be armed with it (its workers would die when
    that thread ends) and falls back to polling the parent id, which still ends the
    workers once the parent is killed."""
    proc = subprocess.Popen([sys.executable, "-c", _POOL_FROM_A_THREAD.format(repo=str(REPO))],
                            stdout=subprocess.PIPE, text=True, env=_env())
    workers: list[int] = []
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2 and proc.stdout.readline().strip() == "served"
        assert all(_alive(w) for w in workers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert _poll(lambda: not any(_alive(w) for w in workers), 60), \
            "workers still running after their parent was killed"
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


# -- 2. a full disk leaves the destination as it was ---------------------------------------

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def cli(argv, capsys) -> tuple[int, str, str]:
    """``latsim ARGV`` in this process: (exit code, stdout, stderr)."""
    from simulator.cli.main import main
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def one_error_line(err: str) -> str:
    """The one error line, the last on stderr (progress lines may come before it)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("latsim: error")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert "Traceback" not in err and "internal error" not in err
    return errors[0]


def _tree(d: Path) -> dict:
    """Every file under ``d`` (hidden ones too) with its bytes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _disk_full_after(monkeypatch, module, attr, nbytes: int = 7):
    """Make ``module.attr(self_or_obj, path, ...)``-style writers hit a full disk: the
    file is created and ``nbytes`` of it written, then ENOSPC (as a real full disk
    leaves it)."""
    def full(*a, **k):
        target = next(x for x in (*a, *k.values()) if isinstance(x, (str, Path)))
        with open(target, "w") as f:
            f.write("partial"[:nbytes])
        raise ENOSPC
    monkeypatch.setattr(module, attr, full)


def _plan_args(tmp_path: Path, out: Path) -> list:
    return ["plan", _scenario(tmp_path, 200), "--slo", "p99_e2el_ms<=100000",
            "--cost-per-gpu-hour", "2", "--search", "replicas=1:2", "--no-headroom",
            "--workers", "1", "--out", out]


@pytest.mark.parametrize("earlier", [False, True], ids=["new folder", "earlier plan"])
def test_a_full_disk_during_plan_leaves_no_half_written_plan(capsys, tmp_path, monkeypatch,
                                                             earlier):
    """ENOSPC while ``plan`` writes evaluations.csv (after plan.json): no half-written
    plan/ (none at all for a new folder; an earlier plan byte for byte as it was, with
    --force), no hidden staging folder left, and one error line naming --out, exit 2."""
    import pandas as pd
    out = tmp_path / "plan"
    if earlier:
        code, _, err = cli(_plan_args(tmp_path, out), capsys)
        assert code == 0, err
        before = _tree(tmp_path)
        assert {"plan/plan.json", "plan/evaluations.csv"} <= set(before)
    _disk_full_after(monkeypatch, pd.DataFrame, "to_csv")
    code, _, err = cli(_plan_args(tmp_path, out) + (["--force"] if earlier else []), capsys)
    line = one_error_line(err)
    assert code == 2 and line == ("latsim: error: --out: cannot write the results: No space "
                                  f"left on device (got {str(out)!r})"), line
    if earlier:
        assert _tree(tmp_path) == before
    else:
        assert not out.exists()
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_full_disk_during_calibrate_leaves_no_empty_profile(capsys, tmp_path, monkeypatch):
    """ENOSPC while ``calibrate`` writes its profile: no 0-byte (or cut-short) profile at
    --out, so the next try needs no --force; one error line, exit 2."""
    import pathlib

    from simulator.report.files import check_out_file
    out = tmp_path / "cal.json"
    real = pathlib.Path.write_text

    def full(self, text, *a, **k):
        """A full disk under tmp_path: the file is made, then nothing fits."""
        if tmp_path in Path(self).absolute().parents:
            open(self, "w").close()
            raise ENOSPC
        return real(self, text, *a, **k)
    monkeypatch.setattr(pathlib.Path, "write_text", full)
    code, _, err = cli(["calibrate", REPO / "scenarios" / "refbench-load50-fifo.yaml", "--run",
                        REPO / "data" / "h200-refbench" / "runs" / "load50-fifo", "--out", out,
                        "--no-sim", "--facts-only"], capsys)
    line = one_error_line(err)
    assert code == 2 and "cannot write the results: No space left on device" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    check_out_file(out)        # the retry is not refused for a file it never wrote


# A sweep's rows written one at a time; ``fail_at``: the csv row write that hits a full
# disk (after writing half of it), counting the header.
def _full_after_rows(monkeypatch, fail_at: int):
    import csv as real_csv
    import types

    import simulator.planning.sweep as sweep_mod
    calls = [0]

    def writer(f, **kw):
        w = real_csv.writer(f, **kw)

        def writerow(row):
            calls[0] += 1
            if calls[0] == fail_at:
                f.write(",".join(map(str, row))[:9])   # half a row, then the disk is full
                f.flush()
                raise ENOSPC
            return w.writerow(row)
        return types.SimpleNamespace(writerow=writerow)
    monkeypatch.setattr(sweep_mod, "csv", types.SimpleNamespace(writer=writer,
                                                                reader=real_csv.reader))
    return calls


SWEEP_GRID = ["--grid", "engine.policy=fifo,chunked", "--grid", "workload.rate=2:6:2"]


@pytest.fixture(scope="module")
def whole_sweep(tmp_path_factory):
    """The table an uninterrupted sweep writes (6 points)."""
    from simulator.cli.main import main
    d = tmp_path_factory.mktemp("whole")
    with pytest.raises(SystemExit) as e:
        main(["sweep", str(_scenario(d, 120)), *SWEEP_GRID, "--workers", "1", "--out",
                str(d / "out")])
    assert e.value.code == 0
    return (d / "out" / "results.csv").read_bytes()


def test_a_full_disk_before_a_sweeps_first_row_leaves_nothing(capsys, tmp_path, monkeypatch):
    """ENOSPC at a new sweep's first row: no folder is left behind (not one holding a
    spec and a header only), one error line saying nothing was kept."""
    _full_after_rows(monkeypatch, fail_at=2)        # the header, then the first row
    out = tmp_path / "out"
    code, _, err = cli(["sweep", _scenario(tmp_path, 120), *SWEEP_GRID, "--workers", "1",
                        "--out", out], capsys)
    line = one_error_line(err)
    assert code == 2 and line.startswith("latsim: error: --out: cannot write the results: "
                                         "No space left on device; nothing was kept"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]


@pytest.mark.parametrize("fail_at", [4, 8], ids=["third row", "sorted table"])
def test_a_full_disk_during_a_sweep_keeps_whole_rows_and_resumes(capsys, tmp_path, monkeypatch,
                                                                 whole_sweep, fail_at):
    """ENOSPC half-way through a row (the third) or while the sorted table is staged (all
    six rows done): results.csv holds only whole rows, sweep.yaml is there to check the
    resume against, nothing hidden is left, the error line says how many rows are kept;
    ``--resume`` then finds them, runs only the rest, and writes the uninterrupted table
    byte for byte."""
    sc, out = _scenario(tmp_path, 120), tmp_path / "out"
    _full_after_rows(monkeypatch, fail_at)
    code, _, err = cli(["sweep", sc, *SWEEP_GRID, "--workers", "1", "--out", out], capsys)
    kept = 2 if fail_at == 4 else 6
    line = one_error_line(err)
    assert code == 2 and (f"cannot write the results: No space left on device; the {kept} "
                          f"finished row(s) are kept in {out / 'results.csv'}") in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.yaml"]
    assert sorted(p.name for p in out.iterdir()) == ["results.csv", "sweep.yaml"]
    text = (out / "results.csv").read_text()
    assert text.endswith("\n") and text.count("\n") == 1 + kept
    monkeypatch.undo()
    code, stdout, err = cli(["sweep", sc, *SWEEP_GRID, "--workers", "1", "--out", out,
                             "--resume"], capsys)
    assert code == 0, err
    assert f"ran {6 - kept} point(s)" in stdout and f"{kept} already done" in stdout
    assert (out / "results.csv").read_bytes() == whole_sweep


# -- 3. an interrupted command says so, and what it kept ------------------------------------

def _interrupt(proc: subprocess.Popen, ready, timeout: float = 300) -> tuple[str, str]:
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) once ``ready()``;
    returns (stdout, stderr)."""
    try:
        assert _poll(lambda: ready() or proc.poll() is not None, timeout), "never got going"
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _last_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and "Traceback" not in err, err
    return lines[-1]


def test_an_interrupted_run_says_so_and_that_nothing_was_written(tmp_path):
    """``latsim run`` interrupted mid-way (its results being staged: the hidden folder
    exists) exits 130 with one line saying so and what happened to --out; nothing is
    left there (typer turned Ctrl-C into a silent exit 130)."""
    out = tmp_path / "out"
    proc = _latsim(["run", _scenario(tmp_path, 10), "--set", "workload.num_requests=100000",
                    "--set", "workload.arrival.rate=50", "--loop", "simpy", "--yes",
                    "--out", out])
    _, err = _interrupt(proc, lambda: any(tmp_path.glob(".out.partial-*")))
    assert proc.returncode == 130, err
    assert _last_line(err) == f"latsim: interrupted; nothing written to {out}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]


@pytest.mark.skipif(not LINUX_PROC or (os.cpu_count() or 1) < 2,
                    reason="needs /proc and two cores (a pool of two workers)")
def test_an_interrupted_sweep_keeps_its_rows_and_stops_its_workers(tmp_path):
    """Ctrl-C of a two-worker sweep after its first rows: exit 130, one line saying where
    the finished points are (and --resume), no worker traceback, no worker left."""
    out = tmp_path / "out"
    proc = _latsim(["sweep", _scenario(tmp_path, 400), "--grid", "workload.rate=1:40",
                    "--workers", "2", "--out", out])
    workers: list[int] = []

    def ready() -> bool:
        if len(workers) < 2:                # the pool may be half made at the first look
            workers[:] = _children(proc.pid)
        p = out / "results.csv"
        return p.exists() and p.read_text().count("\n") >= 2
    try:
        _, err = _interrupt(proc, ready)
        assert proc.returncode == 130, err
        assert _last_line(err) == (f"latsim: interrupted; the finished points are kept in "
                                   f"{out / 'results.csv'}: rerun with --resume to continue")
        assert "KeyboardInterrupt" not in err
        assert _poll(lambda: not any(_alive(w) for w in workers), 60)
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)


def test_an_interrupted_plan_says_nothing_was_written(capsys, tmp_path, monkeypatch):
    """Ctrl-C during ``plan``'s search: exit 130 and the line says --out was not written."""
    from simulator.planning import planner

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(planner.Planner, "search", interrupted)
    out = tmp_path / "plan"
    code, _, err = cli(_plan_args(tmp_path, out), capsys)
    assert code == 130 and _last_line(err) == f"latsim: interrupted; nothing written to {out}"
    assert not out.exists()


def test_a_full_disk_during_trace_convert_leaves_no_cut_trace(capsys, tmp_path, monkeypatch):
    """ENOSPC while ``trace convert`` writes: no cut-short CSV at --out and no hidden
    file; one error line naming --out."""
    import pandas as pd
    _disk_full_after(monkeypatch, pd.DataFrame, "to_csv")
    out = tmp_path / "t.csv"
    code, _, err = cli(["trace", "convert", REPO / "tests" / "data" / "azure_conv_head40.csv",
                        "--out", out], capsys)
    line = one_error_line(err)
    assert code == 2 and line == ("latsim: error: --out: cannot write the results: No space "
                                  f"left on device (got {str(out)!r})"), line
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_after_a_bench_run_leaves_no_half_folder(capsys, tmp_path, monkeypatch):
    """ENOSPC while ``bench`` writes requests.csv (its measurement stands in: no server):
    no --out folder with a cut table and no summary, no hidden folder; one error line."""
    import pandas as pd

    import simulator.wire.benchclient as bc

    async def measured(*a, **k):
        return [], {"url": "http://127.0.0.1:9/v1/completions", "wall_s": 1.0}
    monkeypatch.setattr(bc, "run_bench", measured)
    monkeypatch.setattr(bc, "bench_outputs", lambda recs, wl, facts: (
        pd.DataFrame({"rid": [0, 1]}), {"overall": {}, "run": facts}))
    _disk_full_after(monkeypatch, pd.DataFrame, "to_csv")
    out = tmp_path / "b"
    code, _, err = cli(["bench", "--url", "http://127.0.0.1:9", "--limit", "2", "--out", out],
                       capsys)
    line = one_error_line(err)
    assert code == 2 and line == ("latsim: error: --out: cannot write the results: No space "
                                  f"left on device (got {str(out)!r})"), line
    assert list(tmp_path.iterdir()) == []
