"""Whether a recorded run's server let as many requests run at once as the scenario says
(``slot_check``).

A scenario replayed against a run of a server configured otherwise gives a wrong answer
that looks like a cost-model error: a server with 16 slots queues requests that a
64-slot simulation serves at once. The run itself shows its server's limit: how many
requests were running (admitted, last token not yet out) at each moment and how many
had arrived and were still waiting. Running more at once than the scenario allows
means the scenario's limit is too low; a ceiling the run kept hitting while requests
waited, below the scenario's limit, means the server's limit was that ceiling (a limit
the run never reached, or reached only in passing while prefill budget held admissions
back, says nothing).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from simulator.cost.calibration.recorded import RecordedRun
from simulator.model.kv.blocks import blocks_for

# A ceiling counts as the server's limit when, for at least this share of the time
# anyone waited, somebody waited while exactly that many ran. (The published 64-slot
# chunked run: 41% of its waiting steps at 64 running; a run whose most running is not a
# limit reaches it only in passing.)
CEILING_WAIT_SHARE = 0.2
# ... and at least this many separate times.
CEILING_EPISODES = 5


def concurrency(run: RecordedRun) -> Optional[dict]:
    """The run's most requests running at once (``max_running``), and for how long and
    how many separate times requests waited while exactly that many ran
    (``wait_at_max_s``, ``episodes``), against how long anyone waited (``wait_s``).
    ``None`` when the run does not record when its requests were admitted."""
    sched = np.asarray(run.scheduled, float)
    if not np.isfinite(sched).any():
        return None
    end_t = float(np.nanmax(np.concatenate([run.last_token, sched, run.visible])))
    done = np.where(np.isfinite(run.last_token), run.last_token, end_t)
    start = np.where(np.isfinite(sched), sched, end_t)
    vis = np.asarray(run.visible, float)
    # +1 running and -1 waiting at admission, -1 running at the last token, +1 waiting
    # when visible. At equal times the finish goes first (a slot freed and refilled in
    # one step never counts as one more), then the arrival, then the admission.
    n = len(done)
    t = np.concatenate([done, vis, start])
    d_run = np.concatenate([-np.ones(n), np.zeros(n), np.ones(n)])
    d_wait = np.concatenate([np.zeros(n), np.ones(n), -np.ones(n)])
    rank = np.repeat([0, 1, 2], n)
    order = np.lexsort((rank, t))
    t, d_run, d_wait = t[order], d_run[order], d_wait[order]
    running = np.cumsum(d_run)
    waiting = np.cumsum(d_wait)
    dt = np.diff(t, append=t[-1])
    m = int(running.max()) if len(running) else 0
    at_max = (running == m) & (waiting > 0)
    episodes = int(np.sum(at_max[1:] & ~at_max[:-1]) + (at_max[0] if len(at_max) else 0))
    return {"max_running": m, "wait_at_max_s": float(dt[at_max].sum()),
            "wait_s": float(dt[waiting > 0].sum()), "episodes": episodes}


def scenario_limit(engine) -> tuple[int, str]:
    """How many requests the scenario's engine lets run at once, and what sets it:
    ``max_num_seqs``, or fewer contiguous KV slots when the block count and
    ``max_model_len`` say so (paged memory has no fixed count: its limit varies with
    the requests' lengths)."""
    limit, what = int(engine.max_num_seqs), "engine.max_num_seqs"
    kv = engine.kv
    if kv.allocation == "contiguous" and kv.num_blocks and kv.max_model_len:
        # Each request reserves the blocks of max_model_len tokens (``kv.space``).
        slots = kv.num_blocks // blocks_for(kv.max_model_len, kv.block_size)
        if slots < limit:
            limit, what = slots, "engine.kv's contiguous slots"
    return limit, what


def slot_check(run: RecordedRun, engine) -> Optional[str]:
    """A one-line note when the run's server evidently let a different number of
    requests run at once than the scenario's ``engine`` (``scenario_limit``; module
    doc); ``None`` when the run agrees or cannot tell."""
    c = concurrency(run)
    if c is None:
        return None
    limit, what = scenario_limit(engine)
    m = c["max_running"]
    if m > limit:
        return (f"the run had {m} requests running at once, more than the scenario lets run "
                f"({limit}, {what}): set the server's limit")
    if (m < limit and c["episodes"] >= CEILING_EPISODES
            and c["wait_at_max_s"] >= CEILING_WAIT_SHARE * c["wait_s"] > 0):
        share = c["wait_at_max_s"] / c["wait_s"]
        return (f"requests waited while exactly {m} ran ({c['episodes']} times, {share:.0%} "
                f"of the waiting time) and never more ran: the server's limit looks like {m}; "
                f"the scenario lets {limit} run ({what})")
    return None
