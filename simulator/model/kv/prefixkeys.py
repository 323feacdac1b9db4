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
  token plus that token's offset in it (``id * hash_block + offset``), which pins
  both the prefix and the position, whatever ``block_size`` is.
- **A shared system prompt** per priority class (synthetic traffic): the blocks
  wholly inside the first ``n`` tokens are named by ``class << 32 | j``; the
  rest of the prompt is unique to the request and gets no key (it can never hit).

Keys are int64 (the prefix cache's kernels, ``prefixcache``, map them to blocks); the
hash-id and system-prompt keys are kernels, so the compiled loop builds every request's
keys with the same rule (``WorkloadKeys.flat``).

A key list may be shorter than the prompt's full blocks: a lookup stops at the end
of the list, and unnamed blocks are never cached.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from simulator.kernel import kernel


def keys_from_tokens(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chain-hash keys of the full blocks of ``token_ids``."""
    ids = np.asarray(token_ids, dtype=np.int64)
    keys: list[int] = []
    prev = 0
    for j in range(len(ids) // block_size):
        prev = hash((prev, tuple(ids[j * block_size:(j + 1) * block_size].tolist())))
        keys.append(prev)
    return keys


@kernel
def hash_block_keys(hash_ids, prompt_tokens, block_size, hash_block, out):
    """Keys of the full KV blocks of a prompt described by trace hash ids, into
    ``out``; returns how many. Block ``j`` is named by the hash id of the unit holding
    its last token, times ``hash_block``, plus that token's offset in the unit (an int64
    naming both the prefix and the position); the list stops at the last unit."""
    n_ids = hash_ids.shape[0]
    n = 0
    for j in range(prompt_tokens // block_size):
        last = (j + 1) * block_size - 1
        unit = last // hash_block
        if unit >= n_ids:
            break
        out[n] = hash_ids[unit] * hash_block + last % hash_block
        n += 1
    return n


@kernel
def system_prompt_keys(group, shared_tokens, block_size, out):
    """Keys of the blocks wholly inside a class's shared system prompt, into ``out``
    (``group << 32 | j``); returns how many."""
    n = shared_tokens // block_size
    for j in range(n):
        out[j] = (group << 32) | j
    return n


def keys_from_hash_ids(hash_ids: Sequence[int], prompt_tokens: int, block_size: int,
                       hash_block: int = 512) -> np.ndarray:
    """Keys of the full KV blocks of a prompt described by trace hash ids."""
    out = np.empty(prompt_tokens // block_size, dtype=np.int64)
    n = hash_block_keys(np.asarray(hash_ids, dtype=np.int64), int(prompt_tokens),
                        block_size, hash_block, out)
    return out[:n]


def keys_for_system_prompt(group: int, shared_tokens: int, block_size: int) -> np.ndarray:
    """Keys of the blocks wholly inside a class's shared system prompt."""
    out = np.empty(max(shared_tokens // block_size, 0), dtype=np.int64)
    return out[:system_prompt_keys(int(group), int(shared_tokens), block_size, out)]


@kernel
def flat_hash_keys(ids, id_off, prompt, block_size, hash_block, out, off):
    """Every request's ``hash_block_keys`` into ``out``, request ``i``'s at
    ``out[off[i]:off[i + 1]]`` (``off`` is filled here; ``out`` holds ``sum(prompt //
    block_size)``)."""
    off[0] = 0
    for i in range(prompt.shape[0]):
        k = off[i]
        n = hash_block_keys(ids[id_off[i]:id_off[i + 1]], prompt[i], block_size,
                            hash_block, out[k:])
        off[i + 1] = k + n


@kernel
def flat_system_keys(group, shared, block_size, out, off):
    """Every request's ``system_prompt_keys`` into ``out`` (as ``flat_hash_keys``)."""
    off[0] = 0
    for i in range(group.shape[0]):
        k = off[i]
        off[i + 1] = k + system_prompt_keys(group[i], shared[i], block_size, out[k:])


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

    def __call__(self, rid: int) -> Optional[np.ndarray]:
        wl = self.wl
        if wl.hash_ids is not None:
            return keys_from_hash_ids(wl.hash_ids[rid], int(wl.prompt_tokens[rid]),
                                      self.block_size, self.hash_block)
        if wl.shared_prefix_tokens is not None:
            n = int(wl.shared_prefix_tokens[rid])
            return keys_for_system_prompt(int(wl.priority[rid]), n, self.block_size) if n else None
        return None

    def flat(self) -> tuple[np.ndarray, np.ndarray]:
        """Every request's keys in one array and each one's offsets into it (what
        ``__call__`` gives request ``i`` is ``keys[off[i]:off[i + 1]]``; none: empty)."""
        wl = self.wl
        n = len(wl.prompt_tokens)
        prompt = np.ascontiguousarray(wl.prompt_tokens, dtype=np.int64)
        off = np.zeros(n + 1, dtype=np.int64)
        bs = self.block_size
        if wl.hash_ids is not None:
            lens = np.fromiter((len(h) for h in wl.hash_ids), np.int64, n)
            id_off = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lens, out=id_off[1:])
            ids = (np.concatenate([np.asarray(h, dtype=np.int64) for h in wl.hash_ids])
                   if n else np.zeros(0, np.int64))
            out = np.empty(int((prompt // bs).sum()), dtype=np.int64)
            flat_hash_keys(ids, id_off, prompt, bs, self.hash_block, out, off)
            return out[:off[-1]], off
        if wl.shared_prefix_tokens is not None:
            shared = np.ascontiguousarray(wl.shared_prefix_tokens, dtype=np.int64)
            out = np.empty(int((np.maximum(shared, 0) // bs).sum()), dtype=np.int64)
            flat_system_keys(np.ascontiguousarray(wl.priority, dtype=np.int64), shared, bs,
                             out, off)
            return out, off
        return np.zeros(0, dtype=np.int64), off
