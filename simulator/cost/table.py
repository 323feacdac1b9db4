"""Interpolation in a measured profile's tables, as kernels (``kind: profile``).

A table ``y(a, b)`` is a piecewise-linear curve in ``b`` for each measured level ``a``,
blended linearly across levels; every curve extrapolates linearly above its last knot
(the lookup is then flagged) and holds its first value below its first knot (less work
than the smallest measured step cannot cost more: engines sit on a fixed floor there).
A table arrives as four arrays ``(A, X, Y, N)``: sorted levels, and per level the knots
``X[l, :N[l]]`` and values ``Y[l, :N[l]]`` (``pack_table``). The profile model's three
tables (prefill, decode, eager decode) travel as one set of such arrays, stacked, with
``TO[t]:TO[t + 1]`` the levels of table ``t`` (``pack_tables``): a kernel's arguments are
then a few arrays, which numba passes far more cheaply than tuples of them.

``step_ms`` is the profile model's step time (see ``profile``): the parts' times summed
(the decode part from the eager-decode table when the step also prefills), less
``alpha * floor`` for every part after the first, floored at the cheapest measured
step, plus host bookkeeping (``physics.book_ms``: per step and per sequence), times the
scale. ``ProfileCostModel`` and the compiled
event loop both call it; ``CF`` holds the constants (indices ``C_*``) and ``CL`` counts
lookups and extrapolations.
"""
from __future__ import annotations

import numpy as np

from simulator.cost.decodectx import decode_context
from simulator.cost.physics import book_ms
from simulator.kernel import kernel

# CF: the profile model's constants.
C_BK, C_LMHEAD, C_ALPHA, C_FLOOR, C_MIN, C_SCALE, C_PADDED, C_BK_SEQ, C_NCONST = range(9)


@kernel
def bisect_right(x, n, q):
    """First index of ``x[:n]`` holding a value above ``q``."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if q < x[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


@kernel
def bisect_left(x, n, q):
    """First index of ``x[:n]`` holding a value not below ``q``."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if x[mid] < q:
            lo = mid + 1
        else:
            hi = mid
    return lo


@kernel
def bracket(x, n, q):
    """For ``q > x[0]``: (i, above) with ``x[i-1] <= q < x[i]`` inside ``x[:n]``, or the
    last segment (``i = n - 1``) at or above the top, flagged when strictly above."""
    if q >= x[n - 1]:
        return n - 1, q > x[n - 1]
    return bisect_right(x, n, q), False


@kernel
def curve(X, Y, n, q):
    """One level's curve at ``q``: (value, above the measured range)."""
    if q <= X[0]:
        return Y[0], False
    if n == 1:
        return Y[0], q != X[0]
    i, out = bracket(X, n, q)
    x0, x1, y0, y1 = X[i - 1], X[i], Y[i - 1], Y[i]
    return y0 + (y1 - y0) * (q - x0) / (x1 - x0), out


@kernel
def table_at(A, X, Y, N, lo, hi, qa, qb):
    """The table held in levels ``lo:hi`` of the stacked arrays, at level ``qa``, point
    ``qb``: (value, above the measured range)."""
    L = hi - lo
    if L == 1 or qa <= A[lo]:
        return curve(X[lo], Y[lo], N[lo], qb)
    j = lo + bisect_left(A[lo:hi], L, qa)
    if j < hi and A[j] == qa:
        return curve(X[j], Y[j], N[j], qb)   # a measured level: no blending
    i, out = bracket(A[lo:hi], L, qa)
    i += lo
    y0, o0 = curve(X[i - 1], Y[i - 1], N[i - 1], qb)
    y1, o1 = curve(X[i], Y[i], N[i], qb)
    a0, a1 = A[i - 1], A[i]
    return y0 + (y1 - y0) * (qa - a0) / (a1 - a0), out or o0 or o1


@kernel
def table(A, X, Y, N, qa, qb):
    """A table at level ``qa``, point ``qb``: (value, above the measured range)."""
    return table_at(A, X, Y, N, 0, A.shape[0], qa, qb)


# The stacked tables' numbers.
T_PREFILL, T_DECODE, T_EAGER = 0, 1, 2


@kernel
def decode_ctx(CF, nd, ctx_max, ctx_sum):
    """The context a decode lookup reads: the longest one if the engine pads decode
    attention to it, else the mean (paged attention's cost follows the sum)."""
    return decode_context(CF[C_PADDED] != 0.0, nd, ctx_max, ctx_sum)


@kernel
def decode_lookup(A, X, Y, N, TO, G, YB, BEY, t, nd, ctx):
    """A decode table (``t``) at ``nd`` sequences, context ``ctx``: (value, above the
    measured range). The plain decode table is read through its curves blended at each
    batch size (``blend``: the same values, one curve instead of two and a blend)."""
    if t == T_DECODE and nd < YB.shape[0]:
        y, out = curve(G, YB[nd], G.shape[0], ctx)
        return y, out or BEY[nd]
    return table_at(A, X, Y, N, TO[t], TO[t + 1], float(nd), ctx)


@kernel
def settle(CF, ms, parts):
    """A step's parts summed into its time: less ``alpha * floor`` for every part after
    the first (the fixed host cost is paid once), at least the cheapest measured step,
    times the scale."""
    if parts > 1:
        ms -= CF[C_ALPHA] * CF[C_FLOOR] * float(parts - 1)
    if ms < CF[C_MIN]:
        ms = CF[C_MIN]
    return ms * CF[C_SCALE]


@kernel
def blend(A, X, Y, N, TO, G, YB, BEY):
    """The decode table's curves blended at each batch size ``b < len(YB)`` on the grid
    ``G`` (every level's knots): ``YB[b]``, and whether ``b`` lies beyond the measured
    batches (``BEY[b]``). Piecewise-linear curves blended linearly are linear between
    the grid's points, so a blended curve is the table itself (to rounding)."""
    lo, hi = TO[T_DECODE], TO[T_DECODE + 1]
    for b in range(1, YB.shape[0]):
        for g in range(G.shape[0]):
            YB[b, g] = table_at(A, X, Y, N, lo, hi, float(b), G[g])[0]
        BEY[b] = float(b) > A[hi - 1]


@kernel
def step_ms(CF, A, X, Y, N, TO, G, YB, BEY, CL, nd, ctx_max, ctx_sum, chn, chp, chf, nch):
    """Milliseconds of a step of ``nd`` decodes and ``nch`` prefill chunks (sizes
    ``chn``, cached tokens before each ``chp``, completes its prompt ``chf``); counts
    lookups and extrapolations into ``CL`` (``A, X, Y, N, TO``: the stacked prefill,
    decode and eager-decode tables; ``G, YB, BEY``: the decode table blended, ``blend``)."""
    parts = 0
    ms = book_ms(CF[C_BK], CF[C_BK_SEQ], nd + nch)
    if nd:
        # An engine that graphs pure-decode steps runs a step holding a chunk eagerly.
        y, out = decode_lookup(A, X, Y, N, TO, G, YB, BEY, T_EAGER if nch else T_DECODE, nd,
                               decode_ctx(CF, nd, ctx_max, ctx_sum))
        CL[0] += 1
        CL[1] += out
        ms += y
        parts = 1
    for i in range(nch):
        y, out = table_at(A, X, Y, N, TO[T_PREFILL], TO[T_PREFILL + 1], float(chp[i]),
                          float(chn[i]))
        CL[0] += 1
        CL[1] += out
        ms += y
        if not chf[i]:
            ms -= CF[C_LMHEAD]   # a chunk that leaves its prompt unfinished samples nothing
        parts += 1
    return settle(CF, ms, parts)


@kernel
def decode_run_ms(CF, A, X, Y, N, TO, G, YB, BEY, CL, nd, ctx_max0, ctx_sum0, k, out, z, f):
    """``step_ms`` of ``k`` consecutive decode-only steps whose longest context grows by
    one per step and whose contexts' sum grows by ``nd`` (into ``out[:k]``); ``z``, ``f``:
    empty chunk arrays (int64, bool). The same pieces as ``step_ms`` (``decode_ctx``,
    ``decode_lookup``, ``settle``), with the blended curve of this batch chosen once for
    all the steps: a call per step that carries every table costs ~30 times the lookup."""
    if nd < YB.shape[0]:
        row = YB[nd]
        beyond = BEY[nd]
        ng = G.shape[0]
        bk = book_ms(CF[C_BK], CF[C_BK_SEQ], nd)
        for j in range(k):
            y, o = curve(G, row, ng, decode_ctx(CF, nd, ctx_max0 + j, ctx_sum0 + nd * j))
            CL[0] += 1
            CL[1] += o or beyond
            out[j] = settle(CF, bk + y, 1)
        return
    for j in range(k):
        out[j] = step_ms(CF, A, X, Y, N, TO, G, YB, BEY, CL, nd, ctx_max0 + j,
                         ctx_sum0 + nd * j, z, z, f, 0)


def blended(tables: tuple, max_batch: int) -> tuple:
    """``(G, YB, BEY)`` of ``blend`` for batches below ``max_batch`` (larger batches read
    the table itself)."""
    A, X, Y, N, TO = tables
    lo, hi = int(TO[T_DECODE]), int(TO[T_DECODE + 1])
    G = np.unique(np.concatenate([X[i, :N[i]] for i in range(lo, hi)]))
    YB = np.zeros((max_batch, len(G)))
    BEY = np.zeros(max_batch, dtype=np.bool_)
    blend(A, X, Y, N, TO, G, YB, BEY)
    return G, YB, BEY


def pack_tables(*tables) -> tuple:
    """Tables ``pack_table`` made, stacked: ``(A, X, Y, N, TO)``."""
    m = max(t[1].shape[1] for t in tables)
    A = np.concatenate([t[0] for t in tables])
    X = np.zeros((len(A), m))
    Y = np.zeros((len(A), m))
    N = np.concatenate([t[3] for t in tables]).astype(np.int64)
    TO = np.zeros(len(tables) + 1, dtype=np.int64)
    row = 0
    for i, t in enumerate(tables):
        L, w = t[1].shape
        X[row:row + L, :w] = t[1]
        Y[row:row + L, :w] = t[2]
        row += L
        TO[i + 1] = row
    return A, X, Y, N, TO


def pack_table(a, b, y) -> tuple:
    """Rows ``(a, b, y)`` as the arrays ``table`` reads: levels of ``a`` sorted, each
    level's knots ``b`` sorted."""
    levels: dict = {}
    for ai, bi, yi in zip(a, b, y):
        levels.setdefault(float(ai), []).append((float(bi), float(yi)))
    A = np.array(sorted(levels), dtype=np.float64)
    m = max(len(v) for v in levels.values())
    X = np.zeros((len(A), m))
    Y = np.zeros((len(A), m))
    N = np.zeros(len(A), dtype=np.int64)
    for i, ai in enumerate(A):
        pts = sorted(levels[float(ai)], key=lambda p: p[0])
        X[i, :len(pts)] = [p[0] for p in pts]
        Y[i, :len(pts)] = [p[1] for p in pts]
        N[i] = len(pts)
    return (A, X, Y, N)
