"""Tiered KV: a CPU-memory tier under the GPU prefix cache (vLLM's offloading KV
connector, ``--kv-transfer-config '{"kv_connector": "OffloadingConnector", ...}'`` /
``--kv-offloading-size``, and LMCache's CPU backend). Each rule is a ``@kernel``, like
the prefix cache's (``prefixcache``); ``manager.PrefixKV`` runs them for the SimPy
replica, ``loops.compiled.prefix`` on the compiled loop's arrays.

The tier is a pool array of ``blockpool``'s layout (``new_tier``): a slot per CPU block,
the same key map (a block's key is its prefix key, ``prefixkeys``) and an LRU of every
slot held (nothing references a CPU block, so every held one is evictable); plus a row
of counters ``C_*``. What vLLM's ``OffloadingConnectorScheduler`` does, and this models:

- **Store, write-through** (``store_run``): a full block the prefix cache names (of a
  prompt; in sessions of an answer too) is copied to the CPU tier when it is computed
  (``PrefixKV.register``: vLLM's ``_get_reqs_to_store`` after each step), not when the
  GPU evicts it; a key the tier holds already is only touched
  (``prepare_store`` skips it). A new key takes a free slot, else the least recently
  used one (its key forgotten). The device-to-host copy runs on its own stream between
  steps (vLLM defers it to the next step's start), so it adds no step time here: it is
  counted (``C_STORED`` blocks) but not timed.
- **Lookup** (``tier_hits``): after the GPU's leading run of cached keys, the run goes
  on in the CPU tier (vLLM's ``get_num_new_matched_tokens``: ``lookup`` from the first
  block the GPU lacks). Together they stay under the GPU rule's cap: at least one
  prompt token is recomputed, so the usable hit is at most ``(tokens - 1) // bs`` blocks.
- **Load** (``allocate``): the CPU-hit blocks take new GPU blocks like recomputed ones
  (the admission price in blocks does not change), are copied host-to-device and named
  in the GPU cache at once; their prefill is skipped. Every full prompt key is touched
  in the tier at admission, last block first, so a prompt's first block is the most
  recently used (vLLM's ``touch`` on lookup; the GPU LRU frees a prompt tail first too).
- **Load time** (``load_time``): ``blocks x block bytes / link bytes per second``: the
  copy rule of swapping (``rules.swap_copy``), over the same PCIe link.

Where the load time goes (``engine.kv.offload.load``): ``sync`` (the default) adds it to
the step that admits the request (its first prefill chunk waits for its KV: a
synchronous load before the forward pass, as LMCache's connector does by default in
``start_load_kv``, and as a swap-in does here), so the other requests of that step wait
for the copy too. ``async`` is vLLM's own OffloadingConnector (``get_num_new_matched_tokens``
answers ``is_async``): the request, its blocks allocated, waits in
``WAITING_FOR_REMOTE_KVS`` while the others run, the link copying one load after another,
and prefills from the first step after its KV has landed (the SimPy replica's
``loading``; the compiled loop runs ``sync`` only).

A tier of 0 blocks holds nothing: every lookup misses, every store is dropped, and a
run is the run without offloading, bit for bit (``tests/test_kv_offload.py``).
"""
from __future__ import annotations

import numpy as np

from simulator.kernel import kernel
from simulator.model.kv import prefixcache as pc
from simulator.model.kv import rules as kvr
from simulator.model.kv.blockpool import (H_CAP, _key, _lru_append, _lru_remove,
                                          _map_put, block_of, new_pool, pop_or_evict,
                                          stack_ids)

# The tier's counters: blocks found in the CPU tier at admissions (the leading run after
# the GPU's, like ``KVStats.hit_blocks``), blocks loaded from it, blocks copied into it,
# blocks it dropped to make room.
C_HITS, C_LOADED, C_STORED, C_EVICTED, C_NCOLS = range(5)

# Effective host<->device copy rates of one x16 link (bytes/s). The spec's raw rate per
# direction is 16 GT/s (PCIe 4.0) or 32 GT/s (5.0) per lane x 16 lanes x 128/130
# encoding / 8 = 31.5 / 63.0 GB/s (PCI-SIG, PCI Express Base Specification 4.0 / 5.0).
# A DMA copy from pinned memory carries each 256-byte payload in a packet with ~24 bytes
# of header and framing, plus flow-control and acknowledgement packets: about 80% of the
# raw rate is left, ~25 GB/s on PCIe 4.0 (A100), ~50 GB/s on 5.0 (H100/H200). That 80%
# is an estimate of the protocol's overhead, not a measurement made here; set
# ``pcie_gb_per_s`` to a ``bandwidthTest`` / ``nvbandwidth`` result of the machine when
# one is at hand. 25 GB/s is also ``engine.kv.swap_gb_per_s``'s default.
PCIE4_X16_BPS = 25e9
PCIE5_X16_BPS = 50e9


def new_tier(blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """An empty CPU tier of ``blocks`` blocks: its pool array and its counters."""
    if blocks < 0:
        raise ValueError(f"a CPU tier holds >= 0 blocks, got {blocks}")
    return new_pool(int(blocks)), np.zeros(C_NCOLS, dtype=np.int64)


def tier_blocks(cpu_bytes: float, block_bytes: float) -> int:
    """Blocks a tier of ``cpu_bytes`` holds, a block being ``block_bytes``."""
    return int(cpu_bytes // block_bytes) if block_bytes > 0 else 0


@kernel
def load_time(blocks, block_bytes, link_bps):
    """``(bytes, seconds)`` of loading ``blocks`` blocks from the CPU tier (see module
    doc: the swap copy rule over the same link)."""
    return kvr.swap_copy(blocks, block_bytes, link_bps)


@kernel
def load_charge(loaded, block_size, block_bytes, link_bps):
    """What an admission that loads ``loaded`` blocks from the tier is charged, for every
    executor: ``(tokens loaded, seconds of the copy)``."""
    return loaded * block_size, load_time(loaded, block_bytes, link_bps)[1]


# -- the tier's own LRU -----------------------------------------------------------------
@kernel
def touch(c, key):
    """Make ``key``'s block the most recently used; False when the tier lacks it."""
    b = block_of(c, key)
    if b < 0:
        return False
    _lru_remove(c, b)
    _lru_append(c, b)
    return True


@kernel
def store(c, n, key):
    """Copy the block named ``key`` into the tier (1), or touch it if held (0): a free
    slot, else the least recently used one's (its key forgotten). A tier of 0 blocks
    drops it (0)."""
    if c[H_CAP] == 0:
        return 0
    if touch(c, key):
        return 0
    b, evicted = pop_or_evict(c)
    if evicted:
        n[C_EVICTED] += 1
    _map_put(c, key, b)
    c[_key(c, b)] = key
    _lru_append(c, b)
    n[C_STORED] += 1
    return 1


@kernel
def store_run(c, n, keys, lo, hi):
    """Store ``keys[lo:hi]`` (blocks just computed), last first: the first ends most
    recently used. Returns the blocks copied."""
    got = 0
    for i in range(hi - 1, lo - 1, -1):
        got += store(c, n, keys[i])
    return got


# -- what an admission finds in each tier -----------------------------------------------
@kernel
def tier_hits(p, c, keys, tokens, block_size):
    """``(GPU leading keys, GPU usable blocks, CPU keys after them, CPU usable blocks)``
    of a prompt of ``tokens`` tokens (see module doc)."""
    found, h = pc.leading_hits(p, keys, tokens, block_size)
    use = pc.usable_blocks(tokens, block_size)
    if c[H_CAP] == 0 or found >= use:     # nothing, or the GPU hit is capped already
        return found, h, 0, 0
    full = pc.full_blocks(keys, tokens, block_size)
    j = found
    while j < full and block_of(c, keys[j]) >= 0:
        j += 1
    cf = j - found
    return found, h, cf, (cf if found + cf <= use else use - found)


@kernel
def price(p, c, keys, tokens, block_size):
    """``(cached tokens, blocks taken from the free pool, blocks to load)`` of admitting
    the prompt now: GPU and CPU hits skip their prefill; the blocks are the GPU rule's
    (a loaded block takes a new GPU block, as a recomputed one does)."""
    _, h, need = pc.price(p, keys, tokens, block_size)
    cu = tier_hits(p, c, keys, tokens, block_size)[3]
    return (h + cu) * block_size, need, cu


@kernel
def allocate(p, t, c, n, keys, tokens, block_size):
    """``prefixcache.allocate`` with the CPU tier: the blocks after the GPU hit that the
    tier holds are loaded (named in the GPU cache now). Returns ``(cached tokens, blocks
    loaded)``, or ``(-1, 0)`` (nothing changed) when the pool cannot supply the rest."""
    _, h, cf, cu = tier_hits(p, c, keys, tokens, block_size)
    cached = pc.allocate(p, t, keys, tokens, block_size)
    if cached < 0:
        return -1, 0
    for i in range(pc.full_blocks(keys, tokens, block_size) - 1, -1, -1):
        touch(c, keys[i])
    if cu > 0:
        pc.register(p, t, keys, (h + cu) * block_size, block_size)
    n[C_HITS] += cf
    n[C_LOADED] += cu
    return cached + cu * block_size, cu


def lru_keys(c: np.ndarray) -> list:
    """The tier's keys, least recently used first (for tests and tools)."""
    buf = np.empty(int(c[H_CAP]), dtype=np.int64)
    m = stack_ids(c, 2, buf)
    return [int(c[_key(c, int(b))]) for b in buf[:m]]


def holds(c: np.ndarray, key: int) -> bool:
    """Whether the tier holds ``key``."""
    return bool(c[H_CAP]) and int(block_of(c, np.int64(key))) >= 0


def warm_up() -> None:
    """Compile (or load from numba's cache) the tier's kernels now."""
    p = new_pool(4)
    c, n = new_tier(4)
    t = pc.new_table()
    keys = np.array([1, 2, 3], dtype=np.int64)
    price(p, c, keys, 40, 16)
    allocate(p, t, c, n, keys, 40, 16)
    store_run(c, n, keys, 0, 2)
    load_time(2, 1.0, 1.0)
    pc.release(p, t, keys, 0)
