"""KV memory inside a replica: growth, preemption (recompute or swap), swap-in and
cancellation. A mixin of ``Replica``; it only moves requests between the
replica's sets and keeps their bookkeeping exact.

A request is in exactly one place (``SimSeq.where``): ``q`` waiting, ``p``
prefilling, ``d`` decoding, ``s`` swapped out, ``x`` gone.

Growth (paged allocation): before each step every decoder whose context is about
to cross a block boundary takes one block. In the fast bookkeeping mode (see
``replica``) decoders are not visited step by step, so the step at which each one
next needs a block sits in a heap, like finishes.

Preemption: when the due blocks exceed the free ones, a victim (``kv.space.select_victim``)
is preempted and its blocks are freed, until the rest fit. The step that preempted
admits nobody new (as vLLM does), which avoids admitting into the memory just
freed and preempting again at the next step.

- ``recompute``: the victim rejoins the waiting queue (at the head of its turn);
  when admitted again it prefills its prompt *and* the tokens it had generated
  (their KV was dropped), and that prefill yields its next token. A prefix hit on
  its own freed blocks, still cached, cuts the redo.
- ``swap``: a decoding victim's blocks are copied to CPU memory (``swap_space_gb``)
  at ``swap_gb_per_s``, the copy time added to the step; it comes back, copied in
  again, as soon as its blocks fit, before any new admission. A victim mid-prefill,
  or one that finds the swap space full, is recomputed instead.
"""
from __future__ import annotations

import heapq

from simulator.kernel import python_of
from simulator.model.kv import rules as kvr
from simulator.model.scheduling import progress as P

# Once per decoder and block, or join: the plain functions (no compiled dispatch).
_growth_tick, _swap_copy = python_of(kvr.growth_tick), python_of(kvr.swap_copy)
_held_tokens = python_of(kvr.held_tokens)
_tick_key, _finish_tick, _generated_by, _last_token_at, _admission_times = (
    python_of(f) for f in (P.tick_key, P.finish_tick, P.generated_by, P.last_token_at,
                           P.admission_times))


class ReplicaMemory:
    """Mixin: memory operations of ``Replica`` (see module doc)."""

    # -- fast-mode decoder membership ----------------------------------------------------
    def _join_fast(self, s, last_token_t: float) -> None:
        """``s`` decodes from the next step on; it holds ``generated`` tokens and its
        last token left the engine at ``last_token_t``."""
        s.ver += 1
        key = _tick_key(s.prompt_tokens, s.generated, self.ticks)
        s.key = key
        s.join_tick = self.ticks
        s.last_t = last_token_t
        s.finish_tick = _finish_tick(self.ticks, s.output_tokens, s.generated)
        heapq.heappush(self._finish_heap, (s.finish_tick, s.rid, s.ver, s))
        self._key_sum += key
        if len(self.decoding) == 1 or key > self._key_max:
            self._key_max = key
        self._last_tok[last_token_t] = self._last_tok.get(last_token_t, 0) + 1
        if self.kv.paged:
            self._push_growth(s)

    def _push_growth(self, s) -> None:
        """Heap the tick of the next step at which ``s`` needs one more block."""
        held = self.kv.manager.blocks_of(s.rid)
        s.grow_tick = _growth_tick(held, s.key, self.kv.bs)
        heapq.heappush(self._grow_heap, (s.grow_tick, s.rid, s.ver, s))

    def _leave_fast(self, s) -> None:
        """Take decoder ``s`` out of the tick bookkeeping; sets ``generated``/``last_t``."""
        s.generated = _generated_by(s.output_tokens, s.finish_tick, self.ticks)
        tl = _last_token_at(self.ticks, s.join_tick, self._last_dec_end, s.last_t)
        self._last_tok[tl] -= 1
        s.last_t = tl
        s.ver += 1                      # its heap entries go stale
        self._key_sum -= s.key
        if s.key == self._key_max:
            self._key_max = max((d.key for d in self.decoding if d is not s), default=0)

    def _clean_top(self, heap) -> None:
        while heap and heap[0][2] != heap[0][3].ver:
            heapq.heappop(heap)

    # -- growth and preemption -------------------------------------------------------------
    def _due_growth(self) -> list:
        """Decoders that need one more block before the coming step."""
        if not self.kv.paged or not self.decoding:
            return []
        if not self.fast:
            kv = self.kv
            if kv.lookahead:
                return [s for s in self.decoding if kv.needs_block(s, self._slots(s))]
            return [s for s in self.decoding if kv.needs_block(s, s.context)]
        heap = self._grow_heap
        due = []
        ticks = self.ticks
        while heap and heap[0][0] <= ticks:
            tick, _, ver, s = heapq.heappop(heap)
            if ver == s.ver:
                due.append(s)
        return due

    def _make_room(self, now: float) -> bool:
        """Grow every due decoder, preempting victims while blocks are short.
        Returns whether anyone was preempted."""
        due = self._due_growth()
        if not due:
            return False
        kv = self.kv
        blocks = (lambda d: kv.growth_blocks(d, self._slots(d))) if kv.lookahead else None
        preempted = bool(kv.make_room(due, lambda: self.decoding + self.prefilling,
                                      lambda v: self._preempt(v, now), blocks))
        for s in due:
            ctx = s.key + self.ticks if self.fast else self._slots(s)
            kv.grow(s, ctx)
            if self.fast:
                self._push_growth(s)
        return preempted

    def _slots(self, s) -> int:
        """KV slots decoder ``s`` (slow mode) needs for its next step: its context, plus
        the drafts a speculative step verifies (``rules.decode_slots``)."""
        return kvr.decode_slots(s.context, self.kv.decode_lookahead(s))

    def _catch_up_growth(self) -> None:
        """After an epoch: the blocks its steps took, one per boundary crossed (the
        epoch was sized so that they fit)."""
        heap = self._grow_heap
        kv = self.kv
        while heap and heap[0][0] < self.ticks:
            tick, _, ver, s = heapq.heappop(heap)
            if ver != s.ver:
                continue
            kv.grow(s, s.key + tick)
            self._push_growth(s)

    def _preempt(self, s, now: float) -> None:
        """Preempt running request ``s`` now (see module doc; the rules are
        ``KVSpace.preemption`` / ``release_preempted``)."""
        rec = self.rec
        rid = s.rid
        rec.preemptions[rid] += 1
        decoding = s.where == "d"
        if decoding:
            if self.fast:
                self._leave_fast(s)
            self.decoding.remove(s)
        else:
            self.prefilling.remove(s)
        kv = self.kv
        self.kv_tokens -= _held_tokens(decoding, s.prompt_tokens, s.generated, s.prefilled)
        s.preempted_at = now
        swap, blocks = kv.preemption(s, decoding, self.cpu_used, self.cpu_blocks)
        lost = kv.release_preempted(s, decoding, swap)
        if swap:
            s.where = "s"
            s.swapped_blocks = blocks
            self.cpu_used += blocks
            nbytes, copy_s = _swap_copy(blocks, self.block_bytes, self.swap_bps)
            rec.swapped_bytes[rid] += nbytes
            self._copy_s += copy_s
            self.swapped.append(s)
            return
        # Recompute: the KV is gone; it prefills again whatever it had computed.
        rec.recomputed_tokens[rid] += lost
        self._outstanding += lost
        s.where = "q"
        self.waiting.requeue(s)

    def _swap_in(self, now: float) -> None:
        """Bring swapped requests back, oldest first, while their blocks fit."""
        kv = self.kv
        rec = self.rec
        while self.swapped and len(self.decoding) + len(self.prefilling) < self.max_num_seqs:
            s = self.swapped[0]
            tokens = kv.swap_in(s)
            if not tokens:
                break
            self.swapped.popleft()
            self.cpu_used -= s.swapped_blocks
            nbytes, copy_s = _swap_copy(s.swapped_blocks, self.block_bytes, self.swap_bps)
            rec.swapped_bytes[s.rid] += nbytes
            self._copy_s += copy_s
            rec.preempted_s[s.rid] += _admission_times(rec.scheduled[s.rid], s.preempted_at,
                                                       now)[1]
            self.kv_tokens += tokens
            s.where = "d"
            self.decoding.append(s)
            if self.fast:
                self._join_fast(s, s.last_t)

    # -- cancellation ----------------------------------------------------------------------
    def cancel(self, rid: int) -> bool:
        """Cancel request ``rid`` (its client went away): it is dropped, and its KV
        freed, at the next step boundary (a step in flight completes, as on a real
        engine). Returns False if the request is not (or no longer) here."""
        s = self.by_id.get(rid)
        if s is None or s.where == "x":
            return False
        self._cancels.append(s)
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()
        elif self._in_epoch:
            self._in_epoch = False
            self.process.interrupt()
        return True

    def _apply_cancels(self, now: float) -> None:
        rec = self.rec
        for s in self._cancels:
            where = s.where
            if where == "x":
                continue
            if where == "q":
                if any(x is s for x in self._inbox):
                    self._inbox.remove(s)   # not yet seen by the scheduler (async)
                else:
                    self.waiting.remove(s)
                self._outstanding -= s.remaining_prefill + s.output_tokens - s.generated
            elif where == "s":
                self.swapped.remove(s)
                self.cpu_used -= s.swapped_blocks
                self._outstanding -= s.output_tokens - s.generated
            else:
                if where == "d":
                    if self.fast:
                        self._leave_fast(s)
                    self.decoding.remove(s)
                elif where == "w":      # its KV still loading from the CPU tier
                    self.loading = [e for e in self.loading if e[1] is not s]
                else:
                    self.prefilling.remove(s)
                self.kv_tokens -= _held_tokens(where == "d", s.prompt_tokens, s.generated,
                                               s.prefilled)
                self._outstanding -= s.remaining_prefill + s.output_tokens - s.generated
                self.kv.free(s)
            s.where = "x"
            rec.cancelled[s.rid] = True
            rec.cancelled_at[s.rid] = now
            rec.generated[s.rid] = s.generated
            del self.by_id[s.rid]
            if s.stream is not None:
                s.stream.close(now, cancelled=True)
        self._cancels.clear()
