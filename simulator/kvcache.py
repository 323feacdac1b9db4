"""Paged KV-cache block accounting, shared by the simulator and ``real_engine``.

A KV cache is split into fixed-size blocks of ``block_size`` token slots (16 by
default, as in vLLM). A request reserves whole blocks; the allocator hands out
physical block ids from a free list and takes them back when the request ends or
is cancelled. The simulator only needs the counts (``num_free``); the real
engine also needs the ids, to address its KV tensors. Using one implementation
for both keeps their admission decisions identical.

Pure Python, no torch: the simulator must not depend on the engine's stack.
"""
from __future__ import annotations

from typing import Iterable

DEFAULT_BLOCK_SIZE = 16


def blocks_for(tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks needed to hold ``tokens`` KV entries (ceil division; 0 tokens -> 0 blocks)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return -(-tokens // block_size)


def request_blocks(prompt_tokens: int, output_tokens: int,
                   block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks a request reserves at admission: room for its prompt plus all its output.

    This is the one definition of ``Seq.blocks_needed`` both executors use. (The
    last output token is never fed back, so one slot is spare; reserving
    ``prompt + output`` keeps the rule simple and the same everywhere.)
    """
    return blocks_for(prompt_tokens + output_tokens, block_size)


class BlockAllocator:
    """A free list of physical block ids ``0 .. capacity-1``.

    ``allocate(n)`` takes ``n`` ids (lowest first on a fresh allocator, so runs
    are deterministic), ``free(ids)`` returns them. Freed ids are reused last-in
    first-out, which keeps recently touched blocks hot. Double frees and foreign
    ids raise, because a silent leak or double use of a block would corrupt
    another request's KV in the real engine.
    """

    __slots__ = ("_capacity", "_free", "_used")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity = int(capacity)
        # A stack: pop() from the end, so put the lowest ids at the end.
        self._free: list[int] = list(range(self._capacity - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def capacity(self) -> int:
        """Total blocks managed."""
        return self._capacity

    @property
    def num_free(self) -> int:
        """Blocks not reserved by anyone (what a policy may still admit against)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks currently reserved."""
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` blocks are free right now."""
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Reserve ``n`` blocks and return their ids; raises if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise MemoryError(f"KV cache full: asked for {n} blocks, {len(self._free)} free "
                              f"of {self._capacity}")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return blocks to the free list; raises on a block that is not reserved."""
        ids = list(ids)
        # Check everything first so a bad id leaves the allocator unchanged.
        if len(set(ids)) != len(ids) or any(i not in self._used for i in ids):
            bad = next((i for i in ids if i not in self._used or ids.count(i) > 1), None)
            raise ValueError(f"block {bad} is not allocated (double free or foreign id)")
        self._used.difference_update(ids)
        # Reverse so the first id of the request is the next one handed out again.
        self._free.extend(reversed(ids))

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"BlockAllocator(free={self.num_free}/{self._capacity})"
