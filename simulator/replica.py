"""One serving replica as a SimPy process: a waiting queue, a scheduling policy,
KV-block reservation, and the engine iteration loop.

The loop asks the policy for a ``StepPlan``, admits what it admits (reserving KV
blocks), asks the cost model how long the step takes, advances the clock by that
much in one event, and applies the step's effects at its end: prefill progress,
first tokens, one token per decode, finished requests. There is never an event
per token.

Token delivery: token k of a request leaves the server at ``D_k = max(t_k,
D_{k-1}) + frame_time`` (see ``stream``) and the gap ``D_k - D_{k-1}`` is pooled
into the inter-token-latency histogram. Two exact ways to compute it:

- **fast** (when a frame always transmits faster than the shortest engine step, and
  every step decodes every running request - ``max_num_seqs <= token budget``):
  no client ever falls behind, so ``D_k = t_k + frame_time`` and every decoder's gap
  is the time since its previous token. Decoders are then tracked by a replica-wide
  decode-step counter (``ticks``) instead of per-request counters: a request's
  context is ``key + ticks`` and it finishes when ``ticks`` reaches its
  ``finish_tick`` (a heap). A run of decode-only steps with nothing to admit is
  simulated as one *epoch*: its step times come from the cost model as a vector, it
  ends at the first finish, and an arrival that could be admitted interrupts it at
  the next step boundary - exactly when a step-by-step loop would have seen it.
- **slow** (a client slower than the engine): every decoder's frame queue is updated
  step by step.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from itertools import accumulate
from typing import Callable

import simpy

from .scheduling import SchedulerState, Seq

MAX_EPOCH_STEPS = 4096


class SimSeq(Seq):
    """A request inside the simulator: the scheduler's view plus delivery state."""

    __slots__ = ("client", "pooled", "depart", "context", "key", "finish_tick")

    def __init__(self, rid: int, enqueued: float, prompt_tokens: int, output_tokens: int,
                 priority: int, blocks_needed: int, client: int, pooled: bool) -> None:
        super().__init__(rid, enqueued, prompt_tokens, output_tokens, priority, blocks_needed)
        self.client = client
        self.pooled = pooled
        self.depart = 0.0      # slow mode: when the last frame left the server (D_k)
        self.context = 0       # slow mode: tokens in KV (prompt + generated)
        self.key = 0           # fast mode: context = key + ticks
        self.finish_tick = 0   # fast mode: ticks value at which it has all its tokens


class Replica:
    """A SimPy engine loop over one replica's queue and running set."""

    def __init__(self, env, index: int, policy, cost, capacity_blocks: int, rec,
                 frame_time: float, one_way: float, on_finish: Callable[[SimSeq, float], None],
                 series_interval: float = 0.0, mode: str = "auto") -> None:
        self.env = env
        self.index = index
        self.policy = policy
        self.cost = cost
        self.capacity = capacity_blocks
        self.free_blocks = capacity_blocks
        self.rec = rec
        self.frame_time = frame_time
        self.one_way = one_way
        self.on_finish = on_finish
        self.waiting = policy.new_queue()
        self.decoding: list[SimSeq] = []
        self.prefilling: list[SimSeq] = []
        self.by_id: dict[int, SimSeq] = {}
        self.kv_tokens = 0
        self._outstanding = 0
        self._epoch_ends = None   # step end times of the epoch in progress
        lim = policy.limits
        self.max_num_seqs = lim.max_num_seqs
        # ``mode``: "auto" picks fast+epochs when exact; "step" = fast without epochs;
        # "slow" = per-request bookkeeping. All three give the same results (tested).
        self.fast = (mode != "slow" and frame_time <= cost.min_step_s
                     and lim.max_num_seqs <= lim.max_num_batched_tokens)
        self.epochs = mode == "auto" and self.fast
        # Aging reorders the queue as time passes, so a blocked head can change without
        # any event; epochs then run only while nobody waits.
        self._aging = hasattr(self.waiting, "aging_s")
        # fast-mode decoder state
        self.ticks = 0
        self._finish_heap: list[tuple[int, int, SimSeq]] = []
        self._key_sum = 0
        self._key_max = 0
        self._last_tok: dict[float, int] = {}   # time of previous token -> decoders
        # slow-mode state
        self._last_end = -1.0
        self._in_epoch = False
        self._wakeup = None
        self._series = rec.series[index]
        self._series_interval = series_interval
        self._last_sample = -float("inf")
        self.process = env.process(self._run())

    @property
    def outstanding_tokens(self) -> int:
        """Prompt tokens not yet prefilled plus output tokens not yet generated, now.

        Inside an epoch, the decode steps that already ended count as done, exactly as
        if the loop had stepped through them one by one (the router reads this)."""
        ends = self._epoch_ends
        if ends is None:
            return self._outstanding
        done = bisect_right(ends, self.env.now)
        return self._outstanding - done * len(self.decoding)

    # -- arrivals -----------------------------------------------------------------
    def enqueue(self, seq: SimSeq) -> None:
        """The request reaches this replica's queue now."""
        was_empty = len(self.waiting) == 0
        self.waiting.push(seq)
        self.by_id[seq.rid] = seq
        self._outstanding += seq.prompt_tokens + seq.output_tokens
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()
        elif (self._in_epoch and was_empty and seq.blocks_needed <= self.free_blocks
              and len(self.decoding) + len(self.prefilling) < self.max_num_seqs):
            # Admissible now: the engine must look at it at the next step boundary.
            self._in_epoch = False
            self.process.interrupt()

    # -- the engine loop -------------------------------------------------------------
    def _run(self):
        env = self.env
        rec = self.rec
        policy = self.policy
        cost = self.cost
        while True:
            if not (self.decoding or self.prefilling or len(self.waiting)):
                self._wakeup = env.event()
                yield self._wakeup
                self._wakeup = None
            now = env.now
            state = SchedulerState(now, self.waiting, self.decoding, self.prefilling,
                                   self.free_blocks)
            plan = policy.schedule(state)
            if plan.is_empty:
                # Only waiting requests that cannot be admitted and nothing running: the
                # enqueue-time check rejects requests larger than the cache, so this is a
                # logic error, not a load condition.
                raise RuntimeError(f"replica {self.index}: policy returned an empty plan "
                                   f"with {len(self.waiting)} waiting and nothing running")
            by_id = self.by_id
            for rid in plan.admit:
                seq = by_id[rid]
                self.waiting.remove(seq)
                self.free_blocks -= seq.blocks_needed
                rec.scheduled[rid] = now
                self.prefilling.append(seq)
            nd = len(plan.decode)
            if (self.epochs and nd and not plan.prefill
                    and (not self._aging or len(self.waiting) == 0)):
                yield from self._epoch(nd)
            else:
                if not nd:
                    dseqs, ctx_max, ctx_sum = (), 0, 0
                elif self.fast:
                    dseqs = self.decoding
                    ctx_max = self._key_max + self.ticks
                    ctx_sum = self._key_sum + nd * self.ticks
                else:
                    dseqs = (self.decoding if nd == len(self.decoding)
                             else [by_id[r] for r in plan.decode])
                    ctx_sum = ctx_max = 0
                    for s in dseqs:
                        c = s.context
                        ctx_sum += c
                        if c > ctx_max:
                            ctx_max = c
                chunks = []
                for rid, n in plan.prefill:
                    s = by_id[rid]
                    chunks.append((n, s.prefilled, s.prefilled + n >= s.prompt_tokens))
                dt = cost.step_time(nd, ctx_max, ctx_sum, chunks)
                rec.steps += 1
                rec.step_time_total += dt
                yield env.timeout(dt)
                t = env.now
                if self.fast:
                    if nd:
                        self._decode_fast(t, 1, t, None)
                else:
                    self._decode_slow(dseqs, t)
                self._prefill(plan.prefill, t)
                self._finish_due(t)
            if env.now - self._last_sample >= self._series_interval:
                self._sample(env.now)

    def _epoch(self, nd: int):
        """Decode-only steps until the first finish (or an admissible arrival)."""
        env = self.env
        now = env.now
        k = min(self._finish_heap[0][0] - self.ticks, MAX_EPOCH_STEPS)
        if self.cost.padded:
            ctx0 = self._key_max + self.ticks
        else:
            ctx0 = (self._key_sum + nd * self.ticks) / nd
        dts = self.cost.decode_times(nd, ctx0, k)
        ends = list(accumulate(dts, initial=now))[1:]
        self._in_epoch = True
        self._epoch_ends = ends
        try:
            yield env.timeout(ends[-1] - now)
            m = k
        except simpy.Interrupt:
            # Steps run to completion: the one in progress ends, then the engine re-plans.
            j = min(bisect_left(ends, env.now), k - 1)
            m = j + 1
            self._in_epoch = False
            yield env.timeout(max(ends[j] - env.now, 0.0))
        self._in_epoch = False
        self._epoch_ends = None
        self.rec.steps += m
        self.rec.step_time_total += ends[m - 1] - now
        gaps = [ends[i + 1] - ends[i] for i in range(m - 1)] if m > 1 else None
        self._decode_fast(env.now, m, ends[0], gaps)
        self._finish_due(env.now)

    # -- applying a step's effects ----------------------------------------------------
    def _decode_fast(self, t: float, m: int, first_end: float, later_gaps) -> None:
        """``m`` decode steps of every decoder ended, the first at ``first_end``, the
        last at ``t``; ``later_gaps`` are the gaps between the later steps' ends."""
        itl = self.rec.itl
        nd = len(self.decoding)
        for tl, c in self._last_tok.items():
            if c:
                itl.add(first_end - tl, c)
        if later_gaps is not None:
            itl.add_many(later_gaps, nd)
        self._last_tok = {t: nd}
        self.ticks += m
        self.kv_tokens += m * nd
        self._outstanding -= m * nd

    def _decode_slow(self, dseqs, t: float) -> None:
        """One decode step for ``dseqs``, each client's frame queue updated exactly."""
        ft = self.frame_time
        itl = self.rec.itl
        common_old = self._last_end + ft
        fast = common_old <= t
        t_ft = t + ft
        same = 0
        done = []
        for s in dseqs:
            s.generated += 1
            s.context += 1
            d_old = s.depart
            if fast and d_old == common_old:
                # Decoded at the previous step end and the client kept up: same gap.
                same += 1
                s.depart = t_ft
            else:
                d = (t if t > d_old else d_old) + ft
                s.depart = d
                itl.add(d - d_old)
            if s.generated >= s.output_tokens:
                done.append(s)
        if same:
            itl.add(t_ft - common_old, same)
        self._last_end = t
        self.kv_tokens += len(dseqs)
        self._outstanding -= len(dseqs)
        if done:
            gone = set(map(id, done))
            self.decoding = [s for s in self.decoding if id(s) not in gone]
            for s in done:
                self._finish(s, t, s.depart)

    def _prefill(self, chunks, t: float) -> None:
        """Prefill progress; a chunk that completes its prompt yields the first token."""
        rec = self.rec
        by_id = self.by_id
        ft = self.frame_time
        tokens = 0
        for rid, n in chunks:
            s = by_id[rid]
            s.prefilled += n
            tokens += n + (s.prefilled >= s.prompt_tokens)
            if s.prefilled < s.prompt_tokens:
                continue
            self.prefilling.remove(s)
            s.generated = 1
            rec.first_token[rid] = t
            rec.first_delivered[rid] = t + ft + self.one_way
            if s.output_tokens <= 1:
                self.kv_tokens += tokens
                self._outstanding -= tokens
                tokens = 0
                self._finish(s, t, t + ft)
                continue
            self.decoding.append(s)
            if self.fast:
                key = s.prompt_tokens + 1 - self.ticks
                s.key = key
                s.finish_tick = self.ticks + s.output_tokens - 1
                heapq.heappush(self._finish_heap, (s.finish_tick, rid, s))
                self._key_sum += key
                if len(self.decoding) == 1 or key > self._key_max:
                    self._key_max = key
                self._last_tok[t] = self._last_tok.get(t, 0) + 1
            else:
                s.context = s.prompt_tokens + 1
                s.depart = t + ft
        self.kv_tokens += tokens
        self._outstanding -= tokens

    def _finish_due(self, t: float) -> None:
        """Fast mode: decoders whose last token came from the step that ended at ``t``."""
        heap = self._finish_heap
        if not heap or heap[0][0] > self.ticks:
            return
        done = []
        while heap and heap[0][0] <= self.ticks:
            done.append(heapq.heappop(heap)[2])
        gone = set(map(id, done))
        self.decoding = [s for s in self.decoding if id(s) not in gone]
        self._last_tok[t] -= len(done)
        recompute = False
        for s in done:
            s.generated = s.output_tokens
            self._key_sum -= s.key
            recompute |= s.key == self._key_max
            self._finish(s, t, t + self.frame_time)
        if recompute:
            self._key_max = max((s.key for s in self.decoding), default=0)

    def _finish(self, s: SimSeq, t: float, depart: float) -> None:
        rec = self.rec
        rid = s.rid
        rec.last_token[rid] = t
        rec.last_delivered[rid] = depart + self.one_way
        rec.generated[rid] = s.generated
        self.free_blocks += s.blocks_needed
        self.kv_tokens -= s.prompt_tokens + s.generated
        del self.by_id[rid]
        self.on_finish(s, depart + self.one_way)

    def _sample(self, t: float) -> None:
        ts, wq, run, blk, kv = self._series
        ts.append(t)
        wq.append(len(self.waiting))
        run.append(len(self.decoding) + len(self.prefilling))
        blk.append(self.capacity - self.free_blocks)
        kv.append(self.kv_tokens)
        self._last_sample = t
