"""Prefix caching in the compiled loop: each replica's block pool and each request's
table (``PFX = (KVP, KT, KEYS, KOFF)``: pools ``KVP[r]``, table rows ``KT[rid]``, every
request's keys ``KEYS[KOFF[rid]:KOFF[rid + 1]]``) under the prefix cache's own kernels
(``simulator.model.kv.prefixcache``), the ones ``PrefixKV`` runs for the SimPy replica.

Without prefix caching (``IP[P_PREFIX]`` 0) memory stays counts (``R_FREE``); with it,
``R_FREE`` is the pool's free count after every change. Decoders' growth is counted,
not visited (``apply.catch_up_growth``), so it takes blocks into the pool's limbo, and
a request gives back what it holds past its table when it frees (``prefixcache``)."""
from __future__ import annotations

import numpy as np

from simulator.loops.compiled import state as S
from simulator.kernel import kernel as jit
from simulator.model.kv import prefixcache as pc
from simulator.model.kv.rules import admission_tokens, ceil_blocks


@jit
def keys_of(rid, PFX):
    """Request ``rid``'s prefix keys."""
    KEYS, KOFF = PFX[2], PFX[3]
    return KEYS[KOFF[rid]:KOFF[rid + 1]]


@jit
def adm_price(r, rid, IP, RQ, prompt, output, PFX):
    """``KVSpace.admission_tokens`` and ``KVSpace.admission``: ``(tokens, cached tokens,
    blocks taken from the free pool)`` admitting ``rid`` on replica ``r`` now."""
    tokens = admission_tokens(IP[S.P_PAGED] != 0, RQ[rid, S.Q_PLEN], IP[S.P_MAXLEN],
                              prompt[rid], output[rid])
    bs = IP[S.P_BS]
    if IP[S.P_PREFIX] == 0:
        return tokens, 0, ceil_blocks(tokens, bs)
    _, h, need = pc.price(PFX[0][r], keys_of(rid, PFX), tokens, bs)
    return tokens, h * bs, need


@jit
def admit(r, rid, tokens, RS, IP, PFX):
    """Allocate ``rid``'s admission blocks (``PrefixKV.allocate``); returns the cached
    tokens, or -1 when they no longer fit (an earlier admission of the step evicted
    part of the hit it was priced with)."""
    p = PFX[0][r]
    cached = pc.allocate(p, PFX[1][rid], keys_of(rid, PFX), tokens, IP[S.P_BS])
    RS[r, S.R_FREE] = pc.num_free(p)
    return cached


@jit
def computed(r, rid, RQ, IP, PFX):
    """``KVSpace.computed``: name ``rid``'s computed full blocks for reuse."""
    pc.register(PFX[0][r], PFX[1][rid], keys_of(rid, PFX), RQ[rid, S.Q_PREFILLED],
                IP[S.P_BS])


@jit
def release(r, rid, held, RS, PFX):
    """Free the ``held`` blocks of ``rid``: its table and, past it, counted growth."""
    p = PFX[0][r]
    t = PFX[1][rid]
    pc.release(p, t, keys_of(rid, PFX), held - t[pc.T_H] - t[pc.T_NOWN])
    RS[r, S.R_FREE] = pc.num_free(p)


@jit
def take(r, n, RS, PFX):
    """``n`` growth blocks for the replica's decoders (counted: limbo)."""
    if n > 0:
        p = PFX[0][r]
        pc.take_limbo(p, n)
        RS[r, S.R_FREE] = pc.num_free(p)


@jit
def swap_back(r, rid, tokens, RS, IP, PFX):
    """``KVSpace.swap_in``'s allocation: fresh blocks, no prefix lookup."""
    p = PFX[0][r]
    pc.allocate(p, PFX[1][rid], PFX[2][:0], tokens, IP[S.P_BS])
    RS[r, S.R_FREE] = pc.num_free(p)


@jit
def shared_refs(r, PFX):
    """``PrefixKV.shared_refs`` of replica ``r``."""
    p = PFX[0][r]
    return p[pc.H_NREFS] - (p[pc.H_CAP] - pc.num_free(p))


def pack_prefix(on: bool, keys, n_replicas: int, capacity: int, n: int) -> tuple:
    """``PFX`` for a run: a pool per replica, a table row per request and every request's
    keys (``keys``: ``prefixkeys.WorkloadKeys``, or None: no request has any); empty
    arrays of the right types when prefix caching is off."""
    if not on:
        z = np.zeros((1, 1), dtype=np.int64)
        return z, z, np.zeros(0, np.int64), np.zeros(1, np.int64)
    pool = pc.new_pool(capacity)
    KVP = np.empty((n_replicas, pool.shape[0]), dtype=np.int64)
    KVP[:] = pool
    KT = np.zeros((n, pc.T_NCOLS), dtype=np.int64)
    KT[:] = pc.new_table()
    if keys is None:
        KEYS, KOFF = np.zeros(0, np.int64), np.zeros(n + 1, np.int64)
    else:
        KEYS, KOFF = keys.flat()
    return KVP, KT, KEYS, KOFF
