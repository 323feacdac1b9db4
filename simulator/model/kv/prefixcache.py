"""The prefix cache's rules, each written once as a ``@kernel`` over flat arrays: block
ids with reference counts, the map from a block's key to the block holding it, the LRU
of cached blocks nobody references, hits at admission, eviction, registration and
release. ``manager.PrefixKV`` (the SimPy replica, the real engine, the cache-aware
router) and the compiled loop (one pool per replica) call the very same kernels.

A *pool* is one int64 array (``blockpool.new_pool``: its layout, key map and LRU).

A request's *table* is one int64 row (``T_*``): its ``T_H`` leading hit blocks (found
through its keys: a referenced block cannot be evicted, so its key keeps naming it) and
then the blocks it took itself, a linked list from ``T_HEAD`` (oldest) to ``T_TAIL``.

Limbo: the compiled loop counts a decoder's growth blocks instead of visiting each
decoder (``loops.compiled``). Those blocks are taken by the same ``take`` rule (a
never-cached free block, else evict the least recently freed cached one) into the
limbo stack, and a request returns its uncounted blocks from it when it frees its
table (``release``, ``extra``). Growth blocks lie past the prompt's full blocks, so they
never get a key; which id such a block has changes nothing a simulation reports.

The rules themselves are those of ``manager``'s module doc (vLLM's prefix caching).
"""
from __future__ import annotations

import numpy as np

from simulator.kernel import kernel
from simulator.model.kv.blockpool import (EMPTY, H_ADMISSIONS, H_CAP, H_CTOKENS,  # noqa: F401
                                          H_EVICTIONS, H_HBLOCKS, H_LHEAD, H_M, H_NCACHED,
                                          H_NCOLS, H_NEVICT, H_NFREE, H_NLIMBO, H_NREFS,
                                          H_PREFIX, H_QBLOCKS, H_QTOKENS, T_CUR, T_H,
                                          T_HEAD, T_NCOLS, T_NOWN, T_REG, T_TAIL, _free,
                                          _key, _limbo, _lru_append, _lru_remove, _map_del,
                                          _map_put, _onext, _oprev, _ref, block_of, key_at,
                                          new_pool, new_table, num_free, pool_size,
                                          pop_or_evict, ref_of, stack_ids)

# -- queries ----------------------------------------------------------------------------
@kernel
def leading_hits(p, keys, tokens, block_size):
    """``(leading keys cached, usable hit blocks)`` of a prompt of ``tokens`` tokens:
    at least one prompt token is recomputed (the step must produce logits)."""
    if p[H_PREFIX] == 0 or keys.shape[0] == 0:
        return 0, 0
    full = full_blocks(keys, tokens, block_size)
    h = 0
    while h < full and block_of(p, keys[h]) >= 0:
        h += 1
    use = usable_blocks(tokens, block_size)
    return h, (h if h < use else use)


@kernel(inline=True)
def full_blocks(keys, tokens, block_size):
    """The prompt's full blocks that have a key (a partial last block has none)."""
    full = tokens // block_size
    return keys.shape[0] if keys.shape[0] < full else full


@kernel(inline=True)
def usable_blocks(tokens, block_size):
    """The most hit blocks a prompt of ``tokens`` may use: at least one prompt token is
    recomputed (the step must produce logits)."""
    return (tokens - 1) // block_size


@kernel
def price(p, keys, tokens, block_size):
    """``(leading keys cached, usable hit blocks, blocks taken from the free pool)``:
    the new blocks plus the hit blocks that are evictable (they leave the free pool)."""
    found, h = leading_hits(p, keys, tokens, block_size)
    need = -(-tokens // block_size) - h
    for i in range(h):
        if p[_ref(p, block_of(p, keys[i]))] == 0:
            need += 1
    return found, h, need


# -- mutations --------------------------------------------------------------------------
@kernel
def take(p):
    """One block from the free pool (referenced once): a never-cached free block, else
    the least recently freed cached one, evicted (its key forgotten)."""
    b, evicted = pop_or_evict(p)
    if evicted:
        p[_key(p, b)] = EMPTY
        p[H_NCACHED] -= 1
        p[H_EVICTIONS] += 1
    p[_ref(p, b)] = 1
    p[H_NREFS] += 1
    return b


@kernel
def _own_append(p, t, b):
    tail = t[T_TAIL]
    p[_oprev(p, b)] = tail
    p[_onext(p, b)] = -1
    if tail >= 0:
        p[_onext(p, tail)] = b
    else:
        t[T_HEAD] = b
    t[T_TAIL] = b
    if t[T_CUR] < 0 and t[T_REG] == t[T_H] + t[T_NOWN]:
        t[T_CUR] = b
    t[T_NOWN] += 1


@kernel
def allocate(p, t, keys, tokens, block_size):
    """Give an empty table ``t`` the blocks of ``tokens`` tokens, sharing its cached
    prefix; returns the cached tokens (their prefill is skipped), or -1 (nothing
    changed) when the pool cannot supply the rest."""
    found, h, need = price(p, keys, tokens, block_size)
    if need > num_free(p):
        return -1
    t[T_H] = h
    t[T_HEAD] = t[T_TAIL] = t[T_CUR] = -1
    t[T_NOWN] = 0
    t[T_REG] = h
    for i in range(h):
        b = block_of(p, keys[i])
        if p[_ref(p, b)] == 0:
            _lru_remove(p, b)
        p[_ref(p, b)] += 1
    p[H_NREFS] += h
    for i in range(-(-tokens // block_size) - h):
        _own_append(p, t, take(p))
    p[H_ADMISSIONS] += 1
    p[H_QTOKENS] += tokens
    p[H_CTOKENS] += h * block_size
    if p[H_PREFIX] != 0 and keys.shape[0] > 0:
        q = tokens // block_size
        p[H_QBLOCKS] += q if q < keys.shape[0] else keys.shape[0]
        p[H_HBLOCKS] += found
    return h * block_size


@kernel
def grow(p, t, tokens, block_size):
    """Make table ``t`` hold room for ``tokens`` tokens; returns the blocks added, or
    -1 (nothing changed) when the pool cannot supply them."""
    need = -(-tokens // block_size) - t[T_H] - t[T_NOWN]
    if need <= 0:
        return 0
    if need > num_free(p):
        return -1
    for _ in range(need):
        _own_append(p, t, take(p))
    return need


@kernel
def take_limbo(p, n):
    """Take ``n`` blocks for requests that count them (see module doc); False (nothing
    changed) when the pool cannot supply them."""
    if n > num_free(p):
        return False
    for _ in range(n):
        p[_limbo(p, p[H_NLIMBO])] = take(p)
        p[H_NLIMBO] += 1
    return True


@kernel
def register(p, t, keys, computed_tokens, block_size):
    """Name the table's full blocks among its first ``computed_tokens`` tokens by their
    keys, so later requests can hit them. A key already cached in another block is left
    there (the duplicate block stays private and unnamed)."""
    if p[H_PREFIX] == 0 or keys.shape[0] == 0:
        return
    upto = computed_tokens // block_size
    if keys.shape[0] < upto:
        upto = keys.shape[0]
    n = t[T_H] + t[T_NOWN]
    if n < upto:
        upto = n
    j = t[T_REG]
    b = t[T_CUR]
    while j < upto:
        k = keys[j]
        if p[_key(p, b)] == EMPTY and block_of(p, k) < 0:
            _map_put(p, k, b)
            p[_key(p, b)] = k
            p[H_NCACHED] += 1
        b = p[_onext(p, b)]
        j += 1
    if j > t[T_REG]:
        t[T_REG] = j
        t[T_CUR] = b


@kernel
def _unref(p, b):
    r = p[_ref(p, b)] - 1
    p[_ref(p, b)] = r
    if r == 0:
        if p[_key(p, b)] != EMPTY:
            _lru_append(p, b)
        else:
            p[_free(p, p[H_NFREE])] = b
            p[H_NFREE] += 1


@kernel
def release(p, t, keys, extra):
    """Free table ``t`` and ``extra`` counted blocks (from limbo), last block first:
    cached ones join the LRU tail (a later request likelier shares a prompt's start
    than its end), the rest the free stack. Returns the blocks released."""
    for _ in range(extra):
        p[H_NLIMBO] -= 1
        _unref(p, p[_limbo(p, p[H_NLIMBO])])
    b = t[T_TAIL]
    while b >= 0:
        prev = p[_oprev(p, b)]
        _unref(p, b)
        b = prev
    h = t[T_H]
    for i in range(h - 1, -1, -1):
        _unref(p, block_of(p, keys[i]))
    n = h + t[T_NOWN] + extra
    p[H_NREFS] -= n
    t[T_H] = t[T_NOWN] = t[T_REG] = 0
    t[T_HEAD] = t[T_TAIL] = t[T_CUR] = -1
    return n


@kernel
def table_ids(p, t, keys, out):
    """The table's block ids in token order into ``out``; returns how many."""
    h = t[T_H]
    for i in range(h):
        out[i] = block_of(p, keys[i])
    b = t[T_HEAD]
    j = h
    while b >= 0:
        out[j] = b
        j += 1
        b = p[_onext(p, b)]
    return j


def warm_up() -> None:
    """Compile (or load from numba's cache) the prefix-cache kernels now."""
    p = new_pool(4)
    t = new_table()
    keys = np.array([1, 2], dtype=np.int64)
    out = np.zeros(4, dtype=np.int64)
    price(p, keys, 40, 16)
    allocate(p, t, keys, 40, 16)
    register(p, t, keys, 40, 16)
    grow(p, t, 48, 16)
    take_limbo(p, 0)
    table_ids(p, t, keys, out)
    stack_ids(p, 2, out)
    ref_of(p, 0)
    key_at(p, 0)
    release(p, t, keys, 0)
