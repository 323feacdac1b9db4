"""Rebuilding a run's steps without a step log: the scenario's own scheduling policy
-- the same ``Policy`` object the simulator and the real engine call -- replayed over
the recorded requests (``replay``).

It plans each step from the state, and the step ends when the recorded tokens it
produced say so. Tokens of different requests made by one step carry that step's end;
when they are client-side arrivals (which only ever add delay) the earliest of them is
taken. A request's recorded admission (``scheduled``) starts the step that admitted
it. A step whose tokens the run did not record (a chunk that does not finish its
prompt, say) lasts what the cost model predicts, and the measured time then spans it
and the next recorded step together (``StepLog`` intervals). ``StepLog.check`` counts
where the recorded times contradict the replay.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from simulator.cost.calibration.recorded import RecordedRun
from simulator.cost.calibration.steplog import StepLog, intervals
from simulator.errors import LatsimError


# Times closer than this (s) are the same time.
EPS = 1e-9


class ReplayError(LatsimError):
    """The replay could not follow the run (a state it does not model)."""

    exit_code = 1


def _price_plan(plan, seqs, step_ms) -> tuple:
    """``step_ms`` of a planned step (before it is applied)."""
    ctxs = [seqs[r].prompt_tokens + seqs[r].generated for r in plan.decode]
    chunks = [(int(k), int(seqs[r].prefilled), seqs[r].completes_with(k))
              for r, k in plan.prefill]
    return step_ms(len(ctxs), max(ctxs) if ctxs else 0, sum(ctxs), chunks)


def replay(run: RecordedRun, scenario, step_ms: Callable, *,
           record_tokens: bool = False, use_anchors: bool = True) -> StepLog:
    """Rebuild ``run``'s steps by running the scenario's scheduling policy over its
    requests (module doc). ``step_ms(nd, ctx_max, ctx_sum, chunks)`` -> ``(core,
    bookkeeping)`` ms prices a step whose end the run did not record (and the host gap
    after every step). ``use_anchors=False`` ignores every recorded time but the
    requests' visibility: the replay is then a plain simulation of the run's traffic
    by ``step_ms``; ``record_tokens`` keeps every token's time (``token_times``:
    ``{rid: [times]}``).

    Between recorded times the steps are priced by the model times a running ratio of
    recorded to modelled time (``warp``); when a recorded time arrives -- a token the
    step made, or an admission, which starts a step -- the untimed steps since the last
    recorded time are stretched or shrunk together to meet it, so that the replay's
    clock (and with it which arrivals each step sees) stays on the run's.

    A request whose KV can never fit is dropped (as the simulator rejects it); a
    step that would need a preemption raises ``ReplayError``: the replay does not
    model memory pressure.

    Long, and one function: one loop whose state (the clock and its warp, the anchors
    still ahead, the queues, the steps recorded so far) every stage of a step reads and
    writes; the stages that stand alone are the nested functions."""
    from simulator.config.engine import engine_policy
    from simulator.deploy.fleet import kv_capacity_blocks
    from simulator.model.kv.blocks import request_blocks
    from simulator.model.kv.space import KVRules, KVSpace
    from simulator.model.scheduling import SchedulerState, Seq

    # A bench run's steps (``latsim serve``'s) hold their bookkeeping: a step ends after
    # it, and the next one starts at once; the refbench engine's gap follows the step.
    book_in = run.kind == "bench"
    eng = scenario.engine
    policy = engine_policy(eng)
    rules = KVRules.from_config(eng.kv)
    if rules.prefix_caching:
        raise ReplayError("the replay does not model prefix caching", source="engine.kv",
                          field="prefix_caching")
    kv = KVSpace(kv_capacity_blocks(scenario), rules)
    n = len(run)
    bs = eng.kv.block_size
    seqs = [Seq(i, float(run.visible[i]), int(run.prompt[i]), int(run.output[i]),
                int(run.priority[i]), request_blocks(int(run.prompt[i]), int(run.output[i]), bs))
            for i in range(n)]
    anchors: dict = {}
    if use_anchors:
        if run.tokens is not None:
            pos = {r: i for i, r in enumerate(run.rid.tolist())}
            for r, k, tt in run.tokens[["rid", "index", "time"]].itertuples(index=False):
                anchors[(pos[int(r)], int(k))] = float(tt)
        else:
            for i in range(n):
                if np.isfinite(run.first_token[i]):
                    anchors[(i, 0)] = float(run.first_token[i])
                if np.isfinite(run.last_token[i]) and run.output[i] > 1:
                    anchors[(i, int(run.output[i]) - 1)] = float(run.last_token[i])
    sched = run.scheduled if use_anchors else np.full(n, np.nan)
    order = sorted(range(n), key=lambda i: (run.visible[i], i))
    order_pos = {r: k for k, r in enumerate(order)}
    # Every recorded admission starts a step. The admission of a request the engine
    # cannot see yet bounds the step in progress: it ends by then.
    sched_by_vis = np.array([sched[i] for i in order])
    next_start = np.minimum.accumulate(
        np.where(np.isfinite(sched_by_vis), sched_by_vis, np.inf)[::-1])[::-1]
    waiting = policy.new_queue()
    decoding: list = []
    prefilling: list = []
    left = n
    nxt = 0
    t = float(run.visible[order[0]]) if n else 0.0
    busy = False
    rec = {k: [] for k in ("start", "end", "sk", "ek", "busy", "nd", "cmax", "csum", "chunks",
                           "seqs", "emitted")}
    conflicts = 0
    spreads = []
    rejected = 0
    warp = 1.0
    ratios: list = []
    # The last recorded time the replay's clock met, and the first step after it.
    t_known, i_known = t, 0

    in_wait: set = set()
    dropped: set = set()
    # Requests from ``hold_pos`` on (in visibility order) stay unseen until ``hold_t``.
    hold_pos, hold_t = n, -math.inf

    def push_visible(now):
        nonlocal nxt, left, rejected
        while nxt < n and run.visible[order[nxt]] <= now + EPS:
            if nxt >= hold_pos and now < hold_t:
                break
            s = seqs[order[nxt]]
            nxt += 1
            if s.rid in dropped:
                continue
            if kv.fits(s) is not None:
                rejected += 1
                left -= 1
                dropped.add(s.rid)
                continue
            waiting.push(s)
            in_wait.add(s.rid)

    def admitted(seq, cached, recovered):
        waiting.remove(seq)
        in_wait.discard(seq.rid)
        prefilling.append(seq)

    def next_visible():
        """When the next request not yet seen becomes visible (a held one: when its
        hold ends)."""
        v = float(run.visible[order[nxt]])
        return max(v, hold_t) if nxt >= hold_pos else v

    def meet(t_rec, t_model):
        """The recorded time ``t_rec`` is where the replay's clock reads ``t_model``: the
        untimed steps since the last recorded time are scaled to meet it, and ``warp``
        learns the ratio. Returns False when it lies before that recorded time."""
        nonlocal warp, t_known, i_known
        span = t_model - t_known
        if t_rec <= t_known + EPS:
            return False
        if span > EPS:
            f = (t_rec - t_known) / span
            for key in ("start", "end"):
                col = rec[key]
                for i in range(i_known, len(col)):
                    col[i] = t_known + (col[i] - t_known) * f
            # The median of the recent stretches' ratios: a stall (the server paused a
            # while) stretches one stretch a lot and must not slow down the next ones.
            ratios.append(warp * f)
            warp = float(np.clip(np.median(ratios[-9:]), 0.25, 4.0))
        t_known, i_known = t_rec, len(rec["start"])
        return True

    idle_turns, last_state = 0, None
    while left > 0:
        push_visible(t)
        # Every turn runs a step or moves the clock or the arrivals on; one that does
        # neither again and again would never end.
        state_now = (len(rec["start"]), nxt, t)
        idle_turns = idle_turns + 1 if state_now == last_state else 0
        last_state = state_now
        if idle_turns > 100:
            raise ReplayError(f"the replay stopped making progress at t={t:.3f} s",
                              source=str(run.folder))
        if not (decoding or prefilling or len(waiting)):
            if nxt >= n:
                break
            t = max(t, next_visible())
            t_known, i_known = t, len(rec["start"])
            busy = False
            continue
        if kv.paged and decoding:
            due = [s for s in decoding if kv.needs_block(s, s.prompt_tokens + s.generated)]
            if len(due) > kv.manager.num_free:
                raise ReplayError(f"at t={t:.3f} s the KV cache is full and the engine would "
                                  f"preempt: the replay does not model preemption (give the "
                                  f"scenario the server's real KV capacity)",
                                  source=str(run.folder), field="engine.kv")
            for s in due:
                kv.grow(s, s.prompt_tokens + s.generated)
        start_known = False
        for _ in range(8):
            state = SchedulerState(t, waiting, decoding, prefilling, kv.policy_free(), kv=kv,
                                   num_running=len(decoding) + len(prefilling))
            plan = policy.schedule(state)
            # The decodes' recorded tokens say when this step ends.
            ends = [anchors[(r, seqs[r].generated)] for r in plan.decode
                    if (r, seqs[r].generated) in anchors]
            if busy and ends and min(ends) > t:
                late = [r for r in plan.admit
                        if np.isfinite(sched[r]) and sched[r] >= min(ends) - 1e-7]
                if late:
                    # Recorded as admitted by a step after this one: the engine had not
                    # seen it at this step's start (an arrival within a hair of a step
                    # boundary). It, and whoever became visible after it, wait until
                    # just before that step.
                    pos = min(order_pos[r] for r in late)
                    for q in order[pos:nxt]:
                        if q in in_wait:
                            waiting.remove(seqs[q])
                            in_wait.discard(q)
                    nxt = pos
                    hold_pos, hold_t = pos, min(sched[r] for r in late) - 1e-7
                    continue
            st = [sched[r] for r in plan.admit if np.isfinite(sched[r])]
            if st:
                # A recorded admission is this step's real start.
                t_adm = float(np.median(st))
                start_known = True
                if abs(t_adm - t) <= 1e-7:
                    break
                if not busy and t_adm > t:
                    t = t_adm                   # the engine idled until then
                    t_known, i_known = t, len(rec["start"])
                elif meet(t_adm, t):
                    t = t_adm
                else:
                    conflicts += 1
                    start_known = False
                    break
                push_visible(t)
                continue
            b = float(next_start[nxt]) if nxt < n else math.inf
            if not busy or not math.isfinite(b):
                break
            # A recorded admission before this step's recorded end is its start (it
            # could not have been the step's before).
            if ends and t + 1e-7 < b < min(ends) and meet(b, t):
                t = b
                push_visible(t)
                continue
            if t <= t_known + EPS or b <= t_known + EPS:
                break
            # The next recorded admission of a request not visible yet. If this step
            # would run past it, either it ends there, or it really starts there (the
            # untimed steps before it ran longer than modelled): whichever bends the
            # modelled times less.
            dur = sum(_price_plan(plan, seqs, step_ms)) * warp / 1e3
            if t + dur <= b:
                break
            bend_end = abs(math.log(max(b - t, 1e-9) / dur))
            bend_start = abs(math.log((b - t_known) / (t - t_known)))
            if bend_start < bend_end and meet(b, t):
                t = b
                push_visible(t)
                continue
            break
        if plan.admit:
            plan = kv.admit_plan(plan, seqs.__getitem__, admitted)
        if plan.is_empty:
            if nxt >= n:
                raise ReplayError(f"at t={t:.3f} s nothing can run and nothing more arrives "
                                  f"({len(waiting)} waiting)", source=str(run.folder))
            t = max(t, next_visible())
            t_known, i_known = t, len(rec["start"])
            busy = False
            continue
        dseqs = [seqs[r] for r in plan.decode]
        ctxs = [s.prompt_tokens + s.generated for s in dseqs]
        chunks = []
        for r, k in plan.prefill:
            s = seqs[r]
            chunks.append((int(k), int(s.prefilled), s.completes_with(k), int(r)))
        emitted = [(s.rid, s.generated) for s in dseqs] + [(c[3], 0) for c in chunks if c[2]]
        nd = len(dseqs)
        cmax = max(ctxs) if ctxs else 0
        csum = sum(ctxs)
        core, book = step_ms(nd, cmax, csum, chunks)
        if book_in:
            core, book = core + book, 0.0
        end = t + core * warp / 1e3
        b = float(next_start[nxt]) if nxt < n else math.inf
        if end > b - book * warp / 1e3:
            end = max(b - book * warp / 1e3, t + 1e-7)
        got = [anchors[e] for e in emitted if e in anchors]
        end_known = False
        rec["start"].append(t)
        rec["end"].append(end)
        if got:
            a = min(got)
            if len(got) > 1:
                spreads.append(max(got) - a)
            # Recorded before this step's modelled start but after the last recorded
            # time: the untimed steps since then ran shorter than modelled (``meet``
            # shrinks them); before that recorded time, it contradicts the replay.
            if meet(a, end):
                end = rec["end"][-1]
                end_known = True
            else:
                conflicts += 1
        rec["sk"].append(start_known)
        rec["ek"].append(end_known)
        rec["busy"].append(busy)
        rec["nd"].append(nd)
        rec["cmax"].append(cmax)
        rec["csum"].append(csum)
        rec["chunks"].append(chunks)
        rec["seqs"].append(nd + len(chunks))
        rec["emitted"].append([r for r, _ in emitted])
        # Apply the step: one token per decode, prefill progress, first tokens, finishes.
        done = []
        for s in dseqs:
            if s.emit():
                done.append(s)
        for r, k in plan.prefill:
            s = seqs[r]
            if s.prefill_chunk(k):
                prefilling.remove(s)
                if s.emit():
                    done.append(s)
                else:
                    decoding.append(s)
        if done:
            gone = {id(s) for s in done}
            decoding = [s for s in decoding if id(s) not in gone]
            for s in done:
                kv.free(s)
                left -= 1
        t = end + book * warp / 1e3
        busy = True
    if not rec["start"]:
        raise ReplayError("the replay ran no step", source=str(run.folder))
    a = {k: np.array(v) for k, v in rec.items() if k not in ("chunks", "emitted")}
    sk, ek, busy_b = a["sk"].astype(bool), a["ek"].astype(bool), a["busy"].astype(bool)
    first, last, fs, meas = intervals(a["start"], a["end"], sk, ek, busy_b)
    gap_ok = np.zeros(len(sk), bool)
    gap_ok[1:] = sk[1:] & ek[:-1] & busy_b[1:]
    gaps = (a["start"][1:] - a["end"][:-1])[gap_ok[1:]] * 1e3
    tokens = None
    if record_tokens:
        tokens = {}
        for e, rids in zip(a["end"], rec["emitted"]):
            for r in rids:
                tokens.setdefault(r, []).append(float(e))
    log = StepLog(name=run.name, start=a["start"], end=a["end"], start_known=sk, end_known=ek,
                  busy_before=busy_b, nd=a["nd"].astype(np.int64),
                  ctx_max=a["cmax"].astype(np.int64), ctx_sum=a["csum"].astype(np.int64),
                  chunks=rec["chunks"], iv_first=first, iv_last=last, iv_from_start=fs,
                  meas_ms=meas, gaps_ms=gaps, gap_seqs=a["seqs"][:-1][gap_ok[1:]],
                  book_in_step=book_in, token_times=tokens)
    spread = np.array(spreads) * 1e3
    log.check = {"source": "replay of the scenario's policy", "steps": len(log),
                 "anchored_steps": int(ek.sum()),
                 "anchors": len(anchors) + int(np.isfinite(sched).sum()),
                 "conflicts": conflicts, "rejected": rejected,
                 "same_step_spread_ms_p50": float(np.median(spread)) if len(spread) else 0.0,
                 "same_step_spread_ms_p90": (float(np.percentile(spread, 90))
                                             if len(spread) else 0.0)}
    return log
