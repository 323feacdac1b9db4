"""Paged KV cache and the attention of one token-packed step.

Layout. Per layer, K and V are tensors of shape
``[n_kv_heads, num_blocks + 1, block_size, head_dim]``: head-major, then
block-major (a block is the unit of KV memory, see ``simulator.model.kv.manager``).
Gathering a list of blocks along dim 1 gives, for every head, the blocks'
tokens back to back (``[Hkv, n_blocks * block_size, head_dim]``) with no further
copy, which is what both the decode and the prefill attention read. The extra
last block is a scratch block that no request owns: padded rows of a CUDA-graph
step write and read there. The cache starts zeroed so that masked-out slots
never hold NaN.

A step packs tokens of many sequences: first one token per decoding sequence,
then the prefill chunks, each a run of consecutive prompt tokens. The host
describes the step once (``HostStep``: numpy arrays), it is copied to the device
once (``StepMeta``) and every layer reuses it:

- new K/V of every token are written at their slots (``write_kv``);
- decode attention is *paged*: each sequence reads only the blocks its context
  covers, grouped in pages of ``page_blocks`` blocks (64 tokens by default),
  never a batch x max-context rectangle, so its cost follows the **sum of the
  contexts** (each rounded up to a page) -- see ``decode_attention``;
- a prefill chunk attends causally to itself and, if the prompt already has
  ``prior`` cached tokens, to those blocks too (a masked SDPA call, slower than
  the plain causal one, as on real engines).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from simulator.model.kv.blocks import DEFAULT_BLOCK_SIZE, blocks_for
from simulator.model.kv.space import KVRules, KVSpace

# index_reduce_ is stable in practice but still flagged beta; one warning per run is noise.
warnings.filterwarnings("ignore", message="index_reduce\\(\\) is in beta")

# Score of a masked-out key: finite (so 0 * it is 0, never NaN) yet exp() of it is 0.
MASKED_SCORE = -1e30
# Blocks per decode-attention page: the unit one batched-matmul entry reads.
# Bigger pages make fewer, larger matmuls; the padding they add (the rest of a
# sequence's last page) points at the scratch block, masked and cache-resident.
PAGE_BLOCKS = 4


class PagedKVCache:
    """K/V tensors of every layer, addressed by the block tables of a ``KVSpace``.

    Block ids come from ``kv.manager`` (a ``simulator.model.kv.manager.PrefixKV``:
    ``KVSpace(..., track_ids=True)``), the very block manager the simulator uses,
    so admission, growth, preemption and prefix hits are decided by one
    implementation. A shared (prefix-hit) block appears in several tables.
    Without ``kv`` the cache makes its own (paged, no prefix caching).

    ``table(rid)`` is a sequence's block table as a numpy int64 array (what the
    attention gathers with); ``reserve(rid, n)`` gives a sequence ``n`` blocks
    outside any admission rule (tests, profiling); ``release`` frees them.
    ``swap_out``/``swap_in`` copy a sequence's blocks to host tensors and back.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int, *,
                 block_size: int = DEFAULT_BLOCK_SIZE, page_blocks: int = PAGE_BLOCKS,
                 device="cpu", dtype: torch.dtype = torch.float32,
                 kv: Optional[KVSpace] = None) -> None:
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        if kv is None:
            kv = KVSpace(num_blocks, KVRules(block_size=block_size), track_ids=True)
        if kv.capacity != num_blocks or kv.bs != block_size:
            raise ValueError(f"KV space of {kv.capacity} blocks of {kv.bs} tokens for a cache "
                             f"of {num_blocks} blocks of {block_size}")
        if not hasattr(kv.manager, "table"):
            raise ValueError("the KV space must track block ids (KVSpace(..., track_ids=True))")
        self.kv = kv
        self.manager = kv.manager
        self.block_size = block_size
        self.page_blocks = page_blocks
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.dtype = dtype
        shape = (n_kv_heads, num_blocks + 1, block_size, head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(n_layers)]
        self.scratch_block = num_blocks
        # rid -> (the manager's table list, its length then, that table as numpy): the
        # array is rebuilt only when the table grew or was replaced.
        self._np: dict[int, tuple[list, int, np.ndarray]] = {}
        # The fill value of masked scores as a 1-element fp32 tensor: torch.where with
        # it promotes bf16 scores to fp32 in the same kernel.
        self.masked = torch.full((1,), MASKED_SCORE, device=self.device, dtype=torch.float32)

    # -- block tables ---------------------------------------------------------
    def reserve(self, rid: int, n_blocks: int) -> np.ndarray:
        """Give sequence ``rid`` ``n_blocks`` fresh blocks (no admission rule, no prefix
        lookup); returns its block table."""
        self.manager.allocate(rid, n_blocks * self.block_size)
        return self.table(rid)

    def release(self, rid: int) -> int:
        """Free the blocks of ``rid`` (0 if it holds none); returns how many it held."""
        self._np.pop(rid, None)
        if not self.manager.holds(rid):
            return 0
        return self.manager.free(rid)

    def table(self, rid: int) -> np.ndarray:
        """Block ids of ``rid`` in token order (int64; do not modify)."""
        lst = self.manager.table(rid)
        c = self._np.get(rid)
        if c is None or c[0] is not lst or c[1] != len(lst):
            c = (lst, len(lst), np.array(lst, dtype=np.int64))
            self._np[rid] = c
        return c[2]

    def holds(self, rid: int) -> bool:
        return self.manager.holds(rid)

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take (never-cached free plus evictable cached ones)."""
        return self.manager.num_free

    # -- swapping -------------------------------------------------------------------
    def swap_out(self, rid: int) -> tuple[list, list]:
        """Copy the KV of ``rid``'s blocks to host memory; returns ``(k, v)`` lists (one
        ``[n_kv_heads, blocks, block_size, head_dim]`` CPU tensor per layer). The blocks
        stay allocated: free them afterwards."""
        idx = torch.from_numpy(self.table(rid)).to(self.device)
        k = [t.index_select(1, idx).to("cpu") for t in self.k]
        v = [t.index_select(1, idx).to("cpu") for t in self.v]
        return k, v

    def swap_in(self, rid: int, saved: tuple[list, list]) -> None:
        """Write host copies made by ``swap_out`` into the first blocks of ``rid``'s
        (new) table."""
        k, v = saved
        n = k[0].shape[1] if k else 0
        idx = torch.from_numpy(self.table(rid)[:n]).to(self.device)
        for dst, src in zip(self.k + self.v, k + v):
            dst.index_copy_(1, idx, src.to(self.device))

    def rows(self, blk: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Rows of the cache viewed as ``[-1, head_dim]`` of tokens at positions ``pos``
        stored in blocks ``blk``: ``[T, n_kv_heads]`` (head h of token t)."""
        bs = self.block_size
        base = blk * bs + pos % bs
        head = np.arange(self.n_kv_heads, dtype=np.int64) * ((self.num_blocks + 1) * bs)
        return base[:, None] + head[None, :]

    def randomize_(self, seed: int = 0) -> None:
        """Fill every slot with N(0, 1) values (profiling: timings on zeros can flatter)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        for t in self.k + self.v:
            t.normal_(generator=g)


@dataclass
class HostStep:
    """A packed step described on the host (numpy), before any device copy.

    Rows ``0..n_decode-1`` are decode tokens (one per decoding sequence), then the
    prefill chunks in order. ``write_rows[t, h]`` is the cache row (see
    ``PagedKVCache.rows``) of token t's KV head h. Decode attention reads pages:
    ``dec_blocks`` (``page_blocks`` per page), each page's sequence in
    ``dec_owner`` and its visible slots in ``dec_valid`` (``[pages, page_tokens]``).
    ``sample_rows`` are the rows whose logits are sampled: every decode row and
    the last row of every chunk that completes its prompt.
    """

    tokens: np.ndarray
    positions: np.ndarray
    write_rows: np.ndarray
    n_decode: int
    dec_blocks: np.ndarray
    dec_owner: np.ndarray
    dec_valid: np.ndarray
    chunks: list = field(default_factory=list)   # (start, n, prior, attn_blocks | None)
    sample_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_pages(self) -> int:
        return len(self.dec_owner)


@dataclass
class ChunkMeta:
    """One prefill chunk on the device: rows ``start..start+n``, ``prior`` cached tokens."""

    start: int
    n: int
    prior: int
    blocks: Optional[torch.Tensor] = None   # blocks covering prior + n (only if prior > 0)
    mask: Optional[torch.Tensor] = None     # [n, len(blocks) * block_size] bool, True = attend


@dataclass
class StepMeta:
    """What every layer needs to know about the step, on the device."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor                # [T, n_kv_heads]
    n_decode: int
    dec_blocks: Optional[torch.Tensor]      # [pages * page_blocks]
    dec_owner: Optional[torch.Tensor]       # [pages]
    dec_valid: Optional[torch.Tensor]       # [1, pages, 1, page_tokens] bool
    chunks: list
    sample_rows: Optional[torch.Tensor]     # None = every row
    masked: torch.Tensor                    # the fp32 fill value of masked scores


def empty_host_step(cache: PagedKVCache) -> HostStep:
    """A step with no tokens (padding-only CUDA-graph captures start from it)."""
    z = np.zeros(0, np.int64)
    return HostStep(tokens=z, positions=z, write_rows=np.zeros((0, cache.n_kv_heads), np.int64),
                    n_decode=0, dec_blocks=z, dec_owner=z,
                    dec_valid=np.zeros((0, cache.page_blocks * cache.block_size), bool))


def build_host_step(decodes: Sequence[tuple[np.ndarray, int, int]],
                    chunks: Sequence[tuple[np.ndarray, int, np.ndarray, bool]],
                    cache: PagedKVCache) -> HostStep:
    """Describe a packed step.

    ``decodes``: ``(block_table, context, input_token)`` per decoding sequence,
    where ``context`` counts the KV entries the token attends to, itself included
    (its position is ``context - 1``). ``chunks``: ``(block_table, prior,
    token_ids, samples)`` per prefill chunk; ``samples`` says the chunk completes
    its prompt, so its last row is sampled.
    """
    bs, P = cache.block_size, cache.page_blocks
    B = len(decodes)
    h = empty_host_step(cache)
    toks, poss, rows = [], [], []
    if B:
        ctx = np.fromiter((c for _, c, _ in decodes), np.int64, B)
        if ctx.min() < 1:
            raise ValueError("a decode needs context >= 1")
        nblk = -(-ctx // bs)
        npg = -(-nblk // P)
        # Each sequence's blocks, its last page filled up with the scratch block.
        h.dec_blocks = np.full(int(npg.sum()) * P, cache.scratch_block, np.int64)
        starts = np.concatenate([[0], np.cumsum(npg * P)[:-1]])
        for (t, _, _), s, k in zip(decodes, starts.tolist(), nblk.tolist()):
            h.dec_blocks[s:s + k] = t[:k]
        h.dec_owner = np.repeat(np.arange(B, dtype=np.int64), npg)
        first = np.concatenate([[0], np.cumsum(npg)[:-1]])
        local = np.arange(len(h.dec_owner)) - np.repeat(first, npg)     # page index in its seq
        tok = local[:, None] * (P * bs) + np.arange(P * bs)[None, :]
        h.dec_valid = tok < ctx[h.dec_owner][:, None]
        pos = ctx - 1
        blk = np.fromiter((t[p // bs] for (t, _, _), p in zip(decodes, pos.tolist())),
                          np.int64, B)
        toks.append(np.fromiter((t for _, _, t in decodes), np.int64, B))
        poss.append(pos)
        rows.append(cache.rows(blk, pos))
    h.n_decode = B
    sample = list(range(B))
    start = B
    for table, prior, ids, samples in chunks:
        n = len(ids)
        if n < 1:
            raise ValueError("a prefill chunk needs >= 1 token")
        pos = np.arange(prior, prior + n, dtype=np.int64)
        toks.append(np.asarray(ids, dtype=np.int64))
        poss.append(pos)
        rows.append(cache.rows(table[pos // bs], pos))
        attn_blocks = table[:blocks_for(prior + n, bs)] if prior > 0 else None
        h.chunks.append((start, n, prior, attn_blocks))
        if samples:
            sample.append(start + n - 1)
        start += n
    if toks:
        h.tokens, h.positions = np.concatenate(toks), np.concatenate(poss)
        h.write_rows = np.concatenate(rows)
    h.sample_rows = np.asarray(sample, dtype=np.int64)
    return h


def to_device(h: HostStep, cache: PagedKVCache, *, sample_all: bool = False) -> StepMeta:
    """Copy a ``HostStep`` to the cache's device (one small copy per array)."""
    dev = cache.device
    put = (lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev, non_blocking=True))
    chunks = []
    for start, n, prior, blocks in h.chunks:
        if prior > 0:
            L = len(blocks) * cache.block_size
            # Query i sits at position prior + i and sees keys 0 .. prior + i.
            q_pos = torch.arange(prior, prior + n, device=dev)
            mask = torch.arange(L, device=dev)[None, :] <= q_pos[:, None]
            chunks.append(ChunkMeta(start, n, prior, put(blocks), mask))
        else:
            chunks.append(ChunkMeta(start, n, 0))
    dec = h.n_decode > 0
    return StepMeta(
        tokens=put(h.tokens), positions=put(h.positions), write_rows=put(h.write_rows),
        n_decode=h.n_decode,
        dec_blocks=put(h.dec_blocks) if dec else None,
        dec_owner=put(h.dec_owner) if dec else None,
        dec_valid=put(h.dec_valid)[None, :, None, :] if dec else None,
        chunks=chunks, sample_rows=None if sample_all else put(h.sample_rows),
        masked=cache.masked)


# -- attention ----------------------------------------------------------------

def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             rows: torch.Tensor) -> None:
    """Store new K/V (``[T, n_kv_heads, head_dim]``, any strides) at ``rows`` (``[T, Hkv]``)."""
    d = k_cache.shape[-1]
    k_cache.view(-1, d).index_put_((rows,), k)
    v_cache.view(-1, d).index_put_((rows,), v)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: StepMeta, scale: float) -> torch.Tensor:
    """Paged attention of one query token per sequence over its own cached blocks.

    ``q``: ``[B, n_heads, head_dim]`` (any row stride); returns ``[B, n_heads * head_dim]``.

    The batch's pages are laid out flat (``dec_blocks``, owner sequence in
    ``dec_owner``): each page of keys is scored against its owner's query heads
    in one batched matmul, then a softmax is taken per sequence across its pages
    with segment reductions (max, sum) over the owner index. Work and bytes are
    proportional to the number of pages, i.e. the **sum of the contexts**, not
    batch x max context. Shapes depend only on (batch, pages), so the whole
    thing can be captured in a CUDA graph for a padded bucket of both.

    SDPA is not used here: it has no variable-length (paged) batch form, and
    padding every sequence to the longest context is exactly the cost this
    engine avoids. Prefill chunks do use SDPA.
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[0]
    G = Hq // Hkv
    owner = meta.dec_owner
    NP, L = owner.shape[0], meta.dec_valid.shape[-1]
    kp = k_cache.index_select(1, meta.dec_blocks).view(Hkv * NP, L, D)
    vp = v_cache.index_select(1, meta.dec_blocks).view(Hkv, NP, L, D)
    # GQA: query heads h*G .. h*G+G-1 share KV head h (HF repeat_kv convention).
    qp = q.view(B, Hkv, G, D).transpose(0, 1).index_select(1, owner)   # [Hkv, NP, G, D]
    # Scaled scores in one kernel (beta=0 ignores the uninitialised dummy input).
    s = torch.baddbmm(q.new_empty((1, 1, 1)), qp.view(Hkv * NP, G, D), kp.transpose(1, 2),
                      beta=0.0, alpha=scale)
    s = torch.where(meta.dec_valid, s.view(Hkv, NP, G, L), meta.masked)   # fp32
    # Softmax per owner across its pages: max, exp, sum -- in fp32.
    m = torch.empty((Hkv, B, G), device=q.device, dtype=torch.float32)
    m.index_reduce_(1, owner, s.amax(-1), "amax", include_self=False)
    p = torch.exp(s - m.index_select(1, owner).unsqueeze(-1))          # [Hkv, NP, G, L]
    # Per page: unnormalised output and its softmax mass, side by side in fp32 (the
    # cat promotes the bf16 matmul output), summed per owner in one scatter-add.
    part = torch.cat((torch.matmul(p.to(vp.dtype), vp), p.sum(-1, keepdim=True)), dim=-1)
    acc = torch.zeros((Hkv, B, G, D + 1), device=q.device, dtype=torch.float32)
    acc.index_add_(1, owner, part)
    # [Hkv, B, G, D] -> [B, Hq*D], normalised, cast and made contiguous in two kernels.
    # (When no cast is needed, .to returns the permuted view and reshape copies.)
    out = (acc[..., :D] / acc[..., D:]).permute(1, 0, 2, 3)
    return out.to(q.dtype, memory_format=torch.contiguous_format).reshape(B, Hq * D)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: ChunkMeta,
                      scale: float) -> torch.Tensor:
    """Causal attention of a prefill chunk (``q``: ``[n, n_heads, D]``) -> ``[n, n_heads*D]``.

    Without a cached prefix the chunk's own K/V are used directly with SDPA's
    causal kernel. With one, the prompt's blocks are gathered from the cache
    (they already hold this chunk's K/V, written just before) and SDPA runs with
    an explicit mask: query i sees keys ``0 .. prior + i``. KV heads are
    expanded to the query heads explicitly (no host sync, any SDPA backend).
    """
    n, Hq, D = q.shape
    Hkv = k_cache.shape[0]
    G = Hq // Hkv
    if chunk.prior == 0:
        kk, vv, mask = k.transpose(0, 1), v.transpose(0, 1), None      # [Hkv, n, D]
    else:
        kk = k_cache.index_select(1, chunk.blocks).view(Hkv, -1, D)
        vv = v_cache.index_select(1, chunk.blocks).view(Hkv, -1, D)
        mask = chunk.mask
    Lk = kk.shape[1]
    kk = kk.unsqueeze(1).expand(Hkv, G, Lk, D).reshape(Hq, Lk, D)
    vv = vv.unsqueeze(1).expand(Hkv, G, Lk, D).reshape(Hq, Lk, D)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kk.unsqueeze(0),
                                         vv.unsqueeze(0), attn_mask=mask,
                                         is_causal=mask is None, scale=scale)
    return out[0].transpose(0, 1).reshape(n, Hq * D)
