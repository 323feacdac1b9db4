"""KV memory inside ``EngineCore``: growth, preemption (recompute or swap),
swap-in and admission. A mixin; the rules themselves (what admission costs, whom to
preempt, ``make_room``, ``admit_plan``) are ``simulator.model.kv.space``'s, shared with the
simulator's replica (``simulator.loops.simpy.memory`` is its counterpart)."""
from __future__ import annotations

from simulator.model.scheduling import Seq, StepPlan


class EngineMemory:
    """Mixin: the memory steps of ``EngineCore.step`` (see ``engine``'s module doc)."""

    def _make_room(self, now: float) -> list:
        """Grow every decoder whose next token needs a new block, preempting victims
        while blocks are short. Returns the preempted rids, in order."""
        kv = self.kv
        if not kv.paged or not self.decoding:
            return []
        due = [s for s in self.decoding if kv.needs_block(s, s.prompt_tokens + s.generated)]
        if not due:
            return []
        victims = kv.make_room(due, lambda: self.decoding + self.prefilling,
                               lambda v: self._preempt(v, now))
        for s in due:
            kv.grow(s, s.prompt_tokens + s.generated)
        return [v.rid for v in victims]

    def _preempt(self, s: Seq, now: float) -> None:
        """Preempt running request ``s`` now: swap its KV out, or drop it and requeue
        it to recompute (``KVSpace.preemption`` / ``release_preempted``: the rules and
        the counts are the simulator's)."""
        r = s.payload
        decoding = s in self.decoding
        (self.decoding if decoding else self.prefilling).remove(s)
        r.preemptions += 1
        r.preempted_at = now
        self.stats["preemptions"] += 1
        kv = self.kv
        swap, blocks = kv.preemption(s, decoding, self.cpu_used,
                                     -1 if self.swap_blocks is None else self.swap_blocks)
        if swap:
            # Copy the KV to host memory before its blocks are freed.
            r.swapped = self.cache.swap_out(s.rid)
            r.swapped_blocks = blocks
            self.cpu_used += blocks
            self.stats["swap_outs"] += 1
            self.stats["swapped_blocks"] += blocks
        lost = kv.release_preempted(s, decoding, swap)
        self.cache.release(s.rid)    # the blocks are free already: drops its table
        if swap:
            self.swapped.append(s)
            return
        r.recomputed_tokens += lost
        self.stats["recomputed_tokens"] += lost
        self.waiting.requeue(s)

    def _drop_swap(self, s: Seq) -> None:
        r = s.payload
        self.cpu_used -= r.swapped_blocks
        r.swapped, r.swapped_blocks = None, 0

    def _swap_in(self, now: float) -> list:
        """Bring swapped-out requests back, oldest first, while their blocks fit."""
        back = []
        max_seqs = self.policy.limits.max_num_seqs
        while self.swapped and self.num_running < max_seqs:
            s = self.swapped[0]
            if not self.kv.swap_in(s):
                break
            self.swapped.popleft()
            r = s.payload
            self.cache.swap_in(s.rid, r.swapped)
            self._drop_swap(s)
            r.preempted_s += now - r.preempted_at
            self.decoding.append(s)
            back.append(s.rid)
        return back

    def _admit(self, plan: StepPlan, now: float) -> StepPlan:
        """Move the plan's admissions into the running set, allocating their blocks
        (``KVSpace.admit_plan``, as the simulator's replica does)."""

        def admitted(seq: Seq, cached: int, recovered: int) -> None:
            self.waiting.remove(seq)
            self.stats["cached_tokens"] += cached
            r = seq.payload
            if r.preemptions:
                r.preempted_s += now - r.preempted_at
                # What the re-admission's prefix hit recovers is not recomputed (the
                # simulator's definition of recomputed_tokens).
                r.recomputed_tokens -= recovered
                self.stats["recomputed_tokens"] -= recovered
            self.prefilling.append(seq)

        return self.kv.admit_plan(plan, self.seqs.__getitem__, admitted)
