"""The ``work`` queue-wait estimate: the work ahead of a newcomer, projected on the
replica's own step costs (``cluster.admission.wait_estimate: {kind: work}``).

The ``seed`` estimate (waiting prompt tokens / chunk x mean step) ignores the running
batch: on a replica whose ``max_num_seqs`` slots are full, a newcomer waits for
running requests to *finish decoding*, which that estimate never sees (its median is
about 10x low on the admission scenario). This one projects the engine forward in
steps, as the fill rule of a continuous batcher runs it:

- each running request holds a slot until its last token: a decoding one for its
  remaining output tokens, one still prefilling for the steps its remaining prompt
  takes, then its output; each request ahead in the queue, once admitted, for its
  prompt's steps and its output (``output_tokens``: what the server knows as the
  request's ``max_tokens``, as ``vllm bench serve`` sends with ``ignore_eos``; with a
  real end of sequence an upper bound);
- a step's token budget first serves the decodes, the rest the prefill backlog, and a
  request is admitted once the prefill admitted before it leaves budget over (at most
  one step later) and a slot is free (the earliest finish frees one), in queue order;
- the newcomer's wait is the step at which it is admitted, times the replica's step
  time for its saturated batch (``StepCost.step_time``: the decodes of the slots that
  will be full with the budget's remaining prefill), plus half a step in progress.

It reads the replica and prices with the cost model, changing nothing: the cost
model's look-up tallies are restored, and a model with noise is priced by its
noise-free rows (``prefill_ms + decode_ms``), since drawing noise would move the run
(``_step_s``).
KV memory and preemptions are not projected (a KV-bound replica waits longer than
this says). Tested within 20% of the median wait on the shipped traffic scenarios.
"""
from __future__ import annotations

import heapq
import math

__all__ = ["work_wait"]


def _step_s(rep, n_dec: int, ctx: int, ctx_max: int, chunk: int, prior: int) -> float:
    """Seconds of a step of ``n_dec`` decodes at mean context ``ctx`` (the longest
    ``ctx_max``) and a ``chunk`` of prefill after ``prior`` tokens on ``rep``'s cost
    model, leaving its tallies and noise stream as they were: a built-in model's pure
    pricing (``compiled_kernels``: a profile's tables or the physics), its noise-free
    rows (``prefill_ms + decode_ms``) for one with noise, else (a model that must not
    be asked out of turn, e.g. a replay) the replica's mean step so far."""
    cost = rep.cost
    has_tally = hasattr(cost, "lookups") and hasattr(cost, "extrapolations")
    tally = (cost.lookups, cost.extrapolations) if has_tally else None
    try:
        noisy = getattr(cost, "_rng", None) is not None or getattr(cost, "noise", None)
        if not noisy and getattr(type(cost), "compiled_kernels", None) is not None:
            chunks = [(chunk, prior, True)] if chunk > 0 else []
            return float(cost.step_time(n_dec, ctx_max, n_dec * ctx, chunks))
        if hasattr(cost, "decode_ms") and hasattr(cost, "prefill_ms"):
            ms = cost.decode_ms(n_dec, float(ctx)) if n_dec else 0.0
            return (ms + (cost.prefill_ms(chunk, prior) if chunk > 0 else 0.0)) / 1000.0
        return rep.busy_s / rep.steps_run if rep.steps_run else 0.0
    finally:
        if tally is not None:
            cost.lookups, cost.extrapolations = tally


def _decode_left(rep, s) -> int:
    """Output tokens ``s`` (decoding on ``rep``) has still to make."""
    if rep.fast:    # fast bookkeeping: decoders' counts live in ticks (``apply``)
        return max(int(s.finish_tick) - int(rep.ticks), 0)
    return max(int(s.output_tokens) - int(s.generated), 0)


def work_wait(rep, waiting, now: float = 0.0, patience: float = math.inf) -> float:
    """The projected wait (s) of a request joining ``rep`` at ``now`` behind ``waiting``
    (in queue order); ``patience``: how long a client waits for its first byte before
    it leaves (see module doc). Two passes: the step time of the saturated batch, then
    the projection in steps."""
    running = len(rep.decoding) + len(rep.prefilling)
    if not running and not waiting:
        return 0.0
    budget, _chunk, slots = rep.policy.fill_limits()
    n_dec = min(slots, running + len(waiting) + 1)
    cap = max(budget - n_dec, 1)                 # prefill tokens a saturated step takes
    step_s = _batch_step_s(rep, waiting, n_dec, cap)
    finish: list[int] = []                       # step at which each slot frees
    backlog = 0
    for s in rep.decoding:
        finish.append(_decode_left(rep, s))
    for s in rep.prefilling:
        backlog += int(s.remaining_prefill)
        finish.append(math.ceil(backlog / cap) + int(s.output_tokens) - int(s.generated))
    heapq.heapify(finish)
    step = 0
    for s in [*waiting, None]:
        # Budget: admitted once the prefill before it leaves some of a step's budget.
        at = max(step, backlog // cap)
        if len(finish) >= slots:                 # a slot must free first
            at = max(at, finish[0])
        if s is not None and now - s.enqueued + at * step_s > patience:
            continue                             # its client will have left by then
        if len(finish) >= slots:
            heapq.heappop(finish)
        step = at
        if s is None:
            break
        backlog += int(s.remaining_prefill)
        heapq.heappush(finish, max(math.ceil(backlog / cap), step + 1)
                       + int(s.output_tokens) - int(s.generated))
    return (step + 0.5) * step_s


def _batch_step_s(rep, waiting, n_dec: int, cap: int) -> float:
    """The step time of the batch the projection runs: ``n_dec`` decodes at the mean
    and longest context of the running and waiting requests (each waiting one at its
    prompt plus half its output), and a ``cap`` chunk of prefill (when any is left)
    whose prior context is, on average, half the prompts' it serves (weighted by
    tokens: sum p^2 / 2 sum p) less half a chunk."""
    ctx_sum = ctx_max = n = sp = sp2 = 0
    for s in rep.decoding:
        c = int(s.prompt_tokens) + int(s.output_tokens) - _decode_left(rep, s)
        ctx_sum, ctx_max, n = ctx_sum + c, max(ctx_max, c), n + 1
    for group in (rep.prefilling, waiting):
        for s in group:
            p = int(s.prompt_tokens)
            c = p + int(s.output_tokens) // 2
            ctx_sum, ctx_max, n = ctx_sum + c, max(ctx_max, c), n + 1
            sp, sp2 = sp + p, sp2 + p * p
    ctx = ctx_sum // n if n else 0
    prior = max(int(sp2 / (2 * sp) - cap / 2), 0) if sp else 0
    return _step_s(rep, n_dec, ctx, ctx_max, cap if sp else 0, prior)
