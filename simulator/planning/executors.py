"""Where sweep and planner points run: one pure function and two executors.

``run_point((scenario dict, seed, base_dir, profile)) -> row`` simulates one point and
returns a flat row: the overall summary metrics under their ``vllm bench serve``
names, each class's as ``<class>:<metric>`` (when there are several classes), run
facts as ``run.<fact>``, closed-loop sessions' metrics as ``sessions.<metric>``
(``sessions.response_time_law.<field>``), an edge node's figures as ``edge.<path>``
(``report.edge``), replica faults' and degradation's as ``faults.<figure>`` and
``degrade.<figure>`` (``report.faults``), and ``offered_rate`` (requests per second of
arrivals; closed-loop sessions: of the sends the run made). A user error in the point becomes an ``error`` cell instead.

Executors take a batch of such tasks and yield ``(index, row)`` as each finishes:
``LocalExecutor`` (a process pool over the cores, forked once and reused) and
``RayExecutor`` (Ray tasks on a running cluster, ``--address`` or ``RAY_ADDRESS``, or a
local Ray instance; this package is shipped to the workers). Nothing is written to disk here.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Iterator, Optional

from simulator.config.scenario import validate_scenario
from simulator.errors import LatsimError


def load_profile_for(scenario, base_dir: Path, cache: dict) -> Optional[dict]:
    """The profile a scenario's cost model reads, loaded once per path (None if it reads
    none)."""
    from simulator.cost import load_profile, profile_search_dirs, resolve_profile_path
    cost = scenario.model.cost
    if getattr(cost, "path", None) is None:
        return None
    path = resolve_profile_path(cost.path, profile_search_dirs(base_dir))
    if path not in cache:
        cache[path] = load_profile(path)
    return cache[path]


def flatten(summary: dict, offered_rate: float) -> dict:
    """A run's summary as one flat row (see module docstring)."""
    row = dict(summary["overall"])
    classes = summary["per_class"]
    if len(classes) > 1:
        for name, s in classes.items():
            for k, v in s.items():
                if not k.endswith("_itl_ms"):  # ITL is pooled run-wide only
                    row[f"{name}:{k}"] = v
    for k, v in summary["run"].items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                if isinstance(v2, (int, float, str, bool)):
                    row[f"run.{k}.{k2}"] = v2
        else:
            row[f"run.{k}"] = v
    for k, v in summary.get("sessions", {}).items():   # closed-loop sessions
        for k2, v2 in (v.items() if isinstance(v, dict) else [(None, v)]):
            row[f"sessions.{k}" + (f".{k2}" if k2 else "")] = v2
    if "edge" in summary:   # an edge node: the figures its console table shows
        from simulator.report.edge import edge_figures
        row.update(edge_figures(summary["edge"]))
    if "faults" in summary or "degrade" in summary:   # replica faults, degradation
        from simulator.report.faults import fault_figures
        row.update(fault_figures(summary))
    row["offered_rate"] = offered_rate
    return row


def run_point(task: tuple) -> dict:
    """Simulate one (scenario dict, seed, base_dir, profile) and return its flat row.

    Pure: nothing is read but the scenario's own inputs (trace files) and nothing is
    written. A user error in the point (``LatsimError``) becomes an ``error`` cell."""
    data, seed, base_dir, profile = task
    from simulator.report.output import run_outputs
    from simulator.loops.simulate import simulate
    try:
        sc = validate_scenario(data, source="sweep point", base_dir=Path(base_dir))
        res = simulate(sc, seed, base_dir=Path(base_dir), profile=profile)
        _, summary = run_outputs(res)
    except LatsimError as e:
        return {"error": str(e)}
    except MemoryError:
        return {"error": "out of memory: the point does not fit in the worker's memory"}
    arr = res.workload.arrival_s
    if "sessions" in res.workload.meta:     # closed loop: the run set the send times
        import numpy as np
        arr = np.sort(res.rec.arrival[~np.isnan(res.rec.arrival)])
    span = float(arr[-1] - arr[0]) if len(arr) > 1 else 0.0
    return flatten(summary, (len(arr) - 1) / span if span > 0 else float("nan"))


PR_SET_PDEATHSIG = 1   # linux/prctl.h: the signal a process gets when its parent dies


def _die_with(parent: int, by_main_thread: bool) -> None:
    """A pool worker's initializer: the worker dies with the process that made the pool.

    A ``kill -9`` of the sweep or plan cannot shut the pool down, and its workers would
    otherwise run on (parent 1), each holding a point's memory. On Linux the kernel
    sends SIGKILL when the parent dies (``prctl(PR_SET_PDEATHSIG)``; it fires when the
    thread that made the worker ends, so only for workers made by the main thread, whose
    end is the process's); elsewhere a thread polls the parent id. Either way a parent
    already gone is noticed at once. Ctrl-C is the parent's to handle (it stops the
    pool): the worker ignores SIGINT, so that no worker prints its own traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    armed = False
    if by_main_thread and sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:      # died before the signal was armed
        os._exit(1)
    if not armed:
        def watch() -> None:
            """Exit the worker once its parent is gone (it is re-parented)."""
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)
        threading.Thread(target=watch, name="latsim-parent-watch", daemon=True).start()


class LocalExecutor:
    """A process pool over the machine's cores (``workers=1``: in this process; never
    more processes than cores: the points are CPU-bound, and more only cost memory and
    start-up, ``--workers 2000`` forked a thousand processes).

    The pool's processes are forked when it is made, before any progress display or
    spinner thread exists, and serve every batch until ``close``; they die with this
    process however it ends (``_die_with``)."""

    def __init__(self, workers: Optional[int] = None) -> None:
        cores = os.cpu_count() or 1
        self.workers = max(1, min(workers or cores, cores))
        self._pool = None
        self._pending: set = set()
        if self.workers > 1:
            ctx = mp.get_context("fork") if sys.platform.startswith("linux") else None
            main = threading.current_thread() is threading.main_thread()
            self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx,
                                             initializer=_die_with, initargs=(os.getpid(), main))
            self._pool.submit(os.getpid).result()  # start the workers now

    def imap_unordered(self, tasks: list) -> Iterator[tuple[int, dict]]:
        """Submit every task now; iterate ``(task index, row)`` as each finishes."""
        if self._pool is None:
            return ((i, run_point(t)) for i, t in enumerate(tasks))
        futs = {self._pool.submit(run_point, t): i for i, t in enumerate(tasks)}
        self._pending = set(futs)

        def results():
            """Rows in completion order."""
            while self._pending:
                done, self._pending = wait(self._pending, return_when=FIRST_COMPLETED)
                for f in sorted(done, key=futs.get):
                    yield futs[f], f.result()
        return results()

    def close(self, abort: bool = False) -> None:
        """Shut the pool down; ``abort`` cancels queued tasks and stops running ones."""
        if self._pool is None:
            return
        if abort:
            # Stop the workers first and let the pool fail what is left: cancelling
            # queued futures before the workers die makes Python 3.11's pool thread raise
            # InvalidStateError on them (a traceback after Ctrl-C's one line).
            for p in list((getattr(self._pool, "_processes", None) or {}).values()):
                p.terminate()
            self._pool.shutdown(wait=True)
        else:
            for f in self._pending:
                f.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None


class RayExecutor:
    """``run_point`` as Ray tasks: on the cluster at ``address`` (or ``RAY_ADDRESS``), on
    the Ray instance this process already runs, or on a local one it starts."""

    def __init__(self, workers: Optional[int] = None, address: Optional[str] = None) -> None:
        try:
            import ray
        except ImportError:
            raise LatsimError("--executor ray needs Ray: pip install 'latsim[ray]'",
                              source="--executor") from None
        self.ray = ray
        self._owns = not ray.is_initialized()
        if self._owns:
            address = address or os.environ.get("RAY_ADDRESS")
            # A local instance: no dashboard, ``workers`` CPUs. Either way the whole
            # ``simulator`` package is shipped, so the workers run the driver's exact code.
            kw = {} if address else {"include_dashboard": False, "log_to_driver": False,
                                     **({"num_cpus": workers} if workers else {})}
            try:
                ray.init(address=address,
                         runtime_env={"py_modules": [str(Path(__file__).resolve().parents[1])]},
                         **kw)
            except (ConnectionError, ValueError, RuntimeError, TimeoutError) as e:
                where = f"the Ray cluster at {address}" if address else "Ray"
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise LatsimError(f"cannot start or reach {where}: {msg}",
                                  source="--executor") from None
        self._remote = ray.remote(num_cpus=1, max_retries=0)(run_point)
        self.workers = max(1, workers or int(ray.cluster_resources().get("CPU", 1)))
        self._pending: list = []

    def imap_unordered(self, tasks: list) -> Iterator[tuple[int, dict]]:
        """Submit every task now; iterate ``(task index, row)`` as each finishes."""
        refs = {self._remote.remote(t): i for i, t in enumerate(tasks)}
        self._pending = list(refs)

        def results():
            """Rows in completion order."""
            while self._pending:
                done, self._pending = self.ray.wait(self._pending, num_returns=1)
                for r in done:
                    yield refs[r], self.ray.get(r)
        return results()

    def close(self, abort: bool = False) -> None:
        """Cancel what is left; shut Ray down if this executor started it."""
        for r in self._pending:
            self.ray.cancel(r, force=True)
        self._pending = []
        if self._owns:
            self.ray.shutdown()


def make_executor(kind: str, workers: Optional[int] = None, address: Optional[str] = None):
    """``local`` or ``ray`` (``address``: a running Ray cluster's, for ``ray`` only)."""
    if address is not None and kind != "ray":
        raise LatsimError("--address is for --executor ray", source="--address",
                          value=address, has_value=True)
    if kind == "local":
        return LocalExecutor(workers)
    if kind == "ray":
        return RayExecutor(workers, address)
    raise LatsimError("unknown executor; known: local, ray", source="--executor",
                      value=kind, has_value=True)
