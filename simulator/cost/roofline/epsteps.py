"""``ExpertSteps``: the step times of a roofline model with expert parallelism
(``roofline.expert``) and data-parallel attention (``roofline.dataparallel``), a mixin
ahead of ``FittedCostModel`` in ``RooflineCostModel``'s bases.

Every step-time entry point (``step_time``, ``verify_time``, ``decode_times``,
``min_step_s``) prices a step the same way, in ``_priced``: the physics' step of the
slowest data-parallel rank's share (``rank_share``; the step itself at DP 1) on the
rank's constants, plus the named terms of ``step_terms_ms`` (EP's all-to-all,
replaced all-reduce and imbalance over the EP group's padded tokens; at DP > 1 the
attention share and the ranks' sync) times the what-if scale. Without EP
(``expert is None``) every method is ``FittedCostModel``'s, to the bit.
"""
from __future__ import annotations

from typing import Optional

from simulator.cost.roofline.dataparallel import (attention_share_ms, dp_sync_ms,
                                                  rank_count, rank_share)
from simulator.cost.roofline.expert import ep_terms

_EP_KEYS = ("ep_dispatch", "ep_combine", "ep_allreduce_replaced", "ep_imbalance", "ep_total")


class ExpertSteps:
    """EP / DP step pricing (module doc). Needs ``expert`` (an ``ExpertParallel`` or
    None), ``dp``, ``c`` (the rank's constants) and ``scale``."""

    expert = None
    dp = 1

    def step_terms_ms(self, n_decode: int, q: int, chunks) -> dict:
        """The named EP (and DP) terms (ms, before the scale) of a step of ``n_decode``
        sequences running ``q`` query tokens each and ``chunks``; ``added``: their sum,
        what the step gains over the rank's physics."""
        dp = self.dp
        s = rank_share(n_decode, 0, 0, chunks, dp, q)
        if dp <= 1:
            e = ep_terms(self.expert, self.c, s.total)
            e["added"] = e["ep_total"]
            return e
        e = ep_terms(self.expert, self.c, s.padded(dp), rank_tokens=s.tokens)
        e["dp_attention_share"] = attention_share_ms(self.c, chunks, dp)
        e["dp_sync"] = dp_sync_ms(self.c, dp)
        e["added"] = e["ep_total"] + e["dp_attention_share"] + e["dp_sync"]
        return e

    def ep_terms(self, tokens: float) -> dict:
        """``expert.ep_terms`` of a step of ``tokens`` packed tokens (ms; zeros without
        EP); at DP > 1 the tokens split evenly, ``ceil(tokens / dp)`` on the slowest rank."""
        if self.expert is None:
            return {k: 0.0 for k in _EP_KEYS}
        if self.dp <= 1:
            return ep_terms(self.expert, self.c, tokens)
        t = rank_count(tokens, self.dp)
        return ep_terms(self.expert, self.c, self.dp * t, rank_tokens=t)

    def _priced(self, base, n_decode, q, ctx_max, ctx_sum, chunks) -> float:
        """Seconds: ``base`` (the physics' step of the rank's share) plus the terms."""
        s = rank_share(n_decode, ctx_max, ctx_sum, chunks, self.dp, q)
        t = base(s)
        return t + self.step_terms_ms(n_decode, q, chunks)["added"] * self.scale / 1000.0

    def step_time(self, n_decode, decode_ctx_max, decode_ctx_sum, chunks) -> float:
        """``FittedCostModel.step_time``, plus the EP (and DP) terms when ``ep > 1``."""
        sup = super()
        if self.expert is None:
            return sup.step_time(n_decode, decode_ctx_max, decode_ctx_sum, chunks)
        return self._priced(lambda s: sup.step_time(s.n_decode, s.ctx_max, s.ctx_sum, s.chunks),
                            n_decode, 1, decode_ctx_max, decode_ctx_sum, chunks)

    def verify_time(self, n_decode, q, decode_ctx_max, decode_ctx_sum, chunks) -> float:
        """``FittedCostModel.verify_time``, plus the EP (and DP) terms when ``ep > 1``."""
        sup = super()
        if self.expert is None:
            return sup.verify_time(n_decode, q, decode_ctx_max, decode_ctx_sum, chunks)
        return self._priced(
            lambda s: sup.verify_time(s.n_decode, q, s.ctx_max, s.ctx_sum, s.chunks),
            n_decode, q, decode_ctx_max, decode_ctx_sum, chunks)

    def decode_times(self, batch: int, ctx0: float, k: int) -> list:
        """``FittedCostModel.decode_times`` of the slowest rank's ``ceil(batch / dp)``
        sequences (at the same context); with EP every step gains the batch's terms."""
        if self.expert is None:
            return super().decode_times(batch, ctx0, k)
        nd = rank_count(batch, self.dp)
        out = super().decode_times(nd, ctx0, k)
        add = self.step_terms_ms(batch, 1, [])["added"] * self.scale / 1000.0
        return [t + add for t in out]

    def prefill_ms(self, chunk: int, prior: int) -> float:
        """``FittedCostModel.prefill_ms`` (a profile row: no bookkeeping, no scale); at
        DP > 1 the slowest rank's ``ceil(chunk / dp)`` tokens plus the step's terms (the
        rank constants alone would price the whole chunk on one rank). At DP 1 as before."""
        if self.dp <= 1:
            return super().prefill_ms(chunk, prior)
        ch = [(int(chunk), int(prior), True)]
        s = rank_share(0, 0, 0, ch, self.dp)
        return super().prefill_ms(s.chunks[0][0], prior) + self.step_terms_ms(0, 1, ch)["added"]

    def decode_ms(self, batch: int, context: float) -> float:
        """``FittedCostModel.decode_ms`` (a profile row); at DP > 1 the slowest rank's
        ``ceil(batch / dp)`` sequences plus the step's terms. At DP 1 as before."""
        if self.dp <= 1:
            return super().decode_ms(batch, context)
        nd = rank_count(batch, self.dp)
        return super().decode_ms(nd, context) + self.step_terms_ms(batch, 1, [])["added"]

    @property
    def min_step_s(self) -> float:
        """``FittedCostModel.min_step_s``; with EP, the smallest of it and the one-token
        steps with their terms (those can be negative: the replaced all-reduce; a
        one-token chunk's attention share)."""
        m = super().min_step_s
        if self.expert is None:
            return m
        if self.dp <= 1:
            return min(m, m + ep_terms(self.expert, self.c, 1.0)["ep_total"] * self.scale / 1000.0)
        return min(m, self.step_time(1, 1, 1, []), self.step_time(0, 0, 0, [(1, 0, True)]))

    def compiled_reason(self) -> Optional[str]:
        """``FittedCostModel``'s, and EP: its terms are priced in Python only."""
        if self.expert is not None:
            if self.dp > 1:
                return ("expert parallelism with data-parallel attention (model.cost.ep > 1, "
                        "dp > 1)")
            return "expert parallelism (model.cost.ep > 1)"
        return super().compiled_reason()
