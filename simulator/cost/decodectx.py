"""The decode context a step's cost follows, written once for every cost model and
event loop: an engine that pads decode attention to the longest context pays for
that one (batch x longest); paged attention reads every sequence's own keys, so its
cost follows the sum, i.e. the mean context per sequence."""
from __future__ import annotations

from simulator.kernel import kernel


@kernel(inline=True)
def decode_context(padded, nd, ctx_max, ctx_sum):
    """The context a decode step of ``nd`` sequences is priced at: ``ctx_max`` if
    ``padded``, else the mean ``ctx_sum / nd``."""
    if padded:
        return float(ctx_max)
    return ctx_sum / nd


@kernel(inline=True)
def tick_contexts(nd, key_max, key_sum, ticks):
    """``(longest, sum)`` of the contexts of ``nd`` decoders ``ticks`` steps after they
    held contexts of largest ``key_max`` and sum ``key_sum`` (each grows by one token a
    step; the fast bookkeeping's keys, ``model.scheduling.progress.tick_key``)."""
    return key_max + ticks, key_sum + nd * ticks


@kernel(inline=True)
def epoch_context(padded, nd, key_max, key_sum, ticks):
    """``decode_context`` of the decode-only step ``ticks`` steps into an epoch whose
    sequences started it with contexts of largest ``key_max`` and sum ``key_sum``."""
    cmax, csum = tick_contexts(nd, key_max, key_sum, ticks)
    return decode_context(padded, nd, cmax, csum)
