"""``latsim validate``: the same trace through the real engine and through the
simulator, and the error of every latency percentile.

The real side replays the trace against ``EngineCore`` in wall-clock time
(``runner.run_trace``); the simulated side runs the SimPy model with the same
scheduling policy object type and limits, the profile the engine produced as its
cost model, and no wire (network and stream set to zero), since the engine
serves in-process. Both sides produce the simulator's per-request table, so the
metrics are computed by one function (``simulator.report.metrics.summarize``).

This module imports ``simulator``; ``simulator`` never imports it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd

from simulator.config.scenario import validate_scenario
# One rule for real-vs-simulated errors, shared with ``latsim validate --run``.
from simulator.cost.calibration import METRICS, compare  # noqa: F401 (re-exported)
from simulator.report.metrics import add_derived, requests_table, summarize
from simulator.report.recorder import ItlHistogram
from simulator.report.files import json_safe
from simulator.loops.simulate import simulate
from simulator.workload import Workload

ZERO_NET = {"distance_km": 0, "base_rtt_ms": 0, "tls": "none", "gateway_ms": 0,
            "request_overhead_bytes": 0, "bytes_per_prompt_token": 0}
ZERO_STREAM = {"frame_overhead_bytes": 0, "bytes_per_token": 0}


def engine_settings(max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                    chunk_size: Optional[int] = None, aging_s: float = 2.0) -> dict:
    """The engine limits both sides run with (the KV block count comes from the engine)."""
    return {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
            "chunk_size": chunk_size, "aging_s": aging_s}


def policy_kwargs(settings: dict) -> dict:
    """``settings`` as ``make_policy`` keyword arguments (unset ones left to defaults)."""
    return {k: v for k, v in settings.items() if v is not None}


def sim_scenario(policy: str, settings: dict, num_blocks: int, profile_path: str = "<profile>"):
    """A scenario for the simulated side: the engine's limits, no wire."""
    eng = policy_kwargs(settings)
    return validate_scenario({
        "name": "validate", "seed": 0,
        "workload": {"kind": "synthetic", "num_requests": 1},   # replaced by the trace
        "network": dict(ZERO_NET), "stream": dict(ZERO_STREAM),
        "engine": {**eng, "policy": policy, "kv": {"num_blocks": num_blocks}},
        "model": {"cost": {"kind": "profile", "path": profile_path}},
    }, source="validate")


def real_table(run: dict, wl: Workload) -> tuple[pd.DataFrame, ItlHistogram]:
    """The real run as the simulator's per-request table, plus its pooled ITL."""
    reqs = sorted(run["requests"], key=lambda r: r["rid"])
    df = pd.DataFrame({
        "rid": [r["rid"] for r in reqs],
        "priority": wl.priority,
        "class": [wl.class_names[min(p, len(wl.class_names) - 1)] for p in wl.priority],
        "prompt_tokens": wl.prompt_tokens,
        "output_tokens": wl.output_tokens,
        "replica": 0,
        "new_connection": False,
    })
    nan = float("nan")
    for col in ("arrival", "enqueued", "scheduled", "first_token", "last_token"):
        df[col] = [nan if r[col] is None else float(r[col]) for r in reqs]
    # In-process serving: a token is delivered when the step that made it ends.
    df["first_delivered"] = df["first_token"]
    df["last_delivered"] = df["last_token"]
    df["finished"] = [bool(r["completed"]) for r in reqs]
    df["rejected"] = False
    df["preemptions"] = [int(r.get("preemptions", 0)) for r in reqs]
    add_derived(df)
    itl = ItlHistogram()
    for r in reqs:
        if len(r["token_times"]) > 1:
            itl.add_many(np.diff(np.asarray(r["token_times"], dtype=np.float64)))
    return df, itl


class ReplayCost:
    """A cost model that returns the real engine's own step times, in order.

    Step ``i`` lasts from its start to the next step's start while the engine stays
    busy (so host time between steps is included), else to its own end. Simulating
    with it (``mode="step"``: one lookup per step) leaves the scheduling logic as the
    only thing that can differ from the real run: any disagreement is a logic drift
    between the two executors, not a cost-model error."""

    padded = False
    min_step_s = 0.0
    extrapolations = 0

    def __init__(self, steps: list, enqueued: Sequence[float] = ()) -> None:
        enq = np.sort(np.asarray(enqueued, dtype=np.float64))
        d = []
        prev_end, busy = -np.inf, False
        for a, b in zip(steps, steps[1:] + [None]):
            dur = (b["start"] if b is not None and a["busy_after"] else a["end"]) - a["start"]
            if not busy and len(enq):
                # After idle the simulated engine starts at the waking request's enqueue
                # time; the real loop started a little later. Carry that into this step so
                # the next step boundary falls where the real one did.
                i = int(np.searchsorted(enq, prev_end, side="right"))
                if i < len(enq) and enq[i] <= a["start"]:
                    dur += a["start"] - enq[i]
            d.append(dur)
            prev_end, busy = a["end"], a["busy_after"]
        self.durations = d
        self.lookups = 0

    def step_time(self, n_decode, ctx_max, ctx_sum, chunks) -> float:
        if self.lookups >= len(self.durations):
            raise RuntimeError("the simulation took more steps than the real engine")
        self.lookups += 1
        return self.durations[self.lookups - 1]

    def describe(self) -> dict:
        return {"kind": "replay of the real run's step times", "steps": len(self.durations)}


def replay_logic_check(run: dict, wl: Workload, policy: str, settings: dict,
                       num_blocks: int) -> tuple[pd.DataFrame, int]:
    """The simulator driven by the real run's step times and enqueue times: its
    per-request table, and how many steps it took (the real run's count if the two
    executors schedule alike)."""
    reqs = sorted(run["requests"], key=lambda r: r["rid"])
    enq = np.array([r["enqueued"] for r in reqs], dtype=np.float64)
    order = np.argsort(enq, kind="stable")
    wl2 = Workload(arrival_s=enq[order], prompt_tokens=wl.prompt_tokens[order],
                   output_tokens=wl.output_tokens[order], priority=wl.priority[order],
                   class_names=wl.class_names)
    res = simulate(sim_scenario(policy, settings, num_blocks), 0, workload=wl2, mode="step",
                   cost_model=ReplayCost(run["steps"], enq))
    df = requests_table(res)
    inv = np.empty_like(order)
    inv[order] = np.arange(len(order))
    return df.iloc[inv].reset_index(drop=True), res.rec.steps


def step_fit(steps: list, profile: dict) -> dict:
    """Where the error comes from, step by step: each real step's wall time against
    the cost model's prediction for the same step, and the host time between steps.

    ``ratio_*``: median and p10/p90 of measured / predicted per kind of step (decode
    only, prefill only, mixed); ``gap_ms``: mean idle-free time between the end of one
    step and the start of the next while work was queued (loop overhead the profile
    cannot see)."""
    from simulator.cost.profile import ProfileCostModel
    cm = ProfileCostModel(profile)
    kinds: dict[str, list] = {"decode": [], "prefill": [], "mixed": []}
    for st in steps:
        pred = cm.step_time(st["n_decode"], st["ctx_max"], st["ctx_sum"], st["chunks"])
        meas = st["end"] - st["start"]
        kind = ("mixed" if st["n_decode"] and st["chunks"] else
                "decode" if st["n_decode"] else "prefill")
        kinds[kind].append(meas / pred)
    out: dict = {}
    for k, v in kinds.items():
        if v:
            a = np.asarray(v)
            out[k] = {"n": len(a), "median": float(np.median(a)),
                      "p10": float(np.percentile(a, 10)), "p90": float(np.percentile(a, 90))}
    gaps = [b["start"] - a["end"] for a, b in zip(steps, steps[1:])
            if b["n_running"] + b["n_waiting"] > 0 and b["start"] - a["end"] < 0.05]
    out["gap_ms"] = float(np.mean(gaps) * 1000) if gaps else 0.0
    return out


def saturation_throughput(profile: dict, settings: dict, num_blocks: int, wl: Workload,
                          policy: str = "chunked") -> float:
    """Requests/s the simulated engine sustains with every request waiting at t=0: the
    capacity that ``load`` fractions refer to."""
    burst = Workload(arrival_s=np.zeros(len(wl)), prompt_tokens=wl.prompt_tokens,
                     output_tokens=wl.output_tokens, priority=wl.priority,
                     class_names=wl.class_names)
    res = simulate(sim_scenario(policy, settings, num_blocks), 0, workload=burst,
                   profile=profile)
    return len(wl) / float(np.nanmax(res.rec.last_token))


def at_load(wl: Workload, rate: float) -> Workload:
    """The workload with its arrival times rescaled to mean ``rate`` req/s."""
    span = float(wl.arrival_s[-1] - wl.arrival_s[0]) if len(wl) > 1 else 0.0
    cur = (len(wl) - 1) / span if span > 0 else rate
    return Workload(arrival_s=(wl.arrival_s - wl.arrival_s[0]) * (cur / rate),
                    prompt_tokens=wl.prompt_tokens, output_tokens=wl.output_tokens,
                    priority=wl.priority, class_names=wl.class_names, meta=dict(wl.meta))


def validate(engine, profile: dict, wl: Workload, policies: Sequence[str], settings: dict,
             *, realtime: bool = True, warmup_requests: int = 8,
             time_source: Optional[Callable[[], float]] = None,
             log: Callable[[str], None] = lambda s: None) -> dict:
    """Replay ``wl`` through ``engine`` and the simulator for each policy.

    Returns ``{policy: {"real": summary, "sim": summary, "errors": compare(...),
    "real_table": df, "sim_table": df}}``. The engine's model and KV cache are
    reused across policies; the policy object is swapped while the engine is idle.
    ``time_source``: the real runs' clock (``run_trace``; default the wall clock).
    """
    from simulator.model.scheduling import make_policy
    from real_engine.runner import run_trace

    num_blocks = engine.cache.num_blocks
    clock = {} if time_source is None else {"time_source": time_source}
    out = {}
    for name in policies:
        pol = make_policy(name, **policy_kwargs(settings))
        engine.policy = pol
        engine.waiting = pol.new_queue()
        # Warm-up (lazy allocations, graph capture, caches) outside the measured run.
        if warmup_requests:
            k = min(warmup_requests, len(wl))
            run_trace(engine, np.zeros(k), wl.prompt_tokens[:k], wl.output_tokens[:k],
                      realtime=False, **clock)
        log(f"{name}: serving {len(wl)} requests on the real engine ...")
        run = run_trace(engine, wl.arrival_s, wl.prompt_tokens, wl.output_tokens, wl.priority,
                        realtime=realtime, **clock)
        rdf, ritl = real_table(run, wl)
        real = summarize(rdf, ritl)
        res = simulate(sim_scenario(name, settings, num_blocks), 0, workload=wl, profile=profile)
        sdf = requests_table(res)
        sim = summarize(sdf, res.rec.itl)
        rep_df, rep_steps = replay_logic_check(run, wl, name, settings, num_blocks)
        cols = ["scheduled", "first_token", "last_token"]
        gap = np.abs(rep_df[cols].to_numpy() - rdf[cols].to_numpy())
        logic = {"steps_real": len(run["steps"]), "steps_sim": rep_steps,
                 "max_abs_ms": float(np.nanmax(gap) * 1e3),
                 "p99_abs_ms": float(np.nanpercentile(gap, 99) * 1e3),
                 "median_abs_ms": float(np.nanmedian(gap) * 1e3)}
        out[name] = {"real": real, "sim": sim, "errors": compare(real, sim),
                     "step_fit": step_fit(run["steps"], profile), "logic_check": logic,
                     "real_table": rdf, "sim_table": sdf, "real_wall_s": run["wall_s"],
                     "extrapolations": res.extrapolations, "steps_real": len(run["steps"]),
                     "steps_sim": res.rec.steps}
        log(f"{name}: done in {run['wall_s']:.1f} s wall")
    return out


def run_validation(profile: dict, wl: Workload, policies: Sequence[str], *, model: str,
                   device: str = "cpu", settings: Optional[dict] = None,
                   load: Optional[float] = None, realtime: bool = True, seed: int = 0,
                   log: Callable[[str], None] = lambda s: None) -> tuple[dict, dict]:
    """Everything ``latsim validate`` does short of printing and writing: build the
    engine for ``model`` on ``device``, optionally rescale ``wl`` to ``load`` x the
    simulated saturation throughput, and validate each policy. Returns
    ``(results, meta)`` for ``write_validation``."""
    from real_engine.profile import build_engine
    settings = settings or engine_settings()
    engine = build_engine(model, device, seed=seed, max_num_seqs=settings["max_num_seqs"],
                          max_num_batched_tokens=settings["max_num_batched_tokens"])
    nb = engine.cache.num_blocks
    meta = {"model": model, "device": device, "requests": len(wl), "settings": settings,
            "num_blocks": nb, "realtime": realtime}
    if load is not None:
        cap = saturation_throughput(profile, settings, nb, wl)
        wl = at_load(wl, load * cap)
        meta.update(load=load, saturation_rps=cap, rate_rps=load * cap)
        log(f"saturation throughput (simulated) {cap:.2f} req/s; replaying at "
            f"{load:.0%} = {load * cap:.2f} req/s")
    if engine.graphs is not None:
        # Capture every decode bucket now, not on first use inside the measured run.
        ctx = int(wl.prompt_tokens.max() + wl.output_tokens.max())
        engine.graphs.capture_buckets(list(range(1, settings["max_num_seqs"] + 1)), ctx)
    return validate(engine, profile, wl, policies, settings, realtime=realtime, log=log), meta


def write_results(out_dir: Path, results: dict, meta: dict, json_name: str,
                  fields: Optional[tuple] = None) -> list[Path]:
    """``real-<policy>.csv`` and ``sim-<policy>.csv`` (the per-request tables) and a
    JSON summary of each policy's ``fields`` (default: everything but the tables)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    summary = {"meta": meta, "policies": {}}
    for name, r in results.items():
        for side in ("real", "sim"):
            p = out_dir / f"{side}-{name}.csv"
            r[f"{side}_table"].to_csv(p, index=False, float_format="%.9g")
            files.append(p)
        summary["policies"][name] = {k: v for k, v in r.items()
                                     if (k in fields if fields else not k.endswith("_table"))}
    p = out_dir / json_name
    p.write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    files.append(p)
    return files


def write_validation(out_dir: Path, results: dict, meta: dict) -> list[Path]:
    """``real-<policy>.csv``, ``sim-<policy>.csv`` and ``validation.json``."""
    return write_results(out_dir, results, meta, "validation.json",
                         ("real", "sim", "errors", "step_fit", "logic_check", "real_wall_s",
                          "extrapolations", "steps_real", "steps_sim"))


def diagnosis_lines(results: dict) -> list[str]:
    """Per policy: the logic check (simulator fed the real step times) and the step fit
    (real step time / profile prediction), i.e. where the error comes from."""
    lines = []
    for name, r in results.items():
        lc, sf = r["logic_check"], r["step_fit"]
        fit = ", ".join(f"{k} x{v['median']:.2f} (p10 {v['p10']:.2f}, p90 {v['p90']:.2f})"
                        for k, v in sf.items() if isinstance(v, dict))
        lines.append(f"{name}: with the real step times the simulator is off by at most "
                     f"{lc['max_abs_ms']:.2f} ms ({lc['steps_sim']} vs {lc['steps_real']} "
                     f"steps); real/profile step time: {fit}; host gap {sf['gap_ms']:.3f} ms")
    return lines


def error_table(results: dict, title: str = "Simulated vs real", stages: tuple = (),
                digits: int = 2):
    """A rich table: per policy, real and simulated P50/P99 and the relative error of
    every latency metric, then of each E2E stage named in ``stages`` (ms)."""
    from rich.table import Table
    t = Table(title=title, title_justify="left")
    for c in ("policy", "metric", "real P50", "sim P50", "err P50", "real P99", "sim P99",
              "err P99"):
        t.add_column(c, justify="left" if c in ("policy", "metric") else "right")

    def f(v, pct=False):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return f"{v * 100:+.1f}%" if pct else f"{v:.{digits}f}"

    for name, r in results.items():
        rows = [(m, r["errors"]) for m in METRICS] + [(st, r["stages"]) for st in stages]
        for m, src in rows:
            a, b = src[f"median_{m}_ms"], src[f"p99_{m}_ms"]
            t.add_row(name, m.upper(), f(a["real"]), f(a["sim"]), f(a["rel_err"], True),
                      f(b["real"]), f(b["sim"]), f(b["rel_err"], True))
    return t
