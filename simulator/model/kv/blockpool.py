"""A prefix cache's block pool as one int64 array, and its data structures' kernels:
the layout (a header ``H_*``, then per block its reference count, its key, its LRU
links and its links in its owner's list, the never-cached free stack, the limbo stack,
and the key map), the key map (open addressing, linear probing, backward-shift
deletion: at most ``capacity`` keys in twice as many slots) and the LRU list of cached
blocks nobody references. The rules that use them are ``prefixcache``'s.
"""
from __future__ import annotations

import numpy as np

from simulator.kernel import kernel

EMPTY = np.iinfo(np.int64).min       # an unnamed block / an empty hash slot
# Header.
(H_CAP, H_M, H_NFREE, H_LHEAD, H_LTAIL, H_NEVICT, H_NCACHED, H_NLIMBO, H_NREFS,
 H_EVICTIONS, H_QBLOCKS, H_HBLOCKS, H_QTOKENS, H_CTOKENS, H_ADMISSIONS, H_PREFIX,
 H_NCOLS) = range(17)
# A request's table row.
T_H, T_HEAD, T_TAIL, T_NOWN, T_REG, T_CUR, T_NCOLS = range(7)


def pool_size(capacity: int) -> int:
    """Length of a pool array of ``capacity`` blocks."""
    return H_NCOLS + 8 * capacity + 2 * _slots(capacity)


def _slots(capacity: int) -> int:
    m = 2
    while m < 2 * capacity + 2:
        m *= 2
    return m


def new_pool(capacity: int, prefix_caching: bool = True) -> np.ndarray:
    """An empty pool: every block free (the lowest id taken first), nothing cached."""
    cap = int(capacity)
    m = _slots(cap)
    p = np.zeros(pool_size(cap), dtype=np.int64)
    p[H_CAP], p[H_M], p[H_NFREE] = cap, m, cap
    p[H_LHEAD] = p[H_LTAIL] = -1
    p[H_PREFIX] = bool(prefix_caching)
    b = H_NCOLS
    p[b + cap:b + 2 * cap] = EMPTY                      # keys
    p[b + 6 * cap:b + 7 * cap] = np.arange(cap - 1, -1, -1)   # free stack, 0 on top
    p[b + 8 * cap:b + 8 * cap + m] = EMPTY              # hash keys
    return p


def new_table() -> np.ndarray:
    """An empty table row."""
    t = np.zeros(T_NCOLS, dtype=np.int64)
    t[T_HEAD] = t[T_TAIL] = t[T_CUR] = -1
    return t


# -- sections ---------------------------------------------------------------------------
@kernel(inline=True)
def _ref(p, b):
    return H_NCOLS + b


@kernel(inline=True)
def _key(p, b):
    return H_NCOLS + p[H_CAP] + b


@kernel(inline=True)
def _lprev(p, b):
    return H_NCOLS + 2 * p[H_CAP] + b


@kernel(inline=True)
def _lnext(p, b):
    return H_NCOLS + 3 * p[H_CAP] + b


@kernel(inline=True)
def _onext(p, b):
    return H_NCOLS + 4 * p[H_CAP] + b


@kernel(inline=True)
def _oprev(p, b):
    return H_NCOLS + 5 * p[H_CAP] + b


@kernel(inline=True)
def _free(p, i):
    return H_NCOLS + 6 * p[H_CAP] + i


@kernel(inline=True)
def _limbo(p, i):
    return H_NCOLS + 7 * p[H_CAP] + i


@kernel(inline=True)
def _hk(p, i):
    return H_NCOLS + 8 * p[H_CAP] + i


@kernel(inline=True)
def _hv(p, i):
    return H_NCOLS + 8 * p[H_CAP] + p[H_M] + i


@kernel(inline=True)
def _home(p, key):
    """A key's first slot: its two 32-bit halves times odd 31-bit constants (products
    below 2^63: no overflow compiled or not), mixed, the high bits kept."""
    lo = key & 0xFFFFFFFF
    hi = (key >> 32) & 0xFFFFFFFF
    return (((lo * 0x5BD1E995) ^ (hi * 0x27D4EB2F)) >> 23) & (p[H_M] - 1)


# -- the key map ------------------------------------------------------------------------
@kernel
def block_of(p, key):
    """The block holding ``key``, or -1."""
    mask = p[H_M] - 1
    i = _home(p, key)
    while True:
        k = p[_hk(p, i)]
        if k == key:
            return p[_hv(p, i)]
        if k == EMPTY:
            return -1
        i = (i + 1) & mask


@kernel
def _map_put(p, key, b):
    mask = p[H_M] - 1
    i = _home(p, key)
    while p[_hk(p, i)] != EMPTY:
        i = (i + 1) & mask
    p[_hk(p, i)] = key
    p[_hv(p, i)] = b


@kernel
def _map_del(p, key):
    """Remove ``key`` (present), shifting later entries of its probe run back."""
    mask = p[H_M] - 1
    i = _home(p, key)
    while p[_hk(p, i)] != key:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        k = p[_hk(p, j)]
        if k == EMPTY:
            break
        h = _home(p, k)
        # Move the entry at j into the hole at i unless its home lies in (i, j].
        if (i <= j and (h <= i or h > j)) or (i > j and h <= i and h > j):
            p[_hk(p, i)] = k
            p[_hv(p, i)] = p[_hv(p, j)]
            i = j
    p[_hk(p, i)] = EMPTY


# -- the LRU of evictable blocks --------------------------------------------------------
@kernel
def _lru_append(p, b):
    t = p[H_LTAIL]
    p[_lprev(p, b)] = t
    p[_lnext(p, b)] = -1
    if t >= 0:
        p[_lnext(p, t)] = b
    else:
        p[H_LHEAD] = b
    p[H_LTAIL] = b
    p[H_NEVICT] += 1


@kernel
def _lru_remove(p, b):
    a, c = p[_lprev(p, b)], p[_lnext(p, b)]
    if a >= 0:
        p[_lnext(p, a)] = c
    else:
        p[H_LHEAD] = c
    if c >= 0:
        p[_lprev(p, c)] = a
    else:
        p[H_LTAIL] = a
    p[H_NEVICT] -= 1


@kernel
def pop_or_evict(p):
    """A block for a new occupant: the top of the free stack, else the least recently
    used one, taken off the LRU list and its key forgotten in the map. Returns
    ``(block, evicted)``; the caller keeps its own counters (the GPU cache's, a CPU
    tier's)."""
    n = p[H_NFREE]
    if n > 0:
        p[H_NFREE] = n - 1
        return p[_free(p, n - 1)], False
    b = p[H_LHEAD]
    _lru_remove(p, b)
    _map_del(p, p[_key(p, b)])
    return b, True


@kernel(inline=True)
def num_free(p):
    """Blocks an allocation may take: never-cached free plus evictable cached."""
    return p[H_NFREE] + p[H_NEVICT]


@kernel
def ref_of(p, b):
    """Reference count of block ``b``."""
    return p[_ref(p, b)]


@kernel
def key_at(p, b):
    """Key of block ``b`` (``EMPTY``: unnamed)."""
    return p[_key(p, b)]


@kernel
def stack_ids(p, which, out):
    """The free stack (``which`` 0), limbo (1) or LRU order (2) into ``out``; returns
    how many."""
    if which == 2:
        b = p[H_LHEAD]
        j = 0
        while b >= 0:
            out[j] = b
            j += 1
            b = p[_lnext(p, b)]
        return j
    n = p[H_NFREE] if which == 0 else p[H_NLIMBO]
    for i in range(n):
        out[i] = p[_free(p, i)] if which == 0 else p[_limbo(p, i)]
    return n
