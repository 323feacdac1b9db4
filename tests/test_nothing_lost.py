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
            f"workers still running after their sweep was killed: {[w for w in workers if _alive(w)]}"
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
