"""CUDA graphs for pure-decode steps, so small decode batches are not launch-bound.

An eager decode step of an 8B model launches ~1,300 kernels; at ~5-8 us of host
time each that is a ~8 ms floor, twice the ~3.7 ms it takes an H200 to read the
weights once. Replaying a captured graph issues them all with one call.

A graph has fixed shapes, so steps are padded to a bucket of (batch, number of
KV pages the batch's attention reads; see ``real_engine.kv``) and one graph is
captured per bucket, on first use, into one shared memory pool. The inputs live
in static buffers (sized for the largest bucket; a graph reads slices of them):

- padded batch rows decode token 0 at position 0 and own one page each, made of
  the cache's scratch block with only slot 0 visible; their K/V writes also land
  in the scratch block, so real sequences' KV is never touched;
- padded pages beyond that point at the scratch block too, owned by row 0 and
  fully masked (they add exactly 0 to row 0's softmax sums).

So decode cost follows the sum of the contexts rounded up to a page bucket
(buckets grow by 1.5x/1.33x steps), and the batch rounded up to a batch bucket.

With ``capture=False`` the same padded static-buffer path runs eagerly: that is
how the padding logic is tested on the CPU.
"""
from __future__ import annotations

import bisect
from typing import Optional

import numpy as np
import torch

from real_engine.kv import HostStep, PagedKVCache, StepMeta, empty_host_step
from real_engine.model import Transformer

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224,
                 256, 320, 384, 448, 512)


def page_buckets(max_pages: int) -> list[int]:
    """4, 6, 8, 12, 16, 24, ... (x1.5 then x1.33), the last one >= ``max_pages``."""
    out, k = [], 4
    while True:
        for v in (k, k * 3 // 2):
            out.append(v)
            if v >= max_pages:
                return out
        k *= 2


class DecodeGraphs:
    """Captured decode steps keyed by (batch bucket, page bucket)."""

    def __init__(self, model: Transformer, cache: PagedKVCache, *, max_batch: int = 64,
                 capture: Optional[bool] = None) -> None:
        self.model, self.cache = model, cache
        self.capture = cache.device.type == "cuda" if capture is None else capture
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.max_batch = max_batch
        # A step reads at most every reserved block in pages (each sequence's last one
        # partly empty), plus one page per padded row.
        P = cache.page_blocks
        self.page_buckets = page_buckets(cache.num_blocks // P + 2 * max_batch)
        self.max_pages = self.page_buckets[-1]
        dev, Hkv, bs = cache.device, cache.n_kv_heads, cache.block_size
        i64 = dict(device=dev, dtype=torch.int64)
        self.tokens = torch.zeros(max_batch, **i64)
        self.positions = torch.zeros(max_batch, **i64)
        self.write_rows = torch.zeros(max_batch, Hkv, **i64)
        self.blocks = torch.zeros(self.max_pages * P, **i64)
        self.owner = torch.zeros(self.max_pages, **i64)
        self.valid = torch.zeros(self.max_pages, P * bs, device=dev, dtype=torch.bool)
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool = None
        # Rows of the scratch block's slot 0, one per KV head (padded rows write here).
        self._pad_rows = cache.rows(np.array([cache.scratch_block]), np.array([0]))

    # -- bucketing ----------------------------------------------------------------
    def bucket(self, batch: int, n_pages: int) -> Optional[tuple[int, int]]:
        """The (batch, pages) bucket a decode step runs in, or None if it is too big."""
        if batch > self.max_batch:
            return None
        b = self.batch_buckets[bisect.bisect_left(self.batch_buckets, batch)]
        need = n_pages + (b - batch)
        i = bisect.bisect_left(self.page_buckets, need)
        return (b, self.page_buckets[i]) if i < len(self.page_buckets) else None

    def supports(self, h: HostStep) -> bool:
        """Whether ``h`` is a pure-decode step that fits a bucket."""
        return not h.chunks and h.n_decode > 0 and \
            self.bucket(h.n_decode, h.num_pages) is not None

    # -- running -----------------------------------------------------------------
    def run(self, h: HostStep) -> torch.Tensor:
        """Next-token ids (device tensor ``[B]``) of a pure-decode step."""
        B = h.n_decode
        b, nb = self.bucket(B, h.num_pages)
        self._fill(h, b, nb)
        if not self.capture:
            logits, ids = self._forward(self._meta(b, nb))
            self.graphs[(b, nb)] = (None, logits, ids)   # kept for ``logits()`` only
            return ids[:B]
        entry = self.graphs.get((b, nb))
        if entry is None:
            entry = self._capture(b, nb)
            self._fill(h, b, nb)   # capture ran on padding-only inputs
        entry[0].replay()
        return entry[2][:B]

    def logits(self, b: int, nb: int) -> Optional[torch.Tensor]:
        """The logits output of a bucket's last run (for checks), or None."""
        e = self.graphs.get((b, nb))
        return None if e is None else e[1]

    def _meta(self, b: int, nb: int) -> StepMeta:
        P = self.cache.page_blocks
        return StepMeta(tokens=self.tokens[:b], positions=self.positions[:b],
                        write_rows=self.write_rows[:b], n_decode=b,
                        dec_blocks=self.blocks[:nb * P], dec_owner=self.owner[:nb],
                        dec_valid=self.valid[None, :nb, None, :], chunks=[],
                        sample_rows=None, masked=self.cache.masked)

    def _forward(self, meta: StepMeta) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = self.model.logits(self.model(meta, self.cache))
            return logits, logits.argmax(-1)

    def _fill(self, h: HostStep, b: int, nb: int) -> None:
        """Copy a step into the static buffers, padded to (b, nb pages)."""
        B, NP = h.n_decode, h.num_pages
        pad_rows, pad_pages = b - B, nb - NP - (b - B)
        sb, P = self.cache.scratch_block, self.cache.page_blocks
        tok = np.zeros(b, np.int64)
        tok[:B] = h.tokens[:B]
        pos = np.zeros(b, np.int64)
        pos[:B] = h.positions[:B]
        rows = np.concatenate([h.write_rows, np.repeat(self._pad_rows, pad_rows, axis=0)])
        blocks = np.concatenate([h.dec_blocks,
                                 np.full((pad_rows + pad_pages) * P, sb, np.int64)])
        owner = np.concatenate([h.dec_owner, np.arange(B, b, dtype=np.int64),
                                np.zeros(pad_pages, np.int64)])
        valid = np.zeros((nb, self.valid.shape[1]), dtype=bool)
        valid[:NP] = h.dec_valid
        valid[NP:NP + pad_rows, 0] = True
        for buf, arr in ((self.tokens, tok), (self.positions, pos), (self.write_rows, rows),
                         (self.blocks, blocks), (self.owner, owner), (self.valid, valid)):
            buf[:len(arr)].copy_(torch.from_numpy(arr), non_blocking=True)

    def _capture(self, b: int, nb: int) -> tuple:
        """Capture the bucket's graph (warm-up on a side stream first, as torch requires)."""
        # Every row a padding row: the warm-up and capture runs touch the scratch block only.
        self._fill(empty_host_step(self.cache), b, nb)
        meta = self._meta(b, nb)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(meta)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            logits, ids = self._forward(meta)
        if self.pool is None:
            self.pool = g.pool()
        self.graphs[(b, nb)] = (g, logits, ids)
        return self.graphs[(b, nb)]

    def buckets_for(self, batches, max_context: int) -> list[tuple[int, int]]:
        """Every (batch, pages) bucket that decode steps of the given batch sizes,
        each sequence holding 1 .. ``max_context`` tokens, can land in."""
        tokens_per_page = self.cache.block_size * self.cache.page_blocks
        out = set()
        for B in batches:
            lo = self.bucket(B, B)
            if lo is None:
                continue
            hi = self.bucket(B, B * -(-max_context // tokens_per_page))
            top = hi[1] if hi is not None else self.page_buckets[-1]
            out.update((lo[0], nb) for nb in self.page_buckets if lo[1] <= nb <= top)
        return sorted(out)

    def capture_buckets(self, batches, max_context: int) -> int:
        """Capture ahead of time every bucket ``buckets_for`` lists, so no capture
        stalls a measured run. Returns how many graphs were captured."""
        n = 0
        for key in self.buckets_for(batches, max_context):
            if key not in self.graphs and self.capture:
                self._capture(*key)
                n += 1
        return n
