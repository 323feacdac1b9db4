"""A decode epoch: a run of decode-only steps with nothing to decide, simulated at once.

While every running request decodes and nobody waiting could be admitted, each step
repeats the last one's plan; an event loop then prices the whole run as a vector (the
cost model's ``decode_times``) and schedules one event at its end, instead of one per
step. It is exact, not an approximation, because of the rules here, which every event
loop (the SimPy replica, the compiled loop) calls:

- whether the decoders may share one tick at all (``fast_reason``);
- when an epoch may start (``may_start``), and how long it may last
  (``epoch_length``: to the next finish, within the blocks free for growth);
- when its steps end (``step_ends``, summed in order);
- how many of its steps have ended at a time (``steps_ended``: what the router's
  outstanding-token count sees mid-epoch);
- which arrival must end it (``arrival_interrupts``, ``fits_now``: one the step-by-step
  loop would admit at the next step boundary), and where it then stops (``steps_run``:
  the step in progress completes).
"""
from __future__ import annotations

from simulator.cost.table import bisect_left, bisect_right
from simulator.kernel import kernel
from simulator.model.kv.rules import epoch_room

MAX_EPOCH_STEPS = 4096      # the longest epoch (the loops' step-end buffers hold this many)
NO, YES, IF_FITS = 0, 1, 2  # ``arrival_interrupts``


def fast_reason(frame_time: float, min_step_s: float, max_num_seqs: int,
                max_num_batched_tokens: int) -> str | None:
    """Why a replica's decoders cannot share one tick (the fast bookkeeping, and with it
    epochs), or None when they can: every decoder must get its token at every step (a
    batch limit above the token budget can leave some out) and no client may fall
    behind the engine (a frame slower than the fastest step can queue)."""
    if max_num_seqs > max_num_batched_tokens:
        return "max_num_seqs above the token budget"
    if frame_time > min_step_s:
        return "frames slower than the fastest step"
    return None


@kernel
def may_start(n_decode, n_chunks, held_back, copy_s, aging, n_waiting):
    """Whether a step's plan may repeat as an epoch: it decodes and prefills nothing, did
    not hold admissions back (a preemption, swapped requests) nor copy swapped blocks;
    and, with an order that changes with time alone (aging), nobody waits (anyone might
    become admissible at any step)."""
    return (n_decode > 0 and n_chunks == 0 and not held_back and copy_s == 0.0
            and not (aging and n_waiting > 0))


@kernel
def epoch_length(next_finish_tick, ticks, paged, n_decode, block_size, free_blocks):
    """Steps of an epoch: up to the next finish (at most ``MAX_EPOCH_STEPS``), within the
    blocks free for the decoders' growth (``rules.epoch_room``); under 2 runs stepwise."""
    k = next_finish_tick - ticks
    if k > MAX_EPOCH_STEPS:
        k = MAX_EPOCH_STEPS
    return epoch_room(paged, n_decode, k, block_size, free_blocks)


@kernel
def step_ends(start, dts, k, ends):
    """``ends[:k]``: when each of ``k`` consecutive steps of ``dts`` seconds that begin at
    ``start`` ends, summed one after the other (as ``itertools.accumulate`` does)."""
    acc = start
    for j in range(k):
        acc += dts[j]
        ends[j] = acc


@kernel
def steps_ended(ends, k, now):
    """How many of the epoch's ``k`` steps have ended by ``now``."""
    return bisect_right(ends, k, now)


@kernel
def steps_run(ends, k, now):
    """How many steps an epoch interrupted at ``now`` runs: those ended, and the one in
    progress (steps run to completion; the engine then plans again)."""
    j = bisect_left(ends, k, now)
    return (j if j < k - 1 else k - 1) + 1


@kernel(inline=True)
def arrival_interrupts(aging, was_empty, n_running, max_seqs):
    """Whether an arrival ends an epoch in progress: ``YES`` with aging (the queue's
    order changes with time alone, so whether someone waiting becomes admissible is not
    decided at arrivals); ``IF_FITS`` when it joined an empty queue with a sequence slot
    free: the step-by-step loop would admit it at the next step boundary if its
    admission blocks fit what the policy may use (``fits_now``), which the caller then
    prices (only then: with a prefix cache that is a lookup); else ``NO``."""
    if aging:
        return YES
    if was_empty and n_running < max_seqs:
        return IF_FITS
    return NO


@kernel(inline=True)
def fits_now(blocks, free_blocks):
    """An arrival's admission blocks fit the blocks a policy may use now."""
    return blocks <= free_blocks
