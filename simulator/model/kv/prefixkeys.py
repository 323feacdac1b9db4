"""Names of KV blocks' contents (prefix-cache keys), from whatever a workload knows.

A full block's key must identify everything before and in it: two requests share
a block only if their prompts agree up to that block's last token. Three sources:

- **Token ids** (the real engine): a chain hash, ``key_j = hash((key_{j-1},
  tokens of block j))``. Python's hash of a tuple of ints is deterministic (no
  per-process salt), so keys are stable across runs; a 64-bit collision among a
  few million blocks has a probability below 1e-6.
- **Trace hash ids** (Mooncake: one id per ``hash_block`` = 512 prompt tokens,
  already prefix-chained: equal ids mean equal prefixes). A KV block of
  ``block_size`` tokens is named by the id of the trace block holding its last
  token plus that token's offset in it, which pins both the prefix and the
  position, whatever ``block_size`` is.
- **A shared system prompt** per priority class (synthetic traffic): the blocks
  wholly inside the first ``n`` tokens are named by ``("sys", class, j)``; the
  rest of the prompt is unique to the request and gets no key (it can never hit).

A key list may be shorter than the prompt's full blocks: a lookup stops at the end
of the list, and unnamed blocks are never cached.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def keys_from_tokens(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chain-hash keys of the full blocks of ``token_ids``."""
    ids = np.asarray(token_ids, dtype=np.int64)
    keys: list[int] = []
    prev = 0
    for j in range(len(ids) // block_size):
        prev = hash((prev, tuple(ids[j * block_size:(j + 1) * block_size].tolist())))
        keys.append(prev)
    return keys


def keys_from_hash_ids(hash_ids: Sequence[int], prompt_tokens: int, block_size: int,
                       hash_block: int = 512) -> list[tuple[int, int]]:
    """Keys of the full KV blocks of a prompt described by trace hash ids."""
    n_ids = len(hash_ids)
    keys = []
    for j in range(prompt_tokens // block_size):
        last = (j + 1) * block_size - 1
        unit = last // hash_block
        if unit >= n_ids:
            break
        keys.append((int(hash_ids[unit]), last % hash_block))
    return keys


def keys_for_system_prompt(group: int, shared_tokens: int, block_size: int) -> list[tuple]:
    """Keys of the blocks wholly inside a class's shared system prompt."""
    return [("sys", int(group), j) for j in range(shared_tokens // block_size)]


class WorkloadKeys:
    """Per-request key lists of a workload, built on demand (only when caching is on)."""

    def __init__(self, workload, block_size: int, hash_block: Optional[int] = None) -> None:
        self.wl = workload
        self.block_size = block_size
        self.hash_block = hash_block or int(workload.meta.get("hash_block_tokens", 512))

    @property
    def available(self) -> bool:
        """Whether the workload says anything about shared content."""
        return self.wl.hash_ids is not None or self.wl.shared_prefix_tokens is not None

    def __call__(self, rid: int) -> Optional[list]:
        wl = self.wl
        if wl.hash_ids is not None:
            return keys_from_hash_ids(wl.hash_ids[rid], int(wl.prompt_tokens[rid]),
                                      self.block_size, self.hash_block)
        if wl.shared_prefix_tokens is not None:
            n = int(wl.shared_prefix_tokens[rid])
            return keys_for_system_prompt(int(wl.priority[rid]), n, self.block_size) if n else None
        return None
