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

``CountingKV`` is the same accounting without block ids: what the simulator uses
when prefix caching is off (it needs only counts, and a request of 1,000 tokens
then costs O(1) instead of O(blocks)).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional, Sequence

from simulator.model.kv.blocks import DEFAULT_BLOCK_SIZE, blocks_for


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
                 "evictions", "admissions")

    def __init__(self) -> None:
        self.queried_blocks = 0   # full prompt blocks looked up at admission
        self.hit_blocks = 0       # of those, found cached (longest leading run)
        self.queried_tokens = 0   # prompt tokens admitted
        self.cached_tokens = 0    # prompt tokens whose prefill a hit skipped
        self.evictions = 0        # cached blocks dropped to make room
        self.admissions = 0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class CountingKV:
    """Paged/contiguous block accounting by counts only (no ids, no prefix cache)."""

    prefix_caching = False

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

    ``table(rid)`` gives a request's block ids in token order; the real engine
    addresses its K/V tensors with them. Shared (hit) blocks appear in several
    tables at once; their refcount is the number of tables holding them.
    """

    def __init__(self, capacity: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 prefix_caching: bool = True) -> None:
        self.capacity, self.block_size = _checked(capacity, block_size)
        self.prefix_caching = bool(prefix_caching)
        # Never-cached free blocks, a stack with the lowest id on top (deterministic ids).
        self._free: list[int] = list(range(self.capacity - 1, -1, -1))
        # Cached blocks nobody references, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref = [0] * self.capacity
        self._key_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self._tables: dict[int, list[int]] = {}
        self._registered: dict[int, int] = {}   # rid -> leading blocks registered
        self.stats = KVStats()

    # -- queries ------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: never-cached free plus evictable cached."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks that hold a registered prefix (referenced or evictable)."""
        return len(self._block_of)

    @property
    def shared_refs(self) -> int:
        """References beyond the first on shared blocks: blocks a cache-less engine
        would have had to allocate on top of ``num_used``."""
        return sum(len(t) for t in self._tables.values()) - self.num_used

    def holds(self, rid: int) -> bool:
        return rid in self._tables

    def blocks_of(self, rid: int) -> int:
        t = self._tables.get(rid)
        return 0 if t is None else len(t)

    def table(self, rid: int) -> list[int]:
        """Block ids of ``rid`` in token order."""
        return self._tables[rid]

    def _leading_hits(self, keys: Optional[Sequence], tokens: int) -> tuple[int, int]:
        """(leading keys cached, usable hit blocks) for a prompt of ``tokens`` tokens."""
        if not self.prefix_caching or not keys:
            return 0, 0
        full = min(len(keys), tokens // self.block_size)
        cache = self._block_of
        h = 0
        while h < full and keys[h] in cache:
            h += 1
        return h, min(h, (tokens - 1) // self.block_size)

    def _price(self, tokens: int, keys: Optional[Sequence]) -> tuple[int, int, int]:
        """(leading keys cached, usable hit blocks, blocks taken from the free pool)."""
        found, h = self._leading_hits(keys, tokens)
        need = blocks_for(tokens, self.block_size) - h
        if h:
            ref = self._ref
            cache = self._block_of
            need += sum(1 for i in range(h) if ref[cache[keys[i]]] == 0)
        return found, h, need

    def admission(self, tokens: int, keys: Optional[Sequence] = None) -> tuple[int, int]:
        """``(cached_tokens, blocks taken from the free pool)`` if admitted now: the
        new blocks plus the hit blocks that are evictable (they leave the free pool)."""
        _, h, need = self._price(tokens, keys)
        return h * self.block_size, need

    # -- mutations ----------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        """``n`` blocks from the free pool, evicting least recently freed cached ones."""
        if n > self.num_free:
            raise MemoryError(f"KV cache full: need {n} blocks, {self.num_free} free "
                              f"of {self.capacity}")
        out = []
        free = self._free
        for _ in range(n):
            if free:
                b = free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._block_of[self._key_of.pop(b)]
                self.stats.evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def allocate(self, rid: int, tokens: int, keys: Optional[Sequence] = None) -> int:
        """Give ``rid`` blocks for ``tokens`` tokens, sharing its cached prefix;
        returns the cached tokens (their prefill is skipped). Raises ``MemoryError``
        (changing nothing) when the pool cannot supply the rest."""
        if rid in self._tables:
            raise ValueError(f"request {rid} already holds blocks")
        found, h, need = self._price(tokens, keys)
        cached_tokens = h * self.block_size
        if need > self.num_free:
            raise MemoryError(f"KV cache full: request {rid} needs {need} blocks, "
                              f"{self.num_free} free of {self.capacity}")
        hits = []
        ref = self._ref
        for i in range(h):
            b = self._block_of[keys[i]]
            if ref[b] == 0:
                del self._evictable[b]
            ref[b] += 1
            hits.append(b)
        self._tables[rid] = hits + self._take(blocks_for(tokens, self.block_size) - h)
        self._registered[rid] = h
        st = self.stats
        st.admissions += 1
        st.queried_tokens += tokens
        st.cached_tokens += cached_tokens
        if self.prefix_caching and keys:
            st.queried_blocks += min(len(keys), tokens // self.block_size)
            st.hit_blocks += found
        return cached_tokens

    def grow(self, rid: int, tokens: int) -> int:
        """Make ``rid`` hold room for ``tokens`` tokens; returns blocks added.
        Raises ``MemoryError`` (changing nothing) when the pool cannot supply them."""
        table = self._tables[rid]
        need = blocks_for(tokens, self.block_size) - len(table)
        if need <= 0:
            return 0
        table.extend(self._take(need))
        return need

    def register(self, rid: int, keys: Optional[Sequence], computed_tokens: int) -> None:
        """Name ``rid``'s full blocks among its first ``computed_tokens`` tokens by
        their keys, so later requests can hit them. A key already cached in another
        block is left there (the duplicate block stays private and unnamed)."""
        if not self.prefix_caching or not keys:
            return
        upto = min(len(keys), computed_tokens // self.block_size, len(self._tables[rid]))
        i = self._registered.get(rid, 0)
        if i >= upto:
            return
        table = self._tables[rid]
        cache = self._block_of
        key_of = self._key_of
        for j in range(i, upto):
            k = keys[j]
            b = table[j]
            if k not in cache and b not in key_of:
                cache[k] = b
                key_of[b] = k
        self._registered[rid] = upto

    def free(self, rid: int) -> int:
        """Release ``rid``'s blocks; cached ones become evictable, last block first."""
        table = self._tables.pop(rid)
        self._registered.pop(rid, None)
        ref = self._ref
        for b in reversed(table):
            ref[b] -= 1
            if ref[b] == 0:
                if b in self._key_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        return len(table)

    def check(self) -> None:
        """Raise ``AssertionError`` on any inconsistency: every block is exactly one
        of free / evictable / referenced, refcounts equal table membership, and only
        cached blocks are evictable."""
        counts = [0] * self.capacity
        for t in self._tables.values():
            for b in t:
                counts[b] += 1
        assert counts == self._ref, "refcounts differ from block tables"
        free = set(self._free)
        ev = set(self._evictable)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & ev, "a block is both free and evictable"
        used = {b for b in range(self.capacity) if self._ref[b] > 0}
        assert not used & (free | ev), "a referenced block is in the free pool"
        assert len(used) + len(free) + len(ev) == self.capacity, "a block is lost"
        assert all(b in self._key_of for b in ev), "an unnamed block is evictable"
        assert not free & set(self._key_of), "a never-cached free block has a key"
        assert all(self._block_of[k] == b for b, k in self._key_of.items()), "key maps differ"


def make_kv_manager(capacity: int, block_size: int = DEFAULT_BLOCK_SIZE, *,
                    prefix_caching: bool = False, track_ids: bool = False):
    """The cheapest manager that supports what is asked: ids are needed for prefix
    caching and by the real engine; counts suffice otherwise."""
    if prefix_caching or track_ids:
        return PrefixKV(capacity, block_size, prefix_caching=prefix_caching)
    return CountingKV(capacity, block_size)
