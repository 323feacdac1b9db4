"""GPU utilisation of a replica over time: busy fraction, tokens/s and MFU.

A ``UtilTracker`` rides on one replica slot (``Replica.util``) and accumulates what its
engine did: seconds spent in steps (busy), prompt tokens prefilled, tokens decoded and,
where the cost model is the physics model (``simulator.cost.physics``: ``fitted`` and
``roofline``), the model FLOPs of those steps. It snapshots the running totals
whenever the replica samples its time series, so windows of any length can be read
back as differences.

Model FLOPs (the PaLM paper's MFU, Chowdhery et al. 2022, appendix B, for inference):
``2 x P_linear`` per token through the linear layers, ``2 x vocab x d_model`` per
sampled row (the LM head), and ``4 x layers x heads x head_dim`` per query-key pair of
attention (QK^T and PV): a prefill chunk of ``n`` tokens after ``p`` cached ones has
``n (n + 1) / 2 + n p`` pairs, a decode at context ``c`` has ``c``. MFU = model FLOPs
/ (peak x GPUs x time), with the cost model's peak per GPU (``peak_tflops``: the
datasheet's for ``roofline``, the fitted profile's for ``fitted``) and its ``tp x pp``
GPUs. A table profile (``kind: profile``) knows no FLOPs: MFU is left out.

Busy is the time the engine spends in steps (swap copies included); the rest is idle
(nothing to run). Throughout, a step counts at its end.
"""
from __future__ import annotations

from array import array

import numpy as np

FIELDS = ("time", "busy_s", "prefill_tokens", "decode_tokens", "flops")


class UtilTracker:
    """Running totals of one replica slot (see module doc)."""

    def __init__(self, cost) -> None:
        from simulator.cost import physics as ph
        c = getattr(cost, "c", None)
        self.known = c is not None
        if self.known:
            self.lin = 2.0 * float(c[ph.C_PARAMS_LINEAR])
            self.head = 2.0 * float(c[ph.C_VOCAB]) * float(c[ph.C_DMODEL])
            self.pair = 4.0 * float(c[ph.C_LAYERS]) * float(c[ph.C_HEADS]) * float(c[ph.C_HEAD_DIM])
            gpus = max(1.0, float(c[ph.C_TP])) * max(1.0, float(c[ph.C_PP]))
            self.peak = float(c[ph.C_PEAK_TFLOPS]) * 1e12 * gpus
        self.busy = 0.0
        self.prefill = 0
        self.decode = 0
        self.flops = 0.0
        self.samples = tuple(array("d") for _ in FIELDS)

    def step(self, dt: float, nd: int, ctx_sum: int, chunks) -> None:
        """One step of ``dt`` seconds: ``nd`` decodes over contexts summing to
        ``ctx_sum``, and prefill ``chunks`` of ``(tokens, prior, completes)``."""
        self.busy += dt
        self.decode += nd
        n_pre = 0
        for n, _prior, _last in chunks:
            n_pre += n
        self.prefill += n_pre
        if self.known:
            rows = nd + sum(1 for *_x, last in chunks if last)
            pairs = float(ctx_sum)
            for n, prior, _last in chunks:
                pairs += n * (n + 1) / 2.0 + n * prior
            self.flops += self.lin * (nd + n_pre) + self.head * rows + self.pair * pairs

    def decode_run(self, dt: float, m: int, nd: int, ctx_sum0: int) -> None:
        """``m`` decode-only steps of ``nd`` requests taking ``dt`` seconds in all, the
        first over contexts summing to ``ctx_sum0`` (each later one ``nd`` more)."""
        self.busy += dt
        self.decode += m * nd
        if self.known:
            pairs = m * float(ctx_sum0) + nd * m * (m - 1) / 2.0
            self.flops += (self.lin + self.head) * m * nd + self.pair * pairs

    def idle_copy(self, dt: float) -> None:
        """A step spent only copying KV to or from CPU memory: busy, no tokens."""
        self.busy += dt

    def sample(self, t: float) -> None:
        for arr, v in zip(self.samples, (t, self.busy, self.prefill, self.decode, self.flops)):
            arr.append(v)


def window_columns(tracker: UtilTracker, times, window: float) -> dict:
    """Per sample time in ``times``: over the trailing ``window`` (shorter at the start
    of the run), the busy fraction, prefill, decode and total tokens/s and (when FLOPs
    are known) MFU. Totals between samples are interpolated linearly."""
    t = np.asarray(times, dtype=np.float64)
    s = [np.concatenate(([0.0], np.frombuffer(a, dtype=np.float64))) for a in tracker.samples]
    ts = s[0]
    out = {}
    if len(ts) < 2 or not len(t):
        return {k: np.full(len(t), np.nan) for k in ("busy_frac", "tokens_per_s",
                                                     "prefill_tokens_per_s",
                                                     "decode_tokens_per_s", "mfu")}
    lo = np.maximum(t - window, 0.0)
    span = t - lo
    with np.errstate(invalid="ignore", divide="ignore"):
        def rate(col: np.ndarray) -> np.ndarray:
            return (np.interp(t, ts, col) - np.interp(lo, ts, col)) / span
        out["busy_frac"] = np.clip(rate(s[1]), 0.0, 1.0)
        pre, dec = rate(s[2]), rate(s[3])
        out["prefill_tokens_per_s"] = pre
        out["decode_tokens_per_s"] = dec
        out["tokens_per_s"] = pre + dec
        out["mfu"] = rate(s[4]) / tracker.peak if tracker.known else np.full(len(t), np.nan)
    return out
