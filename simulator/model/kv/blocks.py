"""Block arithmetic of a paged KV cache: a cache is split into blocks of
``block_size`` token slots (16 by default, as in vLLM) and a request holds whole
blocks. Who holds which block is the block manager's job (``manager``).

Pure Python, no torch: the simulator must not depend on the engine's stack. The
block count itself is the memory rules' ``ceil_blocks`` (``rules``).
"""
from __future__ import annotations

from simulator.kernel import python_of
from simulator.model.kv.rules import ceil_blocks

_ceil_blocks = python_of(ceil_blocks)     # called per request and per block: no dispatch

DEFAULT_BLOCK_SIZE = 16


def blocks_for(tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks needed to hold ``tokens`` KV entries (ceil division; 0 tokens -> 0 blocks)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return _ceil_blocks(tokens, block_size)


def request_blocks(prompt_tokens: int, output_tokens: int,
                   block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks a request needs by its end: its prompt plus all its output (what a
    contiguous reservation of its own length takes; ``Seq.blocks_needed``, the
    admission price when no ``KVSpace`` prices it). The last output token is never
    fed back, so one slot is spare; ``prompt + output`` keeps the rule simple."""
    return blocks_for(prompt_tokens + output_tokens, block_size)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, elem_bytes: float) -> float:
    """Bytes one token's K and V take in the cache: a key and a value of ``head_dim``
    elements per KV head, in every layer (a GPU's share: its layers and its heads)."""
    return 2 * layers * kv_heads * head_dim * elem_bytes
