"""``latsim run``: simulate a scenario, print its latencies, write its result files.

The command function ``run`` (registered by ``simulator.cli.main``), the memory and
time estimate a run prints or refuses on before it starts, the progress watcher
(``RunProgress``) and the one-line reasons a run did not finish. Bad input is a
``LatsimError`` printed on one line (exit 2); requests that never finished exit 1.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from simulator.cli.common import _fail, _policy_list, on_interrupt
from simulator.errors import LatsimError, about

console = Console()
err_console = Console(stderr=True)


RUN_REQUESTS_PER_S = {"compiled": 50_000, "simpy": 3_000}   # rough, for the time estimate


def _loop_guess(loop: str, n: int) -> str:
    """The loop a run of ``n`` requests most likely takes (``simulate`` decides)."""
    from simulator.loops.compiled import worth_compiling
    if loop == "simpy" or (loop == "auto" and not worth_compiling(n)):
        return "simpy"
    return "compiled"


def _check_size(n: float, runs: int, loop: str, yes: bool, source: str) -> None:
    """Refuse (unless ``yes``) a run whose memory estimate exceeds what is available,
    and say how long a long one will take, before it starts."""
    from simulator.errors import available_memory, gib
    from simulator.report.output import run_memory
    which = _loop_guess(loop, int(min(n, 2**62)))
    need = run_memory(n, which)
    have = available_memory()
    if have is not None and need > have and not yes:
        raise LatsimError(f"{n:,.0f} requests need about {gib(need)} of memory, {gib(have)} "
                          "is available: lower workload.num_requests (or the rate or "
                          "duration), or pass --yes to try anyway", source=source,
                          field="workload")
    secs = n * runs / RUN_REQUESTS_PER_S[which]
    if secs >= 10:
        console.print(f"about {_duration(secs)} to simulate {n:,.0f} requests"
                      + (f" x {runs} runs" if runs > 1 else "")
                      + f" ({which} loop), {gib(need)} of memory", highlight=False)


def _duration(secs: float) -> str:
    return f"{secs:,.0f} s" if secs < 120 else f"{secs / 60:,.0f} min"


def compiled_loop_cached() -> bool:
    """Whether the compiled event loop's machine code is cached for these sources (so a
    run loads it in about a second instead of compiling it)."""
    return _cached("*/loop.run-*.nbi")


def kernels_cached() -> bool:
    """Whether the kernels every run calls, on either loop, are cached for these sources:
    the step-cost physics and the KV rules (compiled on first use: on the SimPy path
    about 10 s, while the run sets up, otherwise silently). True when nothing compiles
    (numba off)."""
    from simulator import kernel
    return not kernel.ENABLED or _cached("*/physics.step_ms-*.nbi", "*/rules.*.nbi")


def _cached(*patterns: str) -> bool:
    """Whether the kernel cache holds a file matching each pattern (``compiled_loop_cached``)."""
    from simulator import kernel
    d = getattr(kernel, "CACHE_DIR", None)
    return d is not None and all(any(Path(d).glob(p)) for p in patterns)


def announce_kernels(out: Console) -> None:
    """The compiled path's progress line, for the kernels every run compiles when the
    cache is cold (once per machine and sources)."""
    if not kernels_cached():
        out.print("latsim: compiling the simulator's kernels for this machine and these "
                  "sources (once: about 10-20 s; later runs load them in about a second)",
                  markup=False, highlight=False, soft_wrap=True)


def announce_cold_cache(out: Console, n_requests: Optional[float] = None) -> None:
    """``sweep``'s and ``plan``'s line for a cold kernel cache, said once before their
    runs start (their runs are many and may run in worker processes, so no run's own
    progress says it): the kernels every run compiles (``announce_kernels``) and, when
    not cached either and a run of ``n_requests`` (None: not known ahead) is large
    enough to take it, the compiled event loop."""
    announce_kernels(out)
    from simulator import kernel
    from simulator.loops.compiled import worth_compiling
    large = n_requests is None or worth_compiling(int(min(n_requests, 2**62)))
    if kernel.ENABLED and large and not compiled_loop_cached():
        out.print("latsim: a run large enough for the compiled event loop compiles it first "
                  "(once for this machine and these sources: about 1-2 minutes)",
                  markup=False, highlight=False, soft_wrap=True)


class RunProgress:
    """``simulate``'s progress callback for one run: says when the compiled loop is being
    compiled, and once the run has taken ``DELAY_S`` shows how many requests are settled
    (finished, rejected or cancelled), on stderr: a bar on a terminal, a line every
    ``NOTE_S`` otherwise. ``close`` stops it. ``count``, ``unit`` and ``verb``: what to
    count instead (``latsim plan``: runs simulated; ``n`` None when the total is not
    known ahead)."""

    DELAY_S = 2.0
    NOTE_S = 10.0

    def __init__(self, label: str, n: Optional[int], out: Console, *,
                 count: Optional[Callable[[], int]] = None, unit: str = "requests",
                 verb: str = "settled") -> None:
        self.label, self.n, self.out = label, n, out
        self._count, self.unit, self.verb = count, unit, verb
        self.rec = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._bar = None

    def __call__(self, loop: str, rec) -> None:
        self.rec, self.loop, self.t0 = rec, loop, time.perf_counter()
        self.compiling = loop == "compiled" and not compiled_loop_cached()
        if self.compiling:
            self.out.print("latsim: compiling the event loop for this machine and these "
                           "sources (once: about 1-2 minutes; later runs load it in about "
                           "a second)", markup=False, highlight=False, soft_wrap=True)
        if self._thread is None and (self.n or self._count is not None):
            # Kept only once started: a Ctrl-C between making the thread and starting it
            # left ``close`` joining a thread never started (RuntimeError: exit 70, not
            # 130). A daemon started but not yet kept still stops at ``close``'s event.
            t = threading.Thread(target=self._watch, daemon=True)
            t.start()
            self._thread = t

    def settled(self) -> int:
        """Requests finished, rejected or cancelled so far (estimated from a sample of at
        most ~100,000 requests, so that watching costs the run nothing), or what
        ``count`` counts."""
        if self._count is not None:
            return self._count()
        import numpy as np
        rec = self.rec
        step = max(1, self.n // 100_000)
        done = ~np.isnan(rec.last_delivered[::step]) | rec.rejected[::step] | \
            rec.cancelled[::step]
        return min(self.n, int(done.sum()) * step)

    def _watch(self) -> None:
        last_note = 0.0
        while not self._stop.wait(0.25):
            elapsed = time.perf_counter() - self.t0
            if elapsed < self.DELAY_S:
                continue
            done = self.settled()
            if done and self.compiling:
                self.compiling = False   # the loop runs: compiled (or loaded) by now
            what = ("compiling the event loop" if self.compiling and not done else
                    self.unit)
            if self.out.is_terminal:
                if self._bar is None:
                    from rich.progress import (BarColumn, MofNCompleteColumn, Progress,
                                               TextColumn, TimeElapsedColumn)
                    self._bar = Progress(TextColumn(f"[bold]{escape(self.label)}"), BarColumn(),
                                         MofNCompleteColumn(), TextColumn("{task.description}"),
                                         TimeElapsedColumn(), console=self.out,
                                         transient=True)
                    self._bar.start()
                    self._task = self._bar.add_task(what, total=self.n)
                self._bar.update(self._task, completed=done, description=what)
            elif elapsed - last_note >= self.NOTE_S:
                last_note = elapsed
                self.out.print(f"latsim: {self.label}: " + (
                    f"compiling the event loop, {elapsed:,.0f} s" if what != self.unit else
                    (f"{done:,} of {self.n:,}" if self.n else f"{done:,}") +
                    f" {self.unit} {self.verb}, {elapsed:,.0f} s"),
                    markup=False, highlight=False)

    def close(self) -> None:
        """Stop watching (the run ended or failed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            self._bar.stop()


def run(
    scenario: Path = typer.Argument(..., help="scenario YAML"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="override: a.b=value"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for result files (new or "
                                       "empty; --force to replace the results in it)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="override the scenario's seed"),
    policies: Optional[str] = typer.Option(None, "--policies",
                                           help="comma-separated policies to compare"),
    plots: bool = typer.Option(False, "--plots", help="also write PNG plots to --out"),
    loop: str = typer.Option("auto", "--loop", help="auto: the compiled loop where it covers "
                             "the run and the run is large enough, else SimPy (same "
                             "results; the run line says which and why); compiled: insist "
                             "on it; simpy: SimPy"),
    force: bool = typer.Option(False, "--force", help="--out may hold an earlier run: its "
                               "results are replaced (other files are left alone)"),
    yes: bool = typer.Option(False, "--yes", help="run even when the memory estimate is "
                             "above what this machine has available"),
    table_format: str = typer.Option("auto", "--table-format", help="requests table: csv, "
                                     "parquet, or auto (CSV up to 100,000 requests per run, "
                                     "Parquet above)"),
    chrome_trace: bool = typer.Option(False, "--chrome-trace", help="also write trace.json "
                                      "to --out: each traced request's stages and why it "
                                      "waited at each step, each replica's steps (Chrome "
                                      "trace / Perfetto; runs on SimPy)"),
    trace_requests: Optional[str] = typer.Option(None, "--trace-requests", help="with "
                                                 "--chrome-trace: these request ids only "
                                                 "(comma-separated; default every request)"),
) -> None:
    """Simulate a scenario and print P50/P90/P99 latencies and the E2E breakdown.

    Exit 0 when every request finished (or left as the scenario's clients chose); 1 when
    some never finished (too large for the KV cache, or cut by max_sim_time_s: a line
    says how many and why); 2 on bad input, before anything runs."""
    try:
        _run(scenario, set_, out, seed, policies, plots, loop, force, yes, table_format,
             chrome_trace, trace_requests)
    except LatsimError as e:
        _fail(e)
    except MemoryError:
        _fail(LatsimError("out of memory: the run does not fit in this machine's memory "
                          "(lower its sizes: requests, replicas, clients, batch slots)",
                          source=str(scenario)))


def _run(scenario, set_, out, seed, policies, plots, loop, force, yes, table_format,
         chrome_trace=False, trace_requests=None) -> None:
    """``latsim run``: check everything, simulate each run, write the results at once.

    Long because its order is the command's promise: every check (flags, scenario, KV
    sizes, memory, the out folder) before the first simulated second, then the runs,
    then the files staged and moved into place together; each step is a call."""
    if loop not in ("auto", "compiled", "simpy"):
        raise LatsimError("must be 'auto', 'compiled' or 'simpy'",
                          source="--loop", value=loop, has_value=True)
    if seed is not None and seed < 0:
        raise LatsimError("must be >= 0", source="--seed", value=seed, has_value=True)
    if seed is not None and seed >= 2**63:
        raise LatsimError("must be at most 2^63 - 1", source="--seed", value=seed, has_value=True)
    if plots and out is None:
        raise LatsimError("--plots needs --out (the plots are drawn from the result files)",
                          source="--plots")
    trace_ids = _trace_flags(chrome_trace, trace_requests, out, loop)
    from simulator.config.scenario import load_scenario
    from simulator.cost import load_profile, profile_search_dirs, resolve_profile_path
    from simulator.loops.simulate import Unsupported, kv_capacity_blocks, never_fit, simulate
    from simulator.report.kv import kv_capacity_line
    from simulator.report.metrics import unfinished
    from simulator.report.files import (StagedDir, check_out_dir, file_labels,
                                        table_format as pick_format, write_csv, write_requests,
                                        write_run_facts, writing)
    from simulator.report.output import run_summary, series_table
    from simulator.report.tables import print_run
    from simulator.workload import build_workload

    pick_format(table_format, 0)   # a bad --table-format fails now
    sc, base = load_scenario(scenario, set_)
    if policies:
        sc = sc.model_copy(update={"policies": _policy_list(policies)})
    if out is not None:
        check_out_dir(out, force=force)
        on_interrupt(f"nothing written to {out}")   # the staged files are discarded
    runs = sc.policy_runs()
    s = sc.seed if seed is None else seed
    expected = getattr(sc.workload, "expected_requests", None)
    sized = expected is not None
    if sized:
        _check_size(expected(), len(runs), loop, yes, str(scenario))
    with about(str(scenario)):
        capacity = kv_capacity_blocks(sc)
    # Same traffic for every policy: build the workload once from the seed.
    from simulator.seeds import stream   # numpy: not at the top (``run --help`` needs none)
    wl_rng = stream(s, "workload")       # the stream ``simulate`` draws its traffic from
    with about(str(scenario)):
        wl = build_workload(sc.workload, wl_rng, base)
    n = len(wl)
    if trace_ids and max(trace_ids) >= n:
        raise LatsimError(f"the run has requests 0..{n - 1}", source="--trace-requests",
                          value=max(trace_ids), has_value=True)
    if not sized:
        _check_size(n, len(runs), loop, yes, str(scenario))
    fmt = pick_format(table_format, n)
    if plots and fmt == "parquet":
        raise LatsimError(f"--plots draws from CSV tables; this run of {n:,} requests writes "
                          "Parquet: add --table-format csv", source="--plots")
    _never_fit_lines(runs, wl, never_fit, kv_capacity_blocks, str(scenario))
    profile = None
    if getattr(sc.model.cost, "path", None) is not None:
        profile = load_profile(resolve_profile_path(sc.model.cost.path,
                                                    profile_search_dirs(base)))
    # Said once every input is checked: an error is then the only line on the screen.
    console.print(kv_capacity_line(sc, capacity), highlight=False)
    announce_kernels(err_console)
    staged = StagedDir(out) if out is not None else None
    multi = len(runs) > 1
    outs, why_not = {}, {}
    names = file_labels([label for label, _ in runs]) if multi else {}
    try:
        wall = 0.0
        for label, psc in runs:
            watch = RunProgress(label, n, err_console)
            t0 = time.perf_counter()
            trace = None
            if chrome_trace:
                from simulator.report.decisions import DecisionTrace
                trace = DecisionTrace(trace_ids)
            try:
                res = simulate(psc, s, base_dir=base, workload=wl, profile=profile, loop=loop,
                               progress=watch, trace=trace)
            except Unsupported as e:
                raise LatsimError(f"the {loop} loop cannot run this scenario: {e}",
                                  source="--loop", value=loop, has_value=True) from None
            finally:
                watch.close()
            outs[label] = run_summary(res)
            wall += time.perf_counter() - t0
            if staged is not None:
                ext = "parquet" if fmt == "parquet" else "csv"
                tail = f"-{names[label]}" if multi else ""
                with writing(out):
                    write_requests(res, staged.path / f"requests{tail}.{ext}", fmt)
                    write_csv([series_table(res)], staged.path / f"timeseries{tail}.csv")
                    if trace is not None:
                        from simulator.report.chrome import write_chrome_trace
                        write_chrome_trace(res, trace, staged.path / f"trace{tail}.json")
                    if "session_table" in res.meta:   # kind: sessions, one row per session
                        write_csv([res.meta["session_table"]],
                                  staged.path / f"sessions{tail}.csv")
            why_not[label] = _unfinished_text(unfinished(_settle_frame(res), psc.max_sim_time_s),
                                              psc.max_sim_time_s)
            del res
        first = next(iter(outs.values()))["run"]
        console.print(f"[bold]{escape(sc.name)}[/]: {n} requests, "
                      f"{sc.cluster.replicas} replica(s), "
                      f"KV capacity {first['kv_capacity_tokens']:,} tokens/replica, "
                      f"seed {s}, simulated in {wall:.2f} s "
                      f"({', '.join(sorted({o['run']['event_loop'] for o in outs.values()}))})")
        print_run(console, outs)
        files = []
        if staged is not None:
            with writing(out):
                write_run_facts(staged.path, sc, outs)
                if plots:
                    from simulator.report.plots import plot_run
                    plot_run(staged.path)
            files = staged.commit()
            staged = None
            on_interrupt(f"the results are written to {out}")
        if files:
            console.print(f"wrote {', '.join(str(f) for f in files)}")
    finally:
        if staged is not None:
            staged.discard()
    bad = {k: v for k, v in why_not.items() if v[1]}
    for label, (text, _) in why_not.items():
        if text:
            console.print(f"{'[bold red]not finished[/]' if label in bad else 'not finished'}"
                          f"{f' ({escape(label)})' if multi else ''}: {text}", highlight=False)
    if bad:
        raise typer.Exit(1)


def _trace_flags(chrome_trace: bool, trace_requests, out, loop: str):
    """The request ids ``--trace-requests`` names (None: all), after the checks on the
    trace's options: one line, exit 2, before any work."""
    if trace_requests is not None and not chrome_trace:
        raise LatsimError("needs --chrome-trace", source="--trace-requests")
    if not chrome_trace:
        return None
    if out is None:
        raise LatsimError("--chrome-trace needs --out (trace.json is written there)",
                          source="--chrome-trace")
    if loop == "compiled":
        raise LatsimError("the decision trace is recorded by the SimPy loop: use --loop "
                          "auto or simpy", source="--chrome-trace")
    if trace_requests is None:
        return None
    from simulator.report.chrome import parse_ids
    return parse_ids(trace_requests)


def _settle_frame(res):
    """The columns ``metrics.unfinished`` reads, without building the whole table."""
    import numpy as np
    import pandas as pd
    rec = res.rec
    df = pd.DataFrame({"finished": ~np.isnan(rec.last_delivered), "rejected": rec.rejected,
                       "cancelled": rec.cancelled, "refused": rec.refused,
                       "timed_out": rec.timed_out, "failed": rec.failed}, copy=False)
    if "sessions" in res.meta:   # closed loop: a turn never sent has no arrival
        df["unsent"] = np.isnan(rec.arrival)
    return df


def _unfinished_text(counts: dict, max_sim_time_s) -> tuple[str, bool]:
    """A run's unfinished requests as one sentence, and whether they make it fail (exit 1):
    rejected or cut off did not get what was asked; cancelled by their clients did."""
    parts = []
    if counts["rejected"]:
        parts.append(f"{counts['rejected']:,} rejected: too large for the KV cache, they can "
                     "never run (see the warning before the run)")
    if counts["cut"]:
        parts.append(f"{counts['cut']:,} still queued or running when the clock stopped at "
                     f"max_sim_time_s = {max_sim_time_s:g} s")
    if counts["stuck"]:
        parts.append(f"{counts['stuck']:,} never completed although the run ended")
    if counts.get("unsent"):    # closed-loop sessions: follows from a rejection or the clock
        parts.append(f"{counts['unsent']:,} never sent: their session ended first (a turn "
                     "rejected) or the clock stopped before their turn")
    if counts["cancelled"]:
        parts.append(f"{counts['cancelled']:,} cancelled after their clients disconnected "
                     "(stream.disconnect) or stopped reading (stream.write_timeout_s)")
    # Traffic control did what the scenario asked: not a failure of the run.
    if counts.get("refused"):
        parts.append(f"{counts['refused']:,} refused by admission control "
                     "(cluster.admission; see rejected_by_reason)")
    if counts.get("timed_out"):
        parts.append(f"{counts['timed_out']:,} given up by their clients (client timeouts)")
    if counts.get("failed"):
        parts.append(f"{counts['failed']:,} lost to replica failures (cluster.faults)")
    failed = bool(counts["rejected"] or counts["cut"] or counts["stuck"])
    return "; ".join(parts), failed


def _never_fit_lines(runs, wl, never_fit, capacity_of, source: str) -> None:
    """Before the run: how many requests each run's KV cache can never hold (a warning),
    or an error when it can hold none of them."""
    for label, psc in runs:
        nf = never_fit(psc, wl, capacity_of(psc))
        bad = nf["over_capacity"] + nf["over_max_model_len"]
        if not bad:
            continue
        why = []
        if nf["over_capacity"]:
            why.append(f"{nf['over_capacity']:,} need more KV blocks than the "
                       f"{nf['usable_blocks']:,} a replica can give (the largest needs "
                       f"{nf['largest_blocks']:,})")
        if nf["over_max_model_len"]:
            why.append(f"{nf['over_max_model_len']:,} exceed engine.kv.max_model_len "
                       f"{psc.engine.kv.max_model_len:,}")
        where = f" ({escape(label)})" if len(runs) > 1 else ""
        if bad == len(wl):
            raise LatsimError(f"no request can ever run{where}: the KV cache is too small for "
                              f"all {len(wl):,} ({'; '.join(why)}); raise engine.kv.num_blocks "
                              "or gpu_memory_gb, or shorten the requests", source=source,
                              field="engine.kv")
        console.print(f"[yellow]warning[/]{where}: {bad:,} of {len(wl):,} requests can never "
                      f"run and will be rejected: {'; '.join(why)}", highlight=False)
