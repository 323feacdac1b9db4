"""What a step does to a request, written once for every executor: the SimPy replica,
the real engine and the calibration's replay (through ``Seq.prefill_chunk`` /
``Seq.emit``) and the compiled loop (on its arrays).

- A prefill chunk of ``n`` tokens computes ``n`` more prompt tokens; the chunk that
  completes the prefill (the prompt, or after a preemption by recompute the prompt and
  the tokens generated before it) yields a token in the same step.
- A decode yields one token (a speculative verify, its accepted ones); the request is
  done at its output count.

The fast bookkeeping (decoders on one replica-wide tick; ``loops.simpy.replica``) keeps
a decoder's progress as a key on that tick rather than per request:

- its context is ``key + ticks`` (``tick_key``);
- it has all its tokens at tick ``finish_tick``; taken out earlier (preempted), it has
  generated ``generated_by`` tokens, the last of them at ``last_token_at``.

And what an admission records (``admission_times``): the first one is when the
request was first scheduled; a later one (back after a preemption, recomputed or
swapped in) adds the time it spent preempted.
"""
from __future__ import annotations

from simulator.kernel import kernel


@kernel(inline=True)
def prefill_progress(prefilled, n, prefill_len):
    """``(prefilled + n, whether that completes the prefill)``."""
    done = prefilled + n
    return done, done >= prefill_len


@kernel(inline=True)
def emit_tokens(generated, n, output_tokens):
    """``(generated + n, whether the request then has all its tokens)``."""
    g = generated + n
    return g, g >= output_tokens


@kernel(inline=True)
def tick_key(prompt_tokens, generated, ticks):
    """A decoder joining at ``ticks``: its context is ``key + ticks`` from then on."""
    return prompt_tokens + generated - ticks


@kernel(inline=True)
def finish_tick(ticks, output_tokens, generated):
    """The tick at which a decoder joining at ``ticks`` has all its tokens."""
    return ticks + output_tokens - generated


@kernel(inline=True)
def generated_by(output_tokens, finish, ticks):
    """Tokens a decoder due to finish at tick ``finish`` has generated at ``ticks``."""
    return output_tokens - (finish - ticks)


@kernel(inline=True)
def last_token_at(ticks, join_tick, last_decode_end, joined_last_t):
    """When a decoder's last token left the engine: at the last decode step's end if
    a step has run since it joined, else when its last token before joining did."""
    return last_decode_end if ticks > join_tick else joined_last_t


@kernel(inline=True)
def admission_times(scheduled, preempted_at, now):
    """An admission at ``now`` of a request first scheduled at ``scheduled`` (NaN: never)
    and last preempted at ``preempted_at``: ``(first scheduled, seconds preempted to
    add, whether it is a re-admission)``."""
    if scheduled != scheduled:
        return now, 0.0, False
    return scheduled, now - preempted_at, True
