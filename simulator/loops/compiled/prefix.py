"""Prefix caching in the compiled loop: each replica's block pool and each request's
table (``PFX = (KVP, KT, KEYS, KOFF, KCP, KCN, LTOK, LSEC)``: pools ``KVP[r]``, table rows
``KT[rid]``, every request's keys ``KEYS[KOFF[rid]:KOFF[rid + 1]]``; with a CPU tier
(``IP[P_OFFLOAD]``) each replica's tier ``KCP[r]`` and its counters ``KCN[r]``, and per
request the tokens it loaded and the seconds the loads took) under the prefix cache's
own kernels (``simulator.model.kv.prefixcache``, ``offload``), the ones ``PrefixKV``
runs for the SimPy replica.

Without prefix caching (``IP[P_PREFIX]`` 0) memory stays counts (``R_FREE``); with it,
``R_FREE`` is the pool's free count after every change. Decoders' growth is counted,
not visited (``apply.catch_up_growth``), so it takes blocks into the pool's limbo, and
a request gives back what it holds past its table when it frees (``prefixcache``)."""
from __future__ import annotations

import numpy as np

from simulator.loops.compiled import state as S
from simulator.kernel import kernel as jit
from simulator.model.kv import offload as off
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
    if IP[S.P_OFFLOAD]:
        cached, need, _ = off.price(PFX[0][r], PFX[4][r], keys_of(rid, PFX), tokens, bs)
        return tokens, cached, need
    _, h, need = pc.price(PFX[0][r], keys_of(rid, PFX), tokens, bs)
    return tokens, h * bs, need


@jit
def admit(r, rid, tokens, RS, RF, IP, FP, PFX):
    """Allocate ``rid``'s admission blocks (``PrefixKV.allocate``); returns the cached
    tokens, or -1 when they no longer fit (an earlier admission of the step evicted
    part of the hit it was priced with). With a CPU tier, what it loads from there
    lengthens this step (``Replica._admit``)."""
    p = PFX[0][r]
    bs = IP[S.P_BS]
    if IP[S.P_OFFLOAD]:
        cached, loaded = off.allocate(p, PFX[1][rid], PFX[4][r], PFX[5][r], keys_of(rid, PFX),
                                      tokens, bs)
        if loaded:
            tok, secs = off.load_charge(loaded, bs, FP[S.D_BLOCKBYTES], FP[S.D_OFFBPS])
            RF[r, S.F_LOAD] += secs
            PFX[6][rid] += tok
            PFX[7][rid] += secs
    else:
        cached = pc.allocate(p, PFX[1][rid], keys_of(rid, PFX), tokens, bs)
    RS[r, S.R_FREE] = pc.num_free(p)
    return cached


@jit
def computed(r, rid, RQ, IP, PFX):
    """``KVSpace.computed``: name ``rid``'s computed full blocks for reuse (and, with a
    CPU tier, copy them there: ``PrefixKV.register``)."""
    t = PFX[1][rid]
    lo = t[pc.T_REG]
    pc.register(PFX[0][r], t, keys_of(rid, PFX), RQ[rid, S.Q_PREFILLED], IP[S.P_BS])
    if IP[S.P_OFFLOAD] and t[pc.T_REG] > lo:
        off.store_run(PFX[4][r], PFX[5][r], keys_of(rid, PFX), lo, t[pc.T_REG])


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


def pack_prefix(on: bool, keys, n_replicas: int, capacity: int, n: int,
                cpu_blocks=None) -> tuple:
    """``PFX`` for a run: a pool per replica, a table row per request and every request's
    keys (``keys``: ``prefixkeys.WorkloadKeys``, or None: no request has any), and a CPU
    tier of ``cpu_blocks`` per replica (None: none); empty arrays of the right types
    for what is off."""
    tier, counts = off.new_tier(0 if cpu_blocks is None or not on else cpu_blocks)
    m = n if cpu_blocks is not None and on else 1
    TIER = (np.broadcast_to(tier, (n_replicas, tier.shape[0])).copy(),
            np.zeros((n_replicas, counts.shape[0]), dtype=np.int64),
            np.zeros(m, dtype=np.int64), np.zeros(m))
    if not on:
        z = np.zeros((1, 1), dtype=np.int64)
        return (z, z, np.zeros(0, np.int64), np.zeros(1, np.int64)) + TIER
    pool = pc.new_pool(capacity)
    KVP = np.empty((n_replicas, pool.shape[0]), dtype=np.int64)
    KVP[:] = pool
    KT = np.zeros((n, pc.T_NCOLS), dtype=np.int64)
    KT[:] = pc.new_table()
    if keys is None:
        KEYS, KOFF = np.zeros(0, np.int64), np.zeros(n + 1, np.int64)
    else:
        KEYS, KOFF = keys.flat()
    return (KVP, KT, KEYS, KOFF) + TIER
