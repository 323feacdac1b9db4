"""One serving replica as a SimPy process: a waiting queue, a scheduling policy,
KV-block reservation, and the engine iteration loop.

The loop asks the policy for a ``StepPlan``, admits what it admits (reserving
KV blocks), asks the cost model how long the step takes, advances the clock by
that much in one event, and applies the step's effects at its end: prefill
progress, first tokens, one token per decode, finished requests. There is one
event per engine step, never one per token.

Per-token delivery is folded in as the step ends: token k of a request leaves
the server at ``D_k = max(t_k, D_{k-1}) + frame_time`` (see ``stream``), and the
gap ``D_k - D_{k-1}`` is pooled into the inter-token-latency histogram.
"""
from __future__ import annotations

from typing import Callable

from .scheduling import SchedulerState, Seq


class SimSeq(Seq):
    """A request inside the simulator: the scheduler's view plus delivery state."""

    __slots__ = ("client", "pooled", "depart", "context")

    def __init__(self, rid: int, enqueued: float, prompt_tokens: int, output_tokens: int,
                 priority: int, blocks_needed: int, client: int, pooled: bool) -> None:
        super().__init__(rid, enqueued, prompt_tokens, output_tokens, priority, blocks_needed)
        self.client = client
        self.pooled = pooled
        self.depart = 0.0      # when the last frame left the server (D_k)
        self.context = 0       # tokens in KV: prompt + generated once decoding


class Replica:
    """A SimPy engine loop over one replica's queue and running set."""

    def __init__(self, env, index: int, policy, cost, capacity_blocks: int, rec,
                 frame_time: float, one_way: float, on_finish: Callable[[SimSeq, float], None],
                 series_interval: float = 0.0) -> None:
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
        self.outstanding_tokens = 0
        self._wakeup = None
        self._series = rec.series[index]
        self._series_interval = series_interval
        self._last_sample = -float("inf")
        self._last_end = -1.0  # end of the previous engine step
        self.process = env.process(self._run())

    # -- arrivals -----------------------------------------------------------------
    def enqueue(self, seq: SimSeq) -> None:
        """The request reaches this replica's queue now."""
        self.waiting.push(seq)
        self.by_id[seq.rid] = seq
        self.outstanding_tokens += seq.prompt_tokens + seq.output_tokens
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()

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
            # Decode context: every decode in the plan, usually the whole decoding list.
            dec = self.decoding
            if len(plan.decode) == len(dec):
                dseqs = dec
            else:
                dseqs = [by_id[r] for r in plan.decode]
            nd = len(dseqs)
            if nd:
                ctx_sum = 0
                ctx_max = 0
                for s in dseqs:
                    c = s.context
                    ctx_sum += c
                    if c > ctx_max:
                        ctx_max = c
            else:
                ctx_sum = ctx_max = 0
            chunks = [(n, by_id[rid].prefilled) for rid, n in plan.prefill]
            dt = cost.step_time(nd, ctx_max, ctx_sum, chunks)
            rec.steps += 1
            rec.step_time_total += dt
            yield env.timeout(dt)
            self._apply(plan, dseqs, env.now)
            if env.now - self._last_sample >= self._series_interval:
                self._sample(env.now)

    def _apply(self, plan, dseqs, t: float) -> None:
        """Effects of a step that ended at ``t``."""
        rec = self.rec
        ft = self.frame_time
        itl = rec.itl
        finished = []
        produced = 0
        # Decodes: one token each. Most decoders also produced a token at the previous
        # step's end and their client kept up, so their last frame left at exactly
        # ``prev_end + ft`` and their gap is the same: count those, histogram once.
        common_old = self._last_end + ft
        fast = common_old <= t
        t_ft = t + ft
        same = 0
        for s in dseqs:
            s.generated += 1
            s.context += 1
            d_old = s.depart
            if fast and d_old == common_old:
                same += 1
                s.depart = t_ft
            else:
                d = (t if t > d_old else d_old) + ft
                s.depart = d
                itl.add(d - d_old)
            if s.generated >= s.output_tokens:
                finished.append(s)
        if same:
            itl.add(t_ft - common_old, same)
        self._last_end = t
        produced += len(dseqs)
        # Prefill chunks; a chunk that completes the prompt yields the first token.
        by_id = self.by_id
        pre_tokens = 0
        for rid, n in plan.prefill:
            s = by_id[rid]
            s.prefilled += n
            pre_tokens += n
            if s.prefilled >= s.prompt_tokens:
                self.prefilling.remove(s)
                s.generated = 1
                s.context = s.prompt_tokens + 1
                s.depart = t + ft
                rec.first_token[rid] = t
                rec.first_delivered[rid] = t + ft + self.one_way
                produced += 1
                if s.output_tokens <= 1:
                    finished.append(s)
                else:
                    self.decoding.append(s)
        self.kv_tokens += pre_tokens + produced
        self.outstanding_tokens -= pre_tokens + produced
        if finished:
            done = set(id(s) for s in finished if s.output_tokens > 1)
            if done:
                self.decoding = [s for s in self.decoding if id(s) not in done]
            for s in finished:
                self._finish(s, t)

    def _finish(self, s: SimSeq, t: float) -> None:
        rec = self.rec
        rid = s.rid
        rec.last_token[rid] = t
        rec.last_delivered[rid] = s.depart + self.one_way
        rec.generated[rid] = s.generated
        self.free_blocks += s.blocks_needed
        self.kv_tokens -= s.prompt_tokens + s.generated
        del self.by_id[rid]
        self.on_finish(s, s.depart + self.one_way)

    def _sample(self, t: float) -> None:
        ts, wq, run, blk, kv = self._series
        ts.append(t)
        wq.append(len(self.waiting))
        run.append(len(self.decoding) + len(self.prefilling))
        blk.append(self.capacity - self.free_blocks)
        kv.append(self.kv_tokens)
        self._last_sample = t
