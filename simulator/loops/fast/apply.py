"""A step's effects inside a ``fastreplica.FastReplica``: decode progress by the
tick counter, prefill progress and first tokens, joining the decoders, paged growth
by phase counts, finishes and time-series samples - ``replica_apply`` and
``replica_memory`` in the fast mode, written for this loop."""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from simulator.model.kv.space import select_victim
from simulator.loops.simpy.apply import ReplicaApply

if TYPE_CHECKING:
    from simulator.loops.fast.replica import _Req


class Unsupported(Exception):
    """This run needs the SimPy model (the message says why)."""


class FastApply:
    """Mixin of ``FastReplica``: what a step's end changes."""

    # Decode progress by the tick counter is the SimPy replica's own code: the same
    # state names (``ticks``, ``_last_tok``, ``_last_dec_end``, ``kv_tokens``).
    _decode = ReplicaApply._decode_fast

    def _prefill(self, chunks, t: float) -> None:
        rec = self.rec
        ft = self.ft
        tokens = 0
        mgr = self.mgr
        for s, n in chunks:
            s.prefilled += n
            if mgr is not None:
                mgr.register(s.rid, s.keys, s.prefilled)   # ``KVSpace.computed``
            done = s.prefilled >= s.prefill_len
            tokens += n + done
            if not done:
                continue
            self.prefilling.remove(s)
            # A request recomputing after a preemption yields its next token, not its first.
            resumed = s.generated > 0
            s.generated += 1
            if not resumed:
                rec.first_token[s.rid] = t
                rec.first_delivered[s.rid] = t + ft + self.one_way
            else:
                # The gap since its last token before the preemption is one ITL.
                rec.itl.add(t - s.last_t)
            if s.generated >= s.output:
                self.kv_tokens += tokens
                self._outstanding -= tokens
                tokens = 0
                self._finish(s, t, t + ft)
                continue
            self.decoding.append(s)
            self._join(s, t)
        self.kv_tokens += tokens
        self._outstanding -= tokens

    def _join(self, s: _Req, last_token_t: float, swapped_in: bool = False) -> None:
        ticks = self.ticks
        s.ver += 1
        key = s.prompt + s.generated - ticks
        s.key = key
        s.finish_tick = ticks + s.output - s.generated
        s.join_tick = ticks
        s.last_t = last_token_t
        s.decoding = True
        heapq.heappush(self.finish_heap, (s.finish_tick, s.rid, s.ver, s))
        self.key_sum += key
        if len(self.decoding) == 1 or key > self.key_max:
            self.key_max = key
        self._last_tok[last_token_t] = self._last_tok.get(last_token_t, 0) + 1
        if self.paged:
            ph = (1 - key) % self.bs
            s.phase = ph
            self.phase[ph] += 1
            # Back from swap it holds the blocks of its whole context, so it takes none
            # before its first step (its first boundary is always a later tick).
            if ticks == self.grown and ticks % self.bs == ph and not swapped_in:
                self.late += 1
                s.late_tick = ticks

    def _make_room(self, due: int, fresh: bool, now: float) -> int:
        """``due`` decoders need a block and fewer are free: preempt victims (by the
        scenario's rule, ``kvspace.select_victim``) until the rest fit; returns how
        many are still due (a victim that was due leaves)."""
        ticks = self.ticks
        ph = ticks % self.bs
        while due > self.num_free:
            v = select_victim(self.decoding + self.prefilling, self.victim)
            if v.decoding and v.phase == ph and (fresh or v.late_tick == ticks):
                due -= 1
            self._preempt(v, now)
        return due

    def _preempt(self, s: _Req, now: float) -> None:
        """``ReplicaMemory._preempt`` (recompute, or swap for a decoder when the swap
        space has room), in the fast bookkeeping."""
        rec = self.rec
        rid = s.rid
        rec.preemptions[rid] += 1
        if s.decoding:
            # ``_leave_fast``: what it generated so far, and when its last token left.
            ticks = self.ticks
            s.generated = s.output - (s.finish_tick - ticks)
            tl = self._last_dec_end if ticks > s.join_tick else s.last_t
            self._last_tok[tl] -= 1
            s.last_t = tl
            s.ver += 1
            self.key_sum -= s.key
            if s.key == self.key_max:
                self.key_max = max((d.key for d in self.decoding if d is not s), default=0)
            self.decoding.remove(s)
            s.decoding = False
            self.phase[s.phase] -= 1
            held_tokens = lost = s.prompt + s.generated
            # Its context took a block at each boundary up to the last step's.
            if self.mgr is not None:
                held = self.mgr.blocks_of(rid)
            else:
                held = max(s.held, -(-(s.key + ticks - 1) // self.bs))
            swap = self.swap and self.cpu_used + held <= self.cpu_blocks
        else:
            self.prefilling.remove(s)
            held_tokens = lost = s.prefilled
            held = self.mgr.blocks_of(rid) if self.mgr is not None else s.held
            swap = False
        self.kv_tokens -= held_tokens
        s.preempted_at = now
        s.held = held
        self._free_blocks(s)
        if swap:
            s.swapped_blocks = held
            self.cpu_used += held
            nbytes = held * self.block_bytes
            rec.swapped_bytes[rid] += nbytes
            self.copy_s += nbytes / self.swap_bps
            self.swapped.append(s)
            return
        rec.recomputed_tokens[rid] += lost
        s.dropped = lost
        self._outstanding += lost
        s.prefill_len = s.prompt + s.generated
        s.prefilled = 0
        if self.aging:
            self.waiting.requeue(s)
        else:
            self.waiting.appendleft(s)

    def _swap_in(self, now: float) -> None:
        """``ReplicaMemory._swap_in``: swapped requests back, oldest first, while
        their blocks fit."""
        rec = self.rec
        st = self.stats
        while self.swapped and len(self.decoding) + len(self.prefilling) < self.max_seqs:
            s = self.swapped[0]
            tokens = s.prompt + s.generated
            need = -(-tokens // self.bs)
            if need + self.watermark > self.num_free:
                break
            self.swapped.popleft()
            if self.mgr is not None:
                self.mgr.allocate(s.rid, tokens)
                self.num_free = self.mgr.num_free
            else:
                self.num_free -= need
                s.held = need
                st.admissions += 1
                st.queried_tokens += tokens
            self.cpu_used -= s.swapped_blocks
            nbytes = s.swapped_blocks * self.block_bytes
            rec.swapped_bytes[s.rid] += nbytes
            self.copy_s += nbytes / self.swap_bps
            rec.preempted_s[s.rid] += now - s.preempted_at
            self.kv_tokens += tokens
            self.decoding.append(s)
            self._join(s, s.last_t, swapped_in=True)

    def _catch_up_growth(self, start: int) -> None:
        """After an epoch that started at tick ``start``: the blocks its later steps
        took (the epoch was sized so that they fit)."""
        last = self.ticks - 1
        if last <= start:
            return
        phase, bs = self.phase, self.bs
        span = last - start
        due = (span // bs) * len(self.decoding)
        for t in range(start + 1, start + 1 + span % bs):
            due += phase[t % bs]
        if self.mgr is None:
            self.num_free -= due
        elif due:
            # Each decoder's blocks for its context at the epoch's last step.
            grow = self.mgr.grow
            for s in self.decoding:
                grow(s.rid, s.key + last)
            self.num_free = self.mgr.num_free
        self.grown = last

    def _grow_due(self, fresh: bool) -> None:
        """With a block manager: one block for each decoder due now (see ``late``)."""
        ticks = self.ticks
        ph = ticks % self.bs
        grow = self.mgr.grow
        for s in self.decoding:
            if s.phase == ph and (fresh or s.late_tick == ticks):
                grow(s.rid, s.key + ticks)
        self.num_free = self.mgr.num_free

    def _free_blocks(self, s: _Req) -> None:
        """Release ``s``'s blocks (finish, preemption)."""
        if self.mgr is not None:
            self.mgr.free(s.rid)
            self.num_free = self.mgr.num_free
        else:
            self.num_free += s.held
        s.held = 0

    def _finish_due(self, t: float) -> None:
        heap = self.finish_heap
        while heap and heap[0][2] != heap[0][3].ver:
            heapq.heappop(heap)
        ticks = self.ticks
        if not heap or heap[0][0] > ticks:
            return
        done = []
        while heap and heap[0][0] <= ticks:
            tick, _, ver, s = heapq.heappop(heap)
            if ver == s.ver:
                done.append(s)
        if not done:
            return
        gone = set(map(id, done))
        self.decoding = [s for s in self.decoding if id(s) not in gone]
        self._last_tok[t] -= len(done)
        recompute = False
        ft = self.ft
        paged, phase, bs = self.paged, self.phase, self.bs
        counted = self.mgr is None
        for s in done:
            s.generated = s.output
            s.ver += 1
            self.key_sum -= s.key
            recompute |= s.key == self.key_max
            s.decoding = False
            if paged:
                phase[s.phase] -= 1
                if counted:
                    # Its context grew to prompt + output - 1 tokens (the last token
                    # is never fed back), a block at each boundary.
                    s.held = max(s.held, -(-(s.prompt + s.output - 1) // bs))
            self._finish(s, t, t + ft)
        if recompute:
            self.key_max = max((s.key for s in self.decoding), default=0)

    def _finish(self, s: _Req, t: float, depart: float) -> None:
        rec = self.rec
        rid = s.rid
        rec.last_token[rid] = t
        arrived = depart + self.one_way
        rec.last_delivered[rid] = arrived
        rec.generated[rid] = s.generated
        self._free_blocks(s)
        self.kv_tokens -= s.prompt + s.generated
        self.loop.pools.release(s.client, arrived, s.pooled)

    def _sample(self, t: float) -> None:
        ts, wq, run, blk, kv, shared = self.series
        ts.append(t)
        wq.append(len(self.waiting) + len(self.swapped))
        run.append(len(self.decoding) + len(self.prefilling))
        blk.append(self.capacity - self.num_free)
        kv.append(self.kv_tokens)
        shared.append(self.mgr.shared_refs if self.mgr is not None else 0)
        self.last_sample = t
