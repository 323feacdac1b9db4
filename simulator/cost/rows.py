"""A profile's measured rows as single engine steps, and what they say before any fit.

Every row of a profile (``prefill``, ``decode``, ``mixed``, and the optional
``decode_eager`` and ``prefill_partial``) is one measured step: a decode batch at a
context, at most one prefill chunk (its size, the cached prefix before it, whether it
completes its prompt), eager or replayed from a CUDA graph, and its median and
p10/p90 milliseconds. ``profile_rows`` lays them out as the arrays the physics kernel
(``physics.rows_ms``) prices; ``predict_rows`` prices them.

Timing noise only ever adds time, so a row measured slower than a row that holds at
least its work carries noise, not cost (``dominates``, ``monotone_envelope``): the
fit (``simulator.cost.fit``) takes the capped medians as its targets.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.cost import physics as ph

# The row kinds a profile may hold (its sections).
KINDS = ("prefill", "decode", "mixed", "decode_eager", "prefill_partial")


@dataclass
class Rows:
    """Profile rows as arrays of single-chunk steps (``rows_ms``'s arguments)."""

    kind: np.ndarray
    nd: np.ndarray
    ctx_max: np.ndarray
    ctx_sum: np.ndarray
    chn: np.ndarray
    chp: np.ndarray
    chf: np.ndarray
    has_chunk: np.ndarray
    eager: np.ndarray
    ms: np.ndarray
    p10: np.ndarray
    p90: np.ndarray

    def __len__(self) -> int:
        return len(self.ms)

    def subset(self, m) -> "Rows":
        return Rows(**{k: getattr(self, k)[m] for k in self.__dataclass_fields__})


def profile_rows(profile: dict) -> Rows:
    """Every measured row of a profile as one step (module doc)."""
    cols: dict = {k: [] for k in Rows.__dataclass_fields__}

    def add(kind, nd, ctx, n, prior, final, eager, r):
        cols["kind"].append(kind)
        cols["nd"].append(int(nd))
        cols["ctx_max"].append(int(ctx) if nd else 0)
        cols["ctx_sum"].append(int(nd) * int(ctx) if nd else 0)
        cols["chn"].append(int(n))
        cols["chp"].append(int(prior))
        cols["chf"].append(bool(final))
        cols["has_chunk"].append(n > 0)
        cols["eager"].append(bool(eager))
        ms = float(r["ms"])
        cols["ms"].append(ms)
        cols["p10"].append(float(r.get("p10") or ms))
        cols["p90"].append(float(r.get("p90") or ms))

    for r in profile.get("prefill") or []:
        add("prefill", 0, 0, r["chunk"], r.get("prior", 0), True, False, r)
    for r in profile.get("prefill_partial") or []:
        add("prefill_partial", 0, 0, r["chunk"], r.get("prior", 0), False, False, r)
    for r in profile.get("decode") or []:
        add("decode", r["batch"], r["context"], 0, 0, False, False, r)
    for r in profile.get("decode_eager") or []:
        add("decode_eager", r["batch"], r["context"], 0, 0, False, True, r)
    for r in profile.get("mixed") or []:
        add("mixed", r["batch"], r["context"], r["chunk"], r.get("prior", 0), True, False, r)
    return Rows(kind=np.array(cols["kind"]), nd=np.array(cols["nd"], np.int64),
                ctx_max=np.array(cols["ctx_max"], np.int64),
                ctx_sum=np.array(cols["ctx_sum"], np.int64),
                chn=np.array(cols["chn"], np.int64), chp=np.array(cols["chp"], np.int64),
                chf=np.array(cols["chf"], np.bool_),
                has_chunk=np.array(cols["has_chunk"], np.bool_),
                eager=np.array(cols["eager"], np.bool_), ms=np.array(cols["ms"]),
                p10=np.array(cols["p10"]), p90=np.array(cols["p90"]))


def dominates(rows: Rows, s: int, r: int, graphs: bool) -> bool:
    """Whether step ``s`` holds at least the work of step ``r`` (``monotone_envelope``)."""
    if rows.nd[r] > 0 and (rows.nd[s] < rows.nd[r] or rows.ctx_max[s] < rows.ctx_max[r]):
        return False
    if rows.has_chunk[r] and not (rows.has_chunk[s] and rows.chn[s] >= rows.chn[r]
                                  and rows.chp[s] >= rows.chp[r]
                                  and (rows.chf[s] or not rows.chf[r])):
        return False
    g_s = graphs and rows.nd[s] > 0 and not rows.has_chunk[s] and not rows.eager[s]
    g_r = graphs and rows.nd[r] > 0 and not rows.has_chunk[r] and not rows.eager[r]
    # A graph replay is cheaper than the same step run eagerly.
    return not (g_s and not g_r)


def monotone_envelope(rows: Rows, graphs: bool) -> np.ndarray:
    """Each row's time, capped by every row that holds at least its work (as many
    decodes at at least its context, a chunk at least as large after at least as long
    a prefix, completing if it completes, eager if it is eager): such a step can only
    cost more, and timing noise only ever adds time, so a row measured slower than a
    step that does more carries noise, not cost. Returns the capped times."""
    n = len(rows)
    out = rows.ms.copy()
    for r in range(n):
        for s in range(n):
            if s != r and rows.ms[s] < out[r] and dominates(rows, s, r, graphs):
                out[r] = rows.ms[s]
    return out


def predict_rows(c: np.ndarray, rows: Rows) -> np.ndarray:
    """Modelled milliseconds of every row (no bookkeeping, no scale: as profiled)."""
    out = np.empty(len(rows))
    ph.rows_ms(c, rows.nd, rows.ctx_max, rows.ctx_sum, rows.chn, rows.chp, rows.chf,
               rows.has_chunk, rows.eager, out)
    return out

