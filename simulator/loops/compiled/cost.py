"""``ProfileCostModel``'s lookups, compiled: the same interpolation, the same
floating-point operations in the same order, the same lookup and extrapolation
counts (see ``costmodel.profile`` for what they model).

A measured table ``_Table2D`` arrives as four arrays: its levels ``A`` (sorted), and
per level the knots ``X[l, :N[l]]`` and values ``Y[l, :N[l]]``. The decode table
blended at each batch size (``ProfileCostModel._blended_decode``) arrives
precomputed by that very method: grid ``G``, values ``YB[batch]``, the slope above
the grid ``SL[batch]`` and whether the batch lies beyond the measured ones
``BEY[batch]``. ``CF`` holds the model's constants (index names below)."""
from __future__ import annotations

import numpy as np

from simulator.kernel import kernel as jit

# CF: the cost model's constants.
C_BK, C_LMHEAD, C_ALPHA, C_FLOOR, C_MIN, C_SCALE, C_PADDED = range(7)


@jit
def bisect_right(x, n, q):
    """First index of ``x[:n]`` holding a value above ``q`` (``bisect.bisect_right``)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if q < x[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


@jit
def bisect_left(x, n, q):
    """First index of ``x[:n]`` holding a value not below ``q`` (``bisect.bisect_left``)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if x[mid] < q:
            lo = mid + 1
        else:
            hi = mid
    return lo


@jit
def bracket(x, n, q):
    """For ``q > x[0]``: (i, above) with ``x[i-1] <= q < x[i]`` inside ``x[:n]``, or the
    last segment (``i = n - 1``) at or above the top, flagged when strictly above."""
    if q >= x[n - 1]:
        return n - 1, q > x[n - 1]
    return bisect_right(x, n, q), False


@jit
def curve(X, Y, n, q):
    """``_Curve.__call__``: (value, above the measured range)."""
    if q <= X[0]:
        return Y[0], False
    if n == 1:
        return Y[0], q != X[0]
    i, out = bracket(X, n, q)
    x0, x1, y0, y1 = X[i - 1], X[i], Y[i - 1], Y[i]
    return y0 + (y1 - y0) * (q - x0) / (x1 - x0), out


@jit
def table(A, X, Y, N, qa, qb):
    """``_Table2D.__call__``: (value, above the measured range)."""
    L = A.shape[0]
    if L == 1 or qa <= A[0]:
        return curve(X[0], Y[0], N[0], qb)
    j = bisect_left(A, L, qa)
    if j < L and A[j] == qa:
        return curve(X[j], Y[j], N[j], qb)
    i, out = bracket(A, L, qa)
    y0, o0 = curve(X[i - 1], Y[i - 1], N[i - 1], qb)
    y1, o1 = curve(X[i], Y[i], N[i], qb)
    a0, a1 = A[i - 1], A[i]
    return y0 + (y1 - y0) * (qa - a0) / (a1 - a0), out or o0 or o1


@jit
def step_time(CF, PT, DT, ET, CL, nd, ctx_max, ctx_sum, chunk_n, chunk_prior, chunk_final, nch):
    """``ProfileCostModel.step_time`` (no noise): seconds of a step of ``nd`` decodes
    and ``nch`` prefill chunks; counts lookups and extrapolations into ``CL``
    (``PT``/``DT``/``ET``: the prefill, decode and eager-decode tables as tuples)."""
    parts = 0
    ms = CF[C_BK]
    if nd:
        if CF[C_PADDED] != 0.0:
            ctx = float(ctx_max)
        else:
            ctx = ctx_sum / nd
        if nch:
            y, out = table(ET[0], ET[1], ET[2], ET[3], float(nd), ctx)
        else:
            y, out = table(DT[0], DT[1], DT[2], DT[3], float(nd), ctx)
        CL[0] += 1
        CL[1] += out
        ms += y
        parts = 1
    for i in range(nch):
        y, out = table(PT[0], PT[1], PT[2], PT[3], float(chunk_prior[i]), float(chunk_n[i]))
        CL[0] += 1
        CL[1] += out
        ms += y
        if not chunk_final[i]:
            ms -= CF[C_LMHEAD]
        parts += 1
    if parts > 1:
        ms -= CF[C_ALPHA] * CF[C_FLOOR] * float(parts - 1)
    if ms < CF[C_MIN]:
        ms = CF[C_MIN]
    ms *= CF[C_SCALE]
    return ms / 1000.0


@jit
def decode_ends(CF, G, YB, SL, BEY, CL, batch, ctx0, k, now, ends):
    """``ProfileCostModel.decode_times`` (no noise) for ``k`` decode-only steps, summed
    from ``now`` into ``ends[:k]`` as ``itertools.accumulate`` does."""
    ng = G.shape[0]
    y = YB[batch]
    slope = SL[batch]
    beyond = BEY[batch]
    bk, mn = CF[C_BK], CF[C_MIN]
    CL[0] += k
    n_out = 0
    acc = now
    if k <= 32:
        # The scalar path of ``decode_times``.
        sc = CF[C_SCALE] / 1000.0
        lo, hi = G[0], G[ng - 1]
        for j in range(k):
            q = ctx0 + j
            if q <= lo:
                v = y[0]
            elif q >= hi:
                v = y[ng - 1] + slope * (q - hi)
                n_out += q > hi
            else:
                i = bisect_right(G, ng, q)
                x0, y0 = G[i - 1], y[i - 1]
                v = y0 + (y[i] - y0) * (q - x0) / (G[i] - x0)
            v += bk
            acc += (v if v > mn else mn) * sc
            ends[j] = acc
        CL[1] += k if beyond else n_out
        return
    # The numpy path: ``np.interp`` (its own formula: slope times offset plus value),
    # then the linear extrapolation above the grid, the floor, the scale.
    last = G[ng - 1]
    sc = CF[C_SCALE]
    for j in range(k):
        q = ctx0 + j
        if q > last:
            v = y[ng - 1] + slope * (q - last) + bk
            n_out += 1
        else:
            if ng == 1 or q <= G[0]:
                v = y[0]
            else:
                i = bisect_right(G, ng, q) - 1
                if i == ng - 1 or G[i] == q:
                    v = y[i]
                else:
                    s = (y[i + 1] - y[i]) / (G[i + 1] - G[i])
                    v = s * (q - G[i]) + y[i]
            v = v + bk
        v = (v if v > mn else mn) * sc
        acc += v / 1000.0
        ends[j] = acc
    CL[1] += k if beyond else n_out


def pack_table(t) -> tuple:
    """A ``_Table2D`` as the arrays ``table`` reads."""
    L = len(t.a)
    m = max(len(c.x) for c in t.curves)
    X = np.zeros((L, m))
    Y = np.zeros((L, m))
    N = np.zeros(L, dtype=np.int64)
    for i, c in enumerate(t.curves):
        X[i, :len(c.x)] = c.x
        Y[i, :len(c.y)] = c.y
        N[i] = len(c.x)
    return (np.asarray(t.a, dtype=np.float64), X, Y, N)


def pack_cost(cost, max_batch: int) -> tuple:
    """A ``ProfileCostModel`` (without noise) as the kernel's arrays: constants, the
    three tables, and the blended decode curves for batches 1..``max_batch``."""
    CF = np.array([cost.bookkeeping_ms, cost.lm_head_ms, cost.alpha, cost.floor_ms,
                   cost._min_ms, cost.scale, 1.0 if cost.padded else 0.0])
    G = None
    YB = SL = BEY = None
    for b in range(1, max_batch + 1):
        grid, y, slope, beyond, _, _ = cost._blended_decode(b)
        if G is None:
            G = np.asarray(grid, dtype=np.float64)
            YB = np.zeros((max_batch + 1, len(G)))
            SL = np.zeros(max_batch + 1)
            BEY = np.zeros(max_batch + 1, dtype=np.bool_)
        YB[b] = y
        SL[b] = slope
        BEY[b] = beyond
    return (CF, pack_table(cost._prefill), pack_table(cost._decode),
            pack_table(cost._decode_eager), G, YB, SL, BEY)
