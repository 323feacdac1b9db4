"""One replica of ``fastloop``: ``Replica``'s fast bookkeeping with the policies'
decisions inline (see ``fastloop`` for why, and for what keeps it exact).

``iterate`` is the top of ``Replica._run`` (growth, the plan, admissions, then an
epoch or one step); ``ended`` applies a step or an epoch when its end event comes;
``enqueue`` and ``interrupted`` are an arrival and the epoch cut it may cause. The
effects of a step are in ``fastapply``.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections import deque
from itertools import accumulate
from typing import TYPE_CHECKING

from simulator.model.kv.manager import KVStats, PrefixKV
from simulator.loops.fast.apply import FastApply, Unsupported
from simulator.model.kv.blocks import blocks_for
from simulator.loops.simpy.replica import MAX_EPOCH_STEPS
from simulator.model.scheduling.policies import FifoPolicy, PriorityAgingPolicy

URGENT, NORMAL = 0, 1                       # SimPy's priorities
_ARRIVE, _DELIVER, _END, _WAKE, _INTERRUPT, _STOP = range(6)

if TYPE_CHECKING:
    from simulator.loops.fast.loop import FastLoop


class _Req:
    """A request inside this loop (the fields of ``replica.SimSeq`` it needs)."""

    __slots__ = ("rid", "prompt", "output", "client", "pooled", "priority", "enqueued",
                 "prefilled", "generated",
                 "held", "key", "finish_tick", "ver", "phase",
                 "prefill_len", "join_tick", "last_t", "late_tick", "preempted_at", "decoding",
                 "swapped_blocks", "dropped", "keys")

    def __init__(self, rid: int, prompt: int, output: int, client: int, pooled: bool,
                 priority: int) -> None:
        self.rid = rid
        self.prompt = prompt
        self.output = output
        self.client = client
        self.pooled = pooled
        self.priority = priority
        self.enqueued = 0.0
        self.prefilled = 0
        self.generated = 0
        self.held = 0
        self.key = 0
        self.finish_tick = 0
        self.ver = 0
        self.phase = 0
        self.prefill_len = prompt   # + generated after a preemption by recompute
        self.join_tick = 0
        self.last_t = 0.0           # when its last token left the engine
        self.late_tick = -1         # the tick it joined as a late decoder (see ``late``)
        self.preempted_at = None
        self.decoding = False
        self.swapped_blocks = 0
        self.dropped = 0            # KV tokens dropped at its last preemption by recompute
        self.keys = None            # prefix-cache keys of its prompt blocks (or None)

class FastReplica(FastApply):
    """One replica: ``Replica``'s fast bookkeeping with the policy inlined."""

    def __init__(self, loop: "FastLoop", index: int, policy, cost, capacity: int, rules,
                 swap: tuple, rec, frame_time: float, one_way: float,
                 series_interval: float) -> None:
        self.loop = loop
        self.index = index
        self.cost = cost
        lim = policy.limits
        self.fifo = type(policy) is FifoPolicy
        # Priority with aging orders admissions by its own queue (the policy's selector);
        # the others admit in arrival order from a plain deque.
        self.aging = type(policy) is PriorityAgingPolicy
        self.budget = lim.max_num_batched_tokens
        self.max_seqs = lim.max_num_seqs
        self.chunk = getattr(policy, "chunk_size", 0)
        self.capacity = capacity
        self.num_free = capacity
        self.watermark = int(rules.watermark * capacity)
        self.paged = rules.allocation == "paged"
        self.bs = rules.block_size
        self.max_model_len = rules.max_model_len
        self.swap = rules.preemption == "swap"
        # Swap: bytes per block, CPU swap space (blocks), copy bandwidth (bytes/s).
        self.block_bytes, self.cpu_blocks, self.swap_bps = swap
        self.cpu_used = 0
        self.swapped: deque[_Req] = deque()
        self.copy_s = 0.0            # swap copies of the step being planned (s)
        self.copying = None          # an iteration that only copies: its seconds
        self.victim = rules.victim
        # With prefix caching the block manager itself (ids, refcounts, the LRU of
        # cached blocks); without, counts here (``num_free``, ``_Req.held``).
        self.mgr = (PrefixKV(capacity, rules.block_size)
                    if rules.prefix_caching and self.paged else None)
        self.stats = self.mgr.stats if self.mgr is not None else KVStats()
        self.rec = rec
        self.ft = frame_time
        self.one_way = one_way
        self.waiting = policy.new_queue() if self.aging else deque()
        self.decoding: list[_Req] = []
        self.prefilling: list[_Req] = []
        self.kv_tokens = 0
        self._outstanding = 0
        self.ticks = 0
        self.finish_heap: list = []
        # Paged growth without a heap: a decoder with key ``k`` takes a block before the
        # steps whose tick t has t = 1 - k (mod block_size) (its context then crosses a
        # boundary), so the blocks due at tick t are ``phase[t % block_size]``; ``grown``
        # is the last tick whose growth was taken, ``late`` the decoders that joined at
        # that tick in its phase (due before the next step all the same).
        self.phase = [0] * self.bs
        self.grown = -1
        self.late = 0
        self.key_sum = 0
        self.key_max = 0
        self._last_tok: dict[float, int] = {}
        self._last_dec_end = -1.0
        self.series = rec.series[index]
        self.interval = series_interval
        self.last_sample = -float("inf")
        # What the engine is doing: idle (waiting for a wake-up), a step, or an epoch.
        self.idle = True
        self.wake_pending = False
        self.ver = 0                 # END events of another version are stale
        self.in_epoch = False
        self.epoch_ends = None
        self.step = None             # (nd, chunks) of the step in progress
        self.epoch = None            # [nd, k, ends, start, m] of the epoch in progress

    # -- what routers and arrivals see ------------------------------------------------------
    @property
    def outstanding_tokens(self) -> int:
        ends = self.epoch_ends
        if ends is None:
            return self._outstanding
        return self._outstanding - bisect_right(ends, self.loop.now) * len(self.decoding)

    def adm_tokens(self, s: _Req) -> int:
        """Token slots admitting ``s`` allocates (``KVSpace.admission_tokens``)."""
        if self.paged:
            return s.prefill_len
        r = self.max_model_len
        return r if r is not None else s.prompt + s.output

    def adm_blocks(self, s: _Req) -> int:
        """Blocks admitting ``s`` takes from the free pool (``KVSpace.admission``)."""
        if self.mgr is not None:
            return self.mgr.admission(self.adm_tokens(s), s.keys)[1]
        return -(-self.adm_tokens(s) // self.bs)

    def rejects(self, s: _Req) -> bool:
        """``KVSpace.fits``: True when ``s`` can never run here."""
        total = s.prompt + s.output
        r = self.max_model_len
        if r is not None and total > r:
            return True
        need = blocks_for(total, self.bs) if self.paged else self.adm_blocks(s)
        return need > self.capacity - self.watermark

    def enqueue(self, s: _Req, now: float) -> None:
        was_empty = not self.waiting
        if self.aging:
            self.waiting.push(s)
        else:
            self.waiting.append(s)
        self._outstanding += s.prompt + s.output
        if self.idle:
            if not self.wake_pending:
                self.wake_pending = True
                self.loop.push(now, NORMAL, _WAKE, self)
        elif self.in_epoch and (self.aging or (
                was_empty and len(self.decoding) + len(self.prefilling) < self.max_seqs
                and self.adm_blocks(s) <= self.num_free - self.watermark)):
            # With aging the queue's order changes with time alone: any arrival ends
            # the epoch (see ``Replica.enqueue``).
            self.in_epoch = False
            self.loop.push(now, URGENT, _INTERRUPT, self)

    # -- the engine loop ----------------------------------------------------------------------
    def woken(self, now: float) -> None:
        self.idle = False
        self.wake_pending = False
        self.iterate(now)

    def iterate(self, now: float) -> None:
        """The top of ``Replica._run``: plan the next step (or go idle) at ``now``."""
        decoding = self.decoding
        prefilling = self.prefilling
        waiting = self.waiting
        if not (decoding or prefilling or waiting or self.swapped):
            self.idle = True
            return
        ticks = self.ticks
        hold = False
        self.copy_s = 0.0
        if self.paged:
            # ``Replica._make_room``: one block for each decoder crossing a boundary now,
            # preempting victims while the free blocks are too few.
            fresh = ticks > self.grown
            due = self.late
            if fresh:
                due += self.phase[ticks % self.bs]
                self.grown = ticks
            if due:
                self.late = 0
                if due > self.num_free:
                    hold = True
                    due = self._make_room(due, fresh, now)
                if self.mgr is None:
                    self.num_free -= due
                elif due:
                    self._grow_due(fresh)
        # Swapped requests come back before anyone new; a step that preempted, or that
        # left someone swapped out, admits nobody (as in vLLM and the SimPy replica).
        if self.swapped and not hold:
            self._swap_in(now)
        hold = hold or bool(self.swapped)
        free = 0 if hold else self.num_free - self.watermark
        chunks = []
        admit = []
        mgr = self.mgr
        if self.fifo:
            nd = 0
            used = 0
            budget = self.budget
            for s in prefilling:
                n = s.prefill_len - s.prefilled
                if chunks and used + n > budget:
                    break
                chunks.append((s, n))
                used += n
            if waiting:
                running = len(decoding) + len(prefilling)
                for s in waiting:
                    if running >= self.max_seqs:
                        break
                    if mgr is None:
                        need = self.adm_blocks(s)
                        n = s.prefill_len - s.prefilled
                    else:
                        cached, need = mgr.admission(self.adm_tokens(s), s.keys)
                        n = s.prefill_len - s.prefilled - cached
                    if (chunks and used + n > budget) or need > free:
                        break
                    chunks.append((s, n))
                    admit.append((s, n))
                    used += n
                    running += 1
                    free -= need
            if not chunks:
                nd = len(decoding)
        else:
            nd = len(decoding)
            left = self.budget - nd
            cs = self.chunk
            for s in prefilling:
                if left <= 0:
                    break
                n = s.prefill_len - s.prefilled
                n = n if n < cs else cs
                n = n if n < left else left
                chunks.append((s, n))
                left -= n
            if left > 0 and waiting:
                running = nd + len(prefilling)
                for s in (waiting.candidates(now) if self.aging else waiting):
                    if left <= 0 or running >= self.max_seqs:
                        break
                    if mgr is None:
                        need = self.adm_blocks(s)
                        if need > free:
                            break
                        n = s.prefill_len - s.prefilled
                    else:
                        cached, need = mgr.admission(self.adm_tokens(s), s.keys)
                        if need > free:
                            break
                        n = s.prefill_len - s.prefilled - cached
                    n = n if n < cs else cs
                    n = n if n < left else left
                    chunks.append((s, n))
                    admit.append((s, n))
                    left -= n
                    running += 1
                    free -= need
        if admit:
            chunks = self._admit(admit, chunks, now)
        if not nd and not chunks:
            if self.copy_s and (decoding or prefilling):
                # Only swap copies this iteration: charge them, then plan again.
                self.copying = self.copy_s
                self.step = self.epoch = None
                self.ver += 1
                self.loop.push(now + self.copy_s, NORMAL, _END, self, self.ver)
                return
            raise Unsupported("an empty plan")
        loop = self.loop
        rec = self.rec
        if (nd and not chunks and not hold and not self.copy_s
                and not (self.aging and len(waiting))):
            # Aging reorders the queue as time passes: epochs only while nobody waits.
            fh = self.finish_heap
            while fh and fh[0][2] != fh[0][3].ver:
                heapq.heappop(fh)
            k = fh[0][0] - ticks
            if k > MAX_EPOCH_STEPS:
                k = MAX_EPOCH_STEPS
            if self.paged:
                bs = self.bs
                free_b = self.num_free
                if nd * (-(-k // bs)) > free_b:
                    k = min(k, bs * (free_b // nd))
            if k > 1:
                cost = self.cost
                if cost.padded:
                    ctx0 = self.key_max + ticks
                else:
                    ctx0 = (self.key_sum + nd * ticks) / nd
                ends = list(accumulate(cost.decode_times(nd, ctx0, k), initial=now))[1:]
                self.in_epoch = True
                self.epoch_ends = ends
                self.epoch = [nd, k, ends, now, k]
                self.step = None
                self.ver += 1
                loop.push(now + (ends[-1] - now), NORMAL, _END, self, self.ver)
                return
        if nd:
            ctx_max = self.key_max + ticks
            ctx_sum = self.key_sum + nd * ticks
        else:
            ctx_max = ctx_sum = 0
        parts = [(n, s.prefilled, s.prefilled + n >= s.prefill_len) for s, n in chunks]
        dt = self.cost.step_time(nd, ctx_max, ctx_sum, parts) + self.copy_s
        rec.steps += 1
        rec.step_time_total += dt
        rec.swap_copy_s += self.copy_s
        self.step = (nd, chunks)
        self.epoch = None
        self.ver += 1
        loop.push(now + dt, NORMAL, _END, self, self.ver)

    def _admit(self, admit: list, chunks: list, now: float) -> list:
        """``KVSpace.admit_plan``: allocate the admissions' blocks in order and move
        them to the prefilling set; returns the step's chunks. With a prefix cache an
        earlier admission of the step may evict a block a later one counted on: that
        one prefills from its smaller hit, or, if its blocks no longer fit, waits and
        its chunk is dropped."""
        rec = self.rec
        waiting = self.waiting
        mgr = self.mgr
        dropped = None
        for s, n in admit:
            tokens = self.adm_tokens(s)
            cached = 0
            if mgr is None:
                need = -(-tokens // self.bs)
                self.num_free -= need
                s.held = need
                st = self.stats
                st.admissions += 1
                st.queried_tokens += tokens
            else:
                if mgr.admission(tokens, s.keys)[1] > mgr.num_free:
                    dropped = (dropped or set()) | {id(s)}
                    continue
                cached = mgr.allocate(s.rid, tokens, s.keys)
                self.num_free = mgr.num_free
                s.prefilled = cached
                if cached + n > s.prefill_len:
                    raise Unsupported(f"a plan over-prefills request {s.rid}")
            if self.aging:
                waiting.remove(s)
            elif waiting[0] is s:
                waiting.popleft()
            else:
                waiting.remove(s)
            if cached:
                rec.cached_tokens[s.rid] += cached
                self.kv_tokens += cached
                self._outstanding -= cached
            if s.preempted_at is None:
                rec.scheduled[s.rid] = now
            else:
                rec.preempted_s[s.rid] += now - s.preempted_at
                # Dropped KV that a re-admission's prefix hit recovers is not recomputed.
                rec.recomputed_tokens[s.rid] -= min(cached, s.dropped)
            self.prefilling.append(s)
        if dropped:
            chunks = [c for c in chunks if id(c[0]) not in dropped]
        return chunks

    def interrupted(self, now: float) -> None:
        """An admissible arrival during an epoch: the step in progress completes."""
        ep = self.epoch
        ends = ep[2]
        j = min(bisect_left(ends, now), ep[1] - 1)
        ep[4] = j + 1
        self.in_epoch = False
        d = ends[j] - now
        self.ver += 1
        self.loop.push(now + (d if d > 0.0 else 0.0), NORMAL, _END, self, self.ver)

    def ended(self, t: float) -> None:
        """The step or epoch in progress ended at ``t``: apply it, sample, plan again."""
        rec = self.rec
        if self.copying is not None:
            rec.swap_copy_s += self.copying
            self.copying = None
            self.iterate(t)
            return
        if self.epoch is not None:
            nd, k, ends, start, m = self.epoch
            self.epoch = None
            self.in_epoch = False
            self.epoch_ends = None
            rec.steps += m
            rec.step_time_total += ends[m - 1] - start
            gaps = [ends[i + 1] - ends[i] for i in range(m - 1)] if m > 1 else None
            self._decode(t, m, ends[0], gaps)
            if self.paged:
                self._catch_up_growth(self.ticks - m)
            self._finish_due(t)
        else:
            nd, chunks = self.step
            self.step = None
            if nd:
                self._decode(t, 1, t, None)
            self._prefill(chunks, t)
            self._finish_due(t)
        if t - self.last_sample >= self.interval:
            self._sample(t)
        self.iterate(t)

    # -- a step's effects (``replica_apply`` / ``replica_memory``, fast mode) ------------------
