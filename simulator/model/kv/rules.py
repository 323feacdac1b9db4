"""The KV memory rules, each written once as a ``@kernel`` every executor calls: the
SimPy replica and the real engine (through ``space.KVSpace``), and the compiled loop.

- admission: the token slots a request takes when admitted (``paged``: what it must
  prefill; ``contiguous``: ``max_model_len``, or its own prompt + output) and whether it
  can ever run in a cache of this size;
- preemption: whom to preempt (``later_victim``: the lowest class, if the rule says so,
  then the latest arrival, then the highest request id), whether a victim is swapped
  out or recomputed, and what a recompute loses and later wins back from a prefix hit;
- swap-in: whether a swapped request's blocks fit now;
- decode epochs: how many decode steps surely fit in the free blocks;
- speculative decoding: the draft tokens a step verifies (``spec_lookahead``) hold KV
  slots too (``decode_slots``), reserved at admission and before every step.

``max_model_len < 0`` stands for "not set"; a swap space ``< 0`` for "unlimited".
"""
from __future__ import annotations

from simulator.kernel import kernel

# ``never_fits`` answers.
FITS, OVER_MAX_MODEL_LEN, OVER_CAPACITY = 0, 1, 2


@kernel
def ceil_blocks(tokens, block_size):
    """Blocks holding ``tokens`` KV entries."""
    return -(-tokens // block_size)


@kernel
def admission_tokens(paged, prefill_len, max_model_len, prompt, output):
    """Token slots allocated when a request is admitted."""
    if paged:
        return prefill_len
    if max_model_len >= 0:
        return max_model_len
    return prompt + output


@kernel(inline=True)
def growth_tick(held, key, block_size):
    """The decode step (counted from the tick at which a decoder's context is ``key``;
    its context at tick ``t`` is ``key + t``) whose token no longer fits the ``held``
    blocks: the decoder takes one more block there, and again every ``block_size``
    ticks after."""
    return held * block_size - key + 1


@kernel
def spec_lookahead(k, remaining):
    """Draft tokens a sequence verifies in a speculative-decoding step when ``remaining``
    tokens are still to come: ``k``, but none past its last token (``remaining - 1``:
    the step's own token is the one it always emits)."""
    la = remaining - 1
    if la > k:
        la = k
    return la if la > 0 else 0


@kernel
def decode_slots(context, lookahead):
    """Token slots a decode step at ``context`` needs: the context, plus (speculative
    decoding) the ``lookahead`` draft tokens whose KV the verify writes before it is
    known which of them are accepted."""
    return context + lookahead


@kernel
def watermark_blocks(watermark, capacity):
    """Blocks kept free at admission: the ``watermark`` fraction of the cache."""
    return int(watermark * capacity)


@kernel
def largest_tokens(paged, prompt, output, max_model_len):
    """Token slots a request holds at its largest: paged, its prompt and output;
    contiguous, its slot (``admission_tokens``)."""
    if paged:
        return prompt + output
    return admission_tokens(paged, prompt, max_model_len, prompt, output)


@kernel
def never_fits(paged, prompt, output, max_model_len, block_size, capacity, watermark_blocks):
    """``FITS`` if a request can ever run in this cache, else why not."""
    if max_model_len >= 0 and prompt + output > max_model_len:
        return OVER_MAX_MODEL_LEN
    tokens = largest_tokens(paged, prompt, output, max_model_len)
    if ceil_blocks(tokens, block_size) > capacity - watermark_blocks:
        return OVER_CAPACITY
    return FITS


@kernel
def never_fits_each(paged, prompt, output, max_model_len, block_size, capacity,
                    watermark_blocks, why, blocks):
    """``never_fits`` of every request (arrays ``prompt``, ``output``) into ``why``, and
    the blocks each holds at its largest into ``blocks``."""
    for i in range(prompt.shape[0]):
        why[i] = never_fits(paged, prompt[i], output[i], max_model_len, block_size, capacity,
                            watermark_blocks)
        blocks[i] = ceil_blocks(largest_tokens(paged, prompt[i], output[i], max_model_len),
                                block_size)


@kernel
def later_victim(prio_a, enq_a, rid_a, prio_b, enq_b, rid_b, by_priority):
    """True when request a is preempted before request b: the larger priority number
    first (if ``by_priority``), then the later arrival, then the larger id (vLLM's
    FCFS rule is the later arrival: the request that came last loses its memory
    first)."""
    if by_priority and prio_a != prio_b:
        return prio_a > prio_b
    if enq_a != enq_b:
        return enq_a > enq_b
    return rid_a > rid_b


@kernel
def swaps_out(decoding, swap_rule, cpu_used, blocks, cpu_blocks):
    """Whether a victim is swapped out (else recomputed): a decoder, under the swap
    rule, whose blocks fit in the CPU swap space left."""
    return decoding and swap_rule and (cpu_blocks < 0 or cpu_used + blocks <= cpu_blocks)


@kernel
def held_tokens(decoding, prompt, generated, prefilled):
    """KV tokens a running request holds (what the ``kv_tokens`` series counts): a
    decoder its prompt and generated tokens, a prefilling request its computed ones."""
    return prompt + generated if decoding else prefilled


@kernel
def recompute_loss(decoding, prompt, generated, prefilled):
    """KV tokens a preemption by recompute drops, to be prefilled again: all it held
    (``held_tokens``)."""
    return held_tokens(decoding, prompt, generated, prefilled)


@kernel
def recovered_by_hit(cached, dropped):
    """Of the KV a recompute dropped, what a re-admission's prefix hit recovers (it is
    not prefilled again, so not counted as recomputed)."""
    return cached if cached < dropped else dropped


@kernel(inline=True)
def swap_copy(blocks, block_bytes, copy_bps):
    """``(bytes, seconds)`` of copying ``blocks`` KV blocks between GPU and CPU memory (a
    swap out or in), at ``copy_bps`` bytes per second; the step that does it is longer
    by the seconds."""
    nbytes = blocks * block_bytes
    return nbytes, nbytes / copy_bps


@kernel(inline=True)
def policy_blocks(hold, free_blocks, watermark_blocks):
    """Blocks a policy may admit new requests against: the free ones but the watermark;
    none in a step that holds admissions back (it preempted, or requests are still
    swapped out: they come back first, as in vLLM)."""
    return 0 if hold else free_blocks - watermark_blocks


@kernel
def swap_in_fits(tokens, block_size, watermark_blocks, free_blocks):
    """Whether a swapped-out request's blocks fit back now (the watermark kept free)."""
    return ceil_blocks(tokens, block_size) + watermark_blocks <= free_blocks


@kernel
def epoch_room(paged, n_decode, k, block_size, free_blocks):
    """The longest run of decode-only steps, up to ``k``, whose block growth surely
    fits: each decoder takes at most one block per ``block_size`` steps."""
    if not paged:
        return k
    if n_decode * ceil_blocks(k, block_size) <= free_blocks:
        return k
    room = block_size * (free_blocks // n_decode)
    return room if room < k else k


def warm_up() -> None:
    """Compile (or load from numba's cache) every memory rule now (a real engine calls
    this before serving, so its first steps do not pay for it)."""
    ceil_blocks(1, 16)
    admission_tokens(True, 1, -1, 1, 1)
    never_fits(True, 1, 1, -1, 16, 1, 0)
    watermark_blocks(0.0, 1)
    later_victim(0, 0.0, 0, 0, 0.0, 1, True)
    swaps_out(True, True, 0, 1, -1)
    recompute_loss(True, 1, 1, 1)
    recovered_by_hit(0, 0)
    swap_in_fits(1, 16, 0, 1)
    policy_blocks(False, 1, 0)
    swap_copy(1, 1.0, 1.0)
    epoch_room(True, 1, 1, 16, 1)
    spec_lookahead(4, 10)
    decode_slots(1, 0)
