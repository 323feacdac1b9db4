"""KV-cache block managers: who holds which blocks, and which blocks hold a known prefix.

One implementation serves the simulator and ``real_engine`` (like the policies), so
their admission, growth, preemption and prefix-hit decisions are the same.

A request holds a *block table*: the blocks that store its KV, in token order.
Blocks come from a pool of ``capacity`` blocks of ``block_size`` token slots.

- **paged** allocation (vLLM's PagedAttention): at admission a request takes the
  blocks of its prompt; while it decodes it takes one more block each time its
  context crosses a block boundary (``grow``). Memory follows the tokens actually
  held, so utilisation (tokens / reserved slots) is near 100%.
- **contiguous** allocation (engines before paged attention): the request
  reserves its maximum length at admission and never grows. The difference between
  the two is a different ``tokens`` argument to ``allocate``; the executor picks it.

**Prefix caching** (``PrefixKV``). A full block's content is named by a *key*: the
chain of everything before it (see ``prefixkeys``). A computed full block is
registered under its key; when its last holder frees it, it stays in the pool as
*evictable* (content intact, refcount 0) and is reused on a hit, or evicted in
least-recently-freed order when a block is needed and no never-cached block is
free. A request's hit is the longest run of leading keys found in the cache; at
least one prompt token is always recomputed (the step must produce logits), so
the usable hit is capped at ``(tokens - 1) // block_size`` blocks. When a request
frees its blocks they join the LRU tail-first (its last block is evicted first),
as vLLM does, because a later request is likelier to share the beginning of a
prompt than its end.

**CPU tier** (``PrefixKV(cpu_blocks=...)``, ``engine.kv.offload``): computed prompt
blocks are also copied to a CPU-memory tier with its own LRU, and an admission whose
leading run goes on there loads those blocks instead of recomputing them (the rules:
``offload``). ``loaded`` says how many blocks the last ``allocate`` loaded.

``CountingKV`` is the same accounting without block ids: what the simulator uses
when prefix caching is off (it needs only counts, and a request of 1,000 tokens
then costs O(1) instead of O(blocks)).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from simulator.model.kv import offload as off
from simulator.model.kv import prefixcache as pc
from simulator.model.kv.blocks import DEFAULT_BLOCK_SIZE, blocks_for

_NO_KEYS = np.zeros(0, dtype=np.int64)
_INTERN_BASE = -(2 ** 62)


def _checked(capacity: int, block_size: int) -> tuple[int, int]:
    """A pool's size and block size as ints, or ``ValueError``."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return int(capacity), int(block_size)


class KVStats:
    """Counters every manager keeps (prefix-cache ones stay 0 without caching)."""

    __slots__ = ("queried_blocks", "hit_blocks", "queried_tokens", "cached_tokens",
                 "evictions", "admissions", "cpu_hit_blocks", "loaded_blocks",
                 "stored_blocks", "cpu_evictions")

    def __init__(self) -> None:
        self.queried_blocks = 0   # full prompt blocks looked up at admission
        self.hit_blocks = 0       # of those, found cached (longest leading run)
        self.queried_tokens = 0   # prompt tokens admitted
        self.cached_tokens = 0    # prompt tokens whose prefill a hit skipped
        self.evictions = 0        # cached blocks dropped to make room
        self.admissions = 0
        # The CPU tier (``offload``; 0 without one): blocks found there after the GPU's
        # run (``cached_tokens`` counts only the GPU's), loaded from it, copied to it,
        # dropped from it.
        self.cpu_hit_blocks = 0
        self.loaded_blocks = 0
        self.stored_blocks = 0
        self.cpu_evictions = 0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class CountingKV:
    """Paged/contiguous block accounting by counts only (no ids, no prefix cache)."""

    prefix_caching = False
    loaded = 0          # no CPU tier: nothing is ever loaded

    def __init__(self, capacity: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.capacity, self.block_size = _checked(capacity, block_size)
        self.num_free = self.capacity
        self._held: dict[int, int] = {}
        self.stats = KVStats()

    @property
    def num_used(self) -> int:
        """Blocks held by requests."""
        return self.capacity - self.num_free

    def holds(self, rid: int) -> bool:
        return rid in self._held

    def blocks_of(self, rid: int) -> int:
        """Blocks ``rid`` holds now (0 if none)."""
        return self._held.get(rid, 0)

    def admission(self, tokens: int, keys: Optional[Sequence] = None) -> tuple[int, int]:
        """``(cached_tokens, blocks taken from the free pool)`` if admitted now."""
        return 0, blocks_for(tokens, self.block_size)

    def allocate(self, rid: int, tokens: int, keys: Optional[Sequence] = None) -> int:
        """Give ``rid`` the blocks of ``tokens`` tokens; returns the cached tokens (0)."""
        n = blocks_for(tokens, self.block_size)
        if rid in self._held:
            raise ValueError(f"request {rid} already holds blocks")
        if n > self.num_free:
            raise MemoryError(f"KV cache full: request {rid} needs {n} blocks, "
                              f"{self.num_free} free of {self.capacity}")
        self.num_free -= n
        self._held[rid] = n
        st = self.stats
        st.admissions += 1
        st.queried_tokens += tokens
        return 0

    def grow(self, rid: int, tokens: int) -> int:
        """Make ``rid`` hold room for ``tokens`` tokens; returns blocks added.
        Raises ``MemoryError`` (changing nothing) when the pool cannot supply them."""
        need = blocks_for(tokens, self.block_size) - self._held[rid]
        if need <= 0:
            return 0
        if need > self.num_free:
            raise MemoryError(f"KV cache full: request {rid} needs {need} more blocks, "
                              f"{self.num_free} free")
        self.num_free -= need
        self._held[rid] += need
        return need

    def register(self, rid: int, keys: Optional[Sequence], computed_tokens: int) -> None:
        """Prefix caching off: nothing to register."""

    def free(self, rid: int) -> int:
        """Release every block of ``rid`` (finish, cancel, preemption); returns how many."""
        n = self._held.pop(rid)
        self.num_free += n
        return n

    def check(self) -> None:
        """Raise ``AssertionError`` if the accounting is inconsistent."""
        held = sum(self._held.values())
        assert 0 <= self.num_free <= self.capacity, (self.num_free, self.capacity)
        assert held + self.num_free == self.capacity, (held, self.num_free, self.capacity)


class PrefixKV:
    """Block ids with reference counts and an optional prefix cache (see module doc).

    The state is one pool array and a table row per request, and every rule is a
    ``prefixcache`` kernel: the compiled loop runs the same kernels on its own pools.
    Keys are int64 (``prefixkeys`` makes them so); any other hashable key is given an
    int64 id of its own (``_ids``), so a test or a tool may name blocks as it likes.

    ``table(rid)`` gives a request's block ids in token order; the real engine
    addresses its K/V tensors with them. Shared (hit) blocks appear in several
    tables at once; their refcount is the number of tables holding them.
    """

    def __init__(self, capacity: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 prefix_caching: bool = True, cpu_blocks: Optional[int] = None) -> None:
        self.capacity, self.block_size = _checked(capacity, block_size)
        self.prefix_caching = bool(prefix_caching)
        self.pool = pc.new_pool(self.capacity, self.prefix_caching)
        # The CPU tier (``offload``: its pool and counters), or None.
        self.tier = None
        if cpu_blocks is not None:
            if not self.prefix_caching:
                raise ValueError("a CPU tier needs prefix caching")
            self.tier = off.new_tier(cpu_blocks)
        self.loaded = 0
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # rid -> (row, keys)
        self._intern: dict = {}

    # -- keys ---------------------------------------------------------------------------
    def _ids(self, keys: Optional[Sequence]) -> np.ndarray:
        """``keys`` as an int64 array: ints as they are, other keys by an id of their
        own (below -2^62, where no ``prefixkeys`` key lies)."""
        if keys is None or not self.prefix_caching:
            return _NO_KEYS
        if isinstance(keys, np.ndarray) and keys.dtype == np.int64:
            return keys
        out = np.empty(len(keys), dtype=np.int64)
        intern = self._intern
        for i, k in enumerate(keys):
            if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
                out[i] = k
            else:
                v = intern.get(k)
                if v is None:
                    v = intern[k] = _INTERN_BASE + len(intern)
                out[i] = v
        return out

    # -- queries ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: never-cached free plus evictable cached."""
        p = self.pool
        return int(p[pc.H_NFREE] + p[pc.H_NEVICT])

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks that hold a registered prefix (referenced or evictable)."""
        return int(self.pool[pc.H_NCACHED])

    @property
    def shared_refs(self) -> int:
        """References beyond the first on shared blocks: blocks a cache-less engine
        would have had to allocate on top of ``num_used``."""
        return int(self.pool[pc.H_NREFS]) - self.num_used

    @property
    def stats(self) -> KVStats:
        return pool_stats(self.pool, None if self.tier is None else self.tier[1])

    def holds(self, rid: int) -> bool:
        return rid in self._tables

    def blocks_of(self, rid: int) -> int:
        e = self._tables.get(rid)
        return 0 if e is None else int(e[0][pc.T_H] + e[0][pc.T_NOWN])

    def table(self, rid: int) -> list[int]:
        """Block ids of ``rid`` in token order."""
        row, keys = self._tables[rid]
        out = np.empty(int(row[pc.T_H] + row[pc.T_NOWN]), dtype=np.int64)
        pc.table_ids(self.pool, row, keys, out)
        return out.tolist()

    def admission(self, tokens: int, keys: Optional[Sequence] = None) -> tuple[int, int]:
        """``(cached_tokens, blocks taken from the free pool)`` if admitted now: the
        new blocks plus the hit blocks that are evictable (they leave the free pool)."""
        if self.tier is not None:
            cached, need, _ = off.price(self.pool, self.tier[0], self._ids(keys), tokens,
                                        self.block_size)
            return int(cached), int(need)
        _, h, need = pc.price(self.pool, self._ids(keys), tokens, self.block_size)
        return h * self.block_size, need

    # -- mutations ----------------------------------------------------------------------
    def allocate(self, rid: int, tokens: int, keys: Optional[Sequence] = None) -> int:
        """Give ``rid`` blocks for ``tokens`` tokens, sharing its cached prefix;
        returns the cached tokens (their prefill is skipped). Raises ``MemoryError``
        (changing nothing) when the pool cannot supply the rest."""
        if rid in self._tables:
            raise ValueError(f"request {rid} already holds blocks")
        ids = self._ids(keys)
        row = pc.new_table()
        if self.tier is None:
            cached = pc.allocate(self.pool, row, ids, tokens, self.block_size)
        else:
            cached, loaded = off.allocate(self.pool, row, *self.tier, ids, tokens,
                                          self.block_size)
            self.loaded = int(loaded)
        if cached < 0:
            need = pc.price(self.pool, ids, tokens, self.block_size)[2]
            raise MemoryError(f"KV cache full: request {rid} needs {need} blocks, "
                              f"{self.num_free} free of {self.capacity}")
        self._tables[rid] = (row, ids)
        return int(cached)

    def grow(self, rid: int, tokens: int) -> int:
        """Make ``rid`` hold room for ``tokens`` tokens; returns blocks added.
        Raises ``MemoryError`` (changing nothing) when the pool cannot supply them."""
        row = self._tables[rid][0]
        got = pc.grow(self.pool, row, tokens, self.block_size)
        if got < 0:
            raise MemoryError(f"KV cache full: request {rid} needs more blocks, "
                              f"{self.num_free} free")
        return int(got)

    def register(self, rid: int, keys: Optional[Sequence], computed_tokens: int) -> None:
        """Name ``rid``'s full blocks among its first ``computed_tokens`` tokens by
        their keys, so later requests can hit them. A key already cached in another
        block is left there (the duplicate block stays private and unnamed)."""
        if not self.prefix_caching or keys is None or not len(keys):
            return
        row, ids = self._tables[rid][0], self._ids(keys)
        lo = int(row[pc.T_REG])
        pc.register(self.pool, row, ids, computed_tokens, self.block_size)
        if self.tier is not None and row[pc.T_REG] > lo:
            # Write-through: the blocks just computed go to the CPU tier (``offload``).
            off.store_run(*self.tier, ids, lo, int(row[pc.T_REG]))

    def free(self, rid: int) -> int:
        """Release ``rid``'s blocks; cached ones become evictable, last block first."""
        row, keys = self._tables.pop(rid)
        return int(pc.release(self.pool, row, keys, 0))

    def check(self) -> None:
        """Raise ``AssertionError`` on any inconsistency: every block is exactly one
        of free / evictable / referenced, refcounts equal table membership, and only
        cached blocks are evictable."""
        p, cap = self.pool, self.capacity
        counts = [0] * cap
        for rid in self._tables:
            for b in self.table(rid):
                counts[b] += 1
        refs = [int(pc.ref_of(p, b)) for b in range(cap)]
        assert counts == refs, "refcounts differ from block tables"
        assert int(p[pc.H_NLIMBO]) == 0, "blocks left in limbo"
        buf = np.empty(cap, dtype=np.int64)
        free = set(buf[:pc.stack_ids(p, 0, buf)].tolist())
        ev = set(buf[:pc.stack_ids(p, 2, buf)].tolist())
        assert len(free) == int(p[pc.H_NFREE]), "a block is free twice"
        assert len(ev) == int(p[pc.H_NEVICT]), "the LRU is inconsistent"
        assert not free & ev, "a block is both free and evictable"
        used = {b for b in range(cap) if refs[b] > 0}
        assert not used & (free | ev), "a referenced block is in the free pool"
        assert len(used) + len(free) + len(ev) == cap, "a block is lost"
        named = {b for b in range(cap) if pc.key_at(p, b) != pc.EMPTY}
        assert ev <= named, "an unnamed block is evictable"
        assert not free & named, "a never-cached free block has a key"
        assert len(named) == self.num_cached, "the cached count is off"
        assert all(pc.block_of(p, pc.key_at(p, b)) == b for b in named), "key maps differ"
        assert sum(counts) == int(p[pc.H_NREFS]), "the reference total is off"


def pool_stats(p: np.ndarray, tier_counts: Optional[np.ndarray] = None) -> KVStats:
    """A pool's counters (``prefixcache`` header) as ``KVStats``, with its CPU tier's
    (``offload.C_*``) when it has one."""
    st = KVStats()
    if tier_counts is not None:
        n = tier_counts
        st.cpu_hit_blocks, st.loaded_blocks = int(n[off.C_HITS]), int(n[off.C_LOADED])
        st.stored_blocks, st.cpu_evictions = int(n[off.C_STORED]), int(n[off.C_EVICTED])
    st.queried_blocks = int(p[pc.H_QBLOCKS])
    st.hit_blocks = int(p[pc.H_HBLOCKS])
    st.queried_tokens = int(p[pc.H_QTOKENS])
    st.cached_tokens = int(p[pc.H_CTOKENS])
    st.evictions = int(p[pc.H_EVICTIONS])
    st.admissions = int(p[pc.H_ADMISSIONS])
    return st


def make_kv_manager(capacity: int, block_size: int = DEFAULT_BLOCK_SIZE, *,
                    prefix_caching: bool = False, track_ids: bool = False,
                    cpu_blocks: Optional[int] = None):
    """The cheapest manager that supports what is asked: ids are needed for prefix
    caching and by the real engine; counts suffice otherwise. ``cpu_blocks``: a CPU
    tier of that many blocks under the prefix cache (None: none)."""
    if prefix_caching or track_ids:
        return PrefixKV(capacity, block_size, prefix_caching=prefix_caching,
                        cpu_blocks=cpu_blocks if prefix_caching else None)
    return CountingKV(capacity, block_size)
