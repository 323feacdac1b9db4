"""Replay a trace against the real engine in wall-clock time.

``run_trace`` is the real side of ``latsim validate``: requests become visible to
the engine when the wall time since the start reaches their arrival (no network
in between, so ``enqueued`` is the moment they were added, within a loop turn
of ``arrival``); the loop steps the engine whenever it has work and otherwise
sleeps until the next arrival. Every timestamp is on one clock, seconds from
the start, and is taken where the simulator takes it:

- ``scheduled``: the START of the step that first admitted the request;
- ``first_token``/``last_token``/``token_times``: the END of the steps that
  produced them (the sampled ids are on the host at that point).

With ``realtime=False`` idle gaps are skipped: when the engine has nothing to
do, the clock jumps to the next arrival instead of sleeping (busy periods are
still real time). Useful for long, sparse traces.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np

from real_engine.engine import EngineCore


def _sleep_until(clock, t: float) -> None:
    """Sleep until ``clock() >= t``; the last half millisecond is spun for precision."""
    while True:
        left = t - clock()
        if left <= 0:
            return
        if left > 0.001:
            time.sleep(left - 0.0005)


def run_trace(engine: EngineCore, arrivals_s: Sequence[float], prompt_tokens: Sequence[int],
              output_tokens: Sequence[int], priority: Optional[Sequence[int]] = None, *,
              realtime: bool = True, seed: int = 0,
              max_wall_s: Optional[float] = None,
              time_source: Callable[[], float] = time.perf_counter) -> dict:
    """Serve the requests; returns per-request timestamps and the step log.

    Request ``i`` (its index in the inputs) arrives at ``arrivals_s[i]`` with a
    prompt of ``prompt_tokens[i]`` random token ids (seeded) and generates exactly
    ``output_tokens[i]`` tokens. ``max_wall_s`` stops the run (unfinished
    requests are cancelled and reported with ``completed: False``). ``time_source``:
    the seconds the run's clock reads (a test may pass one that only the steps move,
    which makes every recorded time exact).

    Returns ``{"requests": [...], "steps": [...], "policy", "realtime",
    "wall_s", "idle_skipped_s"}``. A request row: ``rid, arrival, enqueued,
    scheduled, first_token, last_token, token_times, prompt_tokens,
    output_tokens, priority, completed, preemptions``. A step row: ``start, end,
    n_decode, prefill_tokens, n_running, n_waiting`` (the last two as the scheduler
    saw them at the start of the step), ``graphed``, ``ctx_sum, ctx_max, chunks``
    (what the cost model prices), ``busy_after``, ``preempted``.
    """
    arr = np.asarray(arrivals_s, dtype=np.float64)
    n = len(arr)
    P = np.asarray(prompt_tokens, dtype=np.int64)
    O = np.asarray(output_tokens, dtype=np.int64)
    pr = np.zeros(n, np.int64) if priority is None else np.asarray(priority, dtype=np.int64)
    if not (len(P) == len(O) == len(pr) == n):
        raise ValueError("arrivals, prompt_tokens, output_tokens and priority differ in length")
    order = np.argsort(arr, kind="stable")
    rng = np.random.default_rng(seed)
    vocab = engine.model.cfg.vocab
    # Prompts drawn before the clock starts, so generating them costs no serving time.
    prompts = [rng.integers(0, vocab, int(p), dtype=np.int64) for p in P]
    if engine.has_work:
        raise ValueError("engine must be idle before a trace starts")

    recs = [{"rid": i, "arrival": float(arr[i]), "enqueued": None, "scheduled": None,
             "first_token": None, "last_token": None, "token_times": [],
             "prompt_tokens": int(P[i]), "output_tokens": int(O[i]), "priority": int(pr[i]),
             "completed": False, "preemptions": 0} for i in range(n)]
    steps = []
    skipped = 0.0
    t0 = time_source()

    def clock() -> float:
        return time_source() - t0 - skipped

    saved_clock = engine.clock
    engine.clock = clock
    nxt = 0
    try:
        while True:
            now = clock()
            if max_wall_s is not None and now > max_wall_s:
                break
            while nxt < n and arr[order[nxt]] <= now:
                i = int(order[nxt])
                recs[i]["enqueued"] = clock()
                engine.add_request(i, prompts[i], int(O[i]), int(pr[i]), now=recs[i]["enqueued"])
                nxt += 1
            if engine.has_work:
                n_run, n_wait = engine.num_running, len(engine.waiting)
                res = engine.step()
                for rid in res.preempted:
                    recs[rid]["preemptions"] += 1
                if res.plan.is_empty:
                    continue
                steps.append({"start": res.t_start, "end": res.t_end, "n_decode": res.n_decode,
                              "prefill_tokens": res.n_prefill_tokens, "n_running": n_run,
                              "n_waiting": n_wait, "graphed": res.graphed,
                              # What the step held, for comparing its time with a cost
                              # model: the decodes' contexts (KV entries attended, the new
                              # token included) and each chunk's (n, prior, completes).
                              "ctx_sum": res.ctx_sum, "ctx_max": res.ctx_max,
                              "chunks": list(res.chunks), "busy_after": engine.has_work,
                              "preempted": list(res.preempted)})
                for rid in res.admitted:
                    if recs[rid]["scheduled"] is None:      # not a readmission
                        recs[rid]["scheduled"] = res.t_start
                for rid in res.tokens:
                    r = recs[rid]
                    r["token_times"].append(res.t_end)
                    if r["first_token"] is None:
                        r["first_token"] = res.t_end
                for rid in res.finished:
                    recs[rid]["last_token"] = res.t_end
                    recs[rid]["completed"] = True
            elif nxt < n:
                t_next = float(arr[order[nxt]])
                if realtime:
                    _sleep_until(clock, t_next)
                else:
                    skipped -= max(0.0, t_next - clock())   # jump the clock forward
            else:
                break
    finally:
        engine.clock = saved_clock
        wall = time_source() - t0
        engine.clear()
    return {"requests": recs, "steps": steps, "policy": getattr(engine.policy, "name", "?"),
            "realtime": realtime, "wall_s": wall, "idle_skipped_s": -skipped}
