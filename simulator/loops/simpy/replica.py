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
  the next step boundary - exactly when a step-by-step loop would have seen it (the
  epoch's rules: ``model.scheduling.epoch``).
- **slow** (a client slower than the engine): every decoder's frame queue is updated
  step by step.

KV memory (allocation, growth, preemption, swap, cancellation) is in ``memory``; the
block accounting itself in ``model.kv`` (``space``, ``manager``, the ``rules``).

``loops.compiled`` runs this model without SimPy for runs of the built-in policies in
the fast mode without per-request streams, calling the same rule kernels (policies,
``model.kv.rules``, ``model.scheduling.epoch``, ``wire.keepalive``, the cost models')
on arrays; what it keeps of this replica's bookkeeping is checked bit for bit against
it by ``tests/test_compiled.py``.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable, Optional

import numpy as np
import simpy

from simulator.cost.decodectx import epoch_context, tick_contexts
from simulator.kernel import python_of
from simulator.model.kv.offload import load_charge
from simulator.model.kv.space import KVRules, KVSpace
from simulator.loops.simpy.apply import ReplicaApply
from simulator.loops.simpy.handoff import ReplicaHandoff
from simulator.loops.simpy.memory import ReplicaMemory
from simulator.model.scheduling import SchedulerState, Seq, StepPlan
from simulator.model.scheduling import epoch as E
from simulator.model.scheduling.asyncsched import sees
from simulator.model.scheduling.progress import admission_times
from simulator.model.scheduling.queues import heads_suffice

# The rules this loop asks on every step and arrival, as plain functions (a compiled
# call's dispatch costs more than their few comparisons).
_may_start, _epoch_length, _arrival_interrupts, _fits_now, _tick_contexts, _admission_times = (
    python_of(f) for f in (E.may_start, E.epoch_length, E.arrival_interrupts, E.fits_now,
                           tick_contexts, admission_times))
_sees = python_of(sees)
_load_charge = python_of(load_charge)


class SimSeq(Seq):
    """A request inside the simulator: the scheduler's view plus delivery state."""

    __slots__ = ("client", "pooled", "depart", "context", "key", "finish_tick", "keys",
                 "where", "ver", "grow_tick", "join_tick", "last_t", "preempted_at",
                 "swapped_blocks", "stream", "keys_out")

    def __init__(self, rid: int, enqueued: float, prompt_tokens: int, output_tokens: int,
                 priority: int, blocks_needed: int, client: int, pooled: bool) -> None:
        super().__init__(rid, enqueued, prompt_tokens, output_tokens, priority, blocks_needed)
        self.client = client
        self.pooled = pooled
        self.depart = 0.0      # slow mode: when the last frame left the server (D_k)
        self.context = 0       # slow mode: tokens in KV (prompt + generated)
        self.key = 0           # fast mode: context = key + ticks
        self.finish_tick = 0   # fast mode: ticks value at which it has all its tokens
        self.keys = None       # prefix-cache keys of its prompt blocks (or None)
        # q waiting, p prefilling, d decoding, s swapped, x gone, w admitted with its KV
        # loading from the CPU tier (``offload.load: async``); disaggregated serving
        # (``handoff``): t sent on by its prefill replica, i waiting for a decode replica
        # to take it in, l its KV landing there
        self.where = "q"
        self.ver = 0           # fast mode: heap entries with another version are stale
        self.grow_tick = 0     # fast mode: tick of the step that needs its next block
        self.join_tick = 0     # fast mode: ticks when it last joined the decoders
        self.last_t = 0.0      # fast mode: when its last token left the engine
        self.preempted_at = 0.0
        self.swapped_blocks = 0
        self.stream = None     # optional per-request stream model (``clientstream``)
        self.keys_out = None   # sessions: keys of its prompt + output blocks (``sessions``)


class Replica(ReplicaMemory, ReplicaApply, ReplicaHandoff):
    """A SimPy engine loop over one replica's queue and running set.

    ``kv_rules`` sets allocation, preemption and prefix caching (default: paged,
    recompute, no caching); ``block_bytes`` prices swapping (KV bytes per block),
    ``swap_blocks`` is the CPU swap space in blocks, ``swap_bps`` its copy bandwidth.
    ``streams``: requests carry their own stream model (``SimSeq.stream``), which
    needs ``mode='slow'``. ``speculative``: a ``model.speculative.Speculative`` (decode
    steps verify drafts and emit a drawn number of tokens per sequence; the replica
    then keeps the per-request bookkeeping, whatever ``mode`` says). ``async_sched``:
    the engine plans each step while the previous one runs (``asyncsched``): a new
    arrival waits in an inbox until a decision sees it, and epochs are off.
    ``offload_bps``: the link a CPU tier's loads take (``kv_rules.offload_blocks``; the
    rules: ``model.kv.offload``): a load lengthens the step that admits the request, or,
    with ``kv_rules.offload_async`` (vLLM's OffloadingConnector), the request waits
    (``loading``) while the others run, the link copying one load after another."""

    def queued(self) -> list:
        """Every request held here that no step has admitted yet: the waiting queue,
        then the arrivals no decision has seen yet (async scheduling's ``_inbox``).
        What the gateway, the autoscaler and the time series count as queued."""
        return [*self.waiting, *self._inbox]

    def n_queued(self) -> int:
        """``len(self.queued())`` without building the list."""
        return len(self.waiting) + len(self._inbox)

    def __init__(self, env, index: int, policy, cost, capacity_blocks: int, rec,
                 frame_time: float, one_way: float, on_finish: Callable[[SimSeq, float], None],
                 series_interval: float = 0.0, mode: str = "auto",
                 kv_rules: Optional[KVRules] = None, block_bytes: float = 0.0,
                 swap_blocks: int = 0, swap_bps: float = 25e9, streams: bool = False,
                 speculative=None, async_sched: bool = False,
                 offload_bps: float = 0.0) -> None:
        self.env = env
        self.index = index
        self.policy = policy
        self.cost = cost
        self.capacity = capacity_blocks
        self.kv = KVSpace(capacity_blocks, kv_rules or KVRules(), keys_of=lambda q: q.keys)
        self.block_bytes = block_bytes
        self.cpu_blocks = swap_blocks
        self.cpu_used = 0
        self.swap_bps = swap_bps
        self.swapped: deque[SimSeq] = deque()
        self._cancels: list[SimSeq] = []
        self._copy_s = 0.0
        self.offload_bps = offload_bps
        self._load_s = 0.0     # this step's loads from the CPU tier (``model.kv.offload``)
        self._async_load = kv_rules is not None and kv_rules.offload_async
        self.loading: list = []   # async loads: (when its KV has landed, request), in order
        self._link_free = 0.0     # when the link ends the loads queued on it
        self.rec = rec
        self.trace = getattr(rec, "trace", None)   # a ``report.decisions`` trace, or None
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
        self.spec = speculative.for_replica(index) if speculative is not None else None
        self.fast = (mode != "slow" and self.spec is None
                     and E.fast_reason(frame_time, cost.min_step_s, lim.max_num_seqs,
                                       lim.max_num_batched_tokens) is None)
        # Async scheduling: arrivals wait in ``_inbox`` until a decision sees them
        # (``asyncsched.sees``); ``_decided_at``: when the step now running was planned.
        # An epoch's interrupt rule is the synchronous one, so epochs are off with it.
        self._async = async_sched
        self._inbox: list[SimSeq] = []
        self._decided_at = -math.inf
        self._step_end = -math.inf   # when the last step ended (nothing in flight after)
        self.epochs = mode == "auto" and self.fast and not async_sched
        # Per-request stream models (``clientstream``) need the per-request mode.
        self._streams = streams
        if streams and self.fast:
            raise ValueError("per-request streams need mode='slow'")
        # Aging reorders the queue as time passes, so a blocked head can change without
        # any event; epochs then run only while nobody waits. So does a key of a policy's
        # own (``queues.heads_suffice``): an arrival may go before a blocked head.
        self._aging = policy.time_dependent or not heads_suffice(policy)
        # fast-mode decoder state
        self.ticks = 0
        self._finish_heap: list[tuple[int, int, int, SimSeq]] = []
        self._grow_heap: list[tuple[int, int, int, SimSeq]] = []
        self._last_dec_end = -1.0
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
        # Work done, read by utilisation series and queue-wait estimates: seconds in
        # steps, steps run, and an optional ``report.utilization.UtilTracker``.
        self.busy_s = 0.0
        self.steps_run = 0
        self.util = None
        # Disaggregated serving (``handoff``): the coordinator, whether this replica hands
        # requests on after their first token (a prefill replica), and the decode side's
        # hand-offs waiting to be taken in, landed, and taken in but not yet landed.
        self.handoff = None
        self.hands_off = False
        self.incoming: deque[SimSeq] = deque()
        self.landed: list[SimSeq] = []
        self._landing = 0
        self._sent = 0
        self.process = env.process(self._run())

    @property
    def outstanding_tokens(self) -> int:
        """Prompt tokens not yet prefilled plus output tokens not yet generated, now.

        Inside an epoch, the decode steps that already ended count as done, exactly as
        if the loop had stepped through them one by one (the router reads this)."""
        ends = self._epoch_ends
        if ends is None:
            return self._outstanding
        done = E.steps_ended(ends, len(ends), float(self.env.now))
        return self._outstanding - done * len(self.decoding)

    # -- arrivals -----------------------------------------------------------------
    def rejects(self, seq: SimSeq) -> Optional[str]:
        """Why ``seq`` can never run on this replica (too long for its KV), or None."""
        return self.kv.fits(seq)

    def enqueue(self, seq: SimSeq) -> None:
        """The request reaches this replica's queue now."""
        was_empty = len(self.waiting) == 0
        if self._async:
            self._inbox.append(seq)   # seen by a later decision (``_see_arrivals``)
        else:
            self.waiting.push(seq)
        self.by_id[seq.rid] = seq
        self._outstanding += seq.prompt_tokens + seq.output_tokens
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()
        elif self._in_epoch:
            c = _arrival_interrupts(self._aging, was_empty,
                                    len(self.decoding) + len(self.prefilling), self.max_num_seqs)
            if c == E.YES or (c == E.IF_FITS and _fits_now(self.kv.admission(seq)[1],
                                                            self.kv.policy_free())):
                # Admissible now: the engine must look at it at the next step boundary.
                self._in_epoch = False
                self.process.interrupt()

    # -- the engine loop -------------------------------------------------------------
    def _run(self):
        """The engine loop, as a SimPy process: wait for work; make room for the running
        requests (preempting if blocks are short), bring swapped ones back, ask the
        policy for the step, price it, wait its time, apply it; or run a decode epoch
        (steps with nothing to decide, priced together) while nobody waits.

        One generator, kept whole: every stage reads and writes the replica's state
        between two yields, and splitting it into sub-generators puts a ``yield from``
        frame on every step of the hottest loop of the SimPy model."""
        env = self.env
        rec = self.rec
        policy = self.policy
        cost = self.cost
        kv = self.kv
        while True:
            if self._cancels:
                self._apply_cancels(env.now)
            if self.landed:
                self._join_landed()
            if self._inbox:
                self._see_arrivals()
            if self.loading:
                self._loads_landed(env.now)
            if not (self.decoding or self.prefilling or len(self.waiting) or self.swapped
                    or self.loading):
                if self.incoming:
                    self._intake(env.now)
                self._wakeup = env.event()
                yield self._wakeup
                self._wakeup = None
                continue
            now = env.now
            self._copy_s = 0.0
            self._load_s = 0.0
            # Running requests first: their growth may preempt; then swapped ones come
            # back; new admissions only in a step that did neither (vLLM's order).
            hold = self._make_room(now)
            if self.swapped and not hold:
                self._swap_in(now)
            hold = hold or bool(self.swapped)
            if self.incoming and not hold:
                self._intake(now)
            decoding = self.decoding
            if self._streams:
                # ``block`` backpressure: a request whose client's buffer is full is not
                # scheduled (it keeps its KV) until the buffer drains.
                decoding = [d for d in decoding if d.stream is None or not d.stream.blocked(now)]
            state = SchedulerState(now, self.waiting, decoding, self.prefilling,
                                   kv.policy_free(hold), kv=kv,
                                   num_running=len(self.decoding) + len(self.prefilling)
                                   + len(self.loading))
            plan = policy.schedule(state)
            if self.trace is not None:
                self.trace.decide(self.index, policy, state, plan, hold)
            if plan.admit:
                plan = self._admit(plan, now)
            if plan.is_empty and len(decoding) < len(self.decoding):
                # Every runnable request is blocked on its client: wait for the first
                # buffer to drain, or for an arrival or a cancel.
                until = min(d.stream.unblock_time(now) for d in self.decoding
                            if d.stream is not None)
                self._wakeup = env.event()
                waits = [self._wakeup]
                if until < math.inf:
                    waits.append(env.timeout(max(until - now, 0.0)))
                yield env.any_of(waits)
                self._wakeup = None
                continue
            if plan.is_empty:
                if self.swapped and not (self.decoding or self.prefilling or self._landing
                                         or self.loading):
                    raise RuntimeError(f"replica {self.index}: swapped requests cannot "
                                       f"come back into an empty cache")
                if self._copy_s:
                    # Only a swap copy this iteration: charge it, then plan again.
                    yield env.timeout(self._copy_s)
                    rec.swap_copy_s += self._copy_s
                    self.busy_s += self._copy_s
                    if self.util is not None:
                        self.util.idle_copy(self._copy_s)
                    continue
                if self.loading:
                    # Only KV loads in flight: wait for the first to land (or an arrival).
                    self._wakeup = env.event()
                    until = self.loading[0][0]
                    yield env.any_of([self._wakeup, env.timeout(max(until - now, 0.0))])
                    self._wakeup = None
                    continue
                if self._sent or self._landing:
                    # Blocks held by KV in flight (``handoff``: to be sent, or landing here);
                    # the next landing frees them or lets them decode, and wakes the loop.
                    self._wakeup = env.event()
                    yield self._wakeup
                    self._wakeup = None
                    continue
                # Only waiting requests that cannot be admitted and nothing running: the
                # enqueue-time check rejects requests larger than the cache, so this is a
                # logic error, not a load condition.
                raise RuntimeError(f"replica {self.index}: policy returned an empty plan "
                                   f"with {len(self.waiting)} waiting and nothing running")
            by_id = self.by_id
            nd = len(plan.decode)
            self._decided_at = now
            k_room = 0
            # An epoch repeats this plan until something happens; a step that held
            # admissions back (a preemption, swapped requests) is not one to repeat.
            if self.epochs and _may_start(nd, len(plan.prefill), hold or bool(self.loading),
                                           self._copy_s,
                                           self._aging, len(self.waiting)):
                self._clean_top(self._finish_heap)
                k_room = _epoch_length(self._finish_heap[0][0], self.ticks, kv.paged, nd,
                                        kv.bs, kv.manager.num_free)
            if k_room > 1:
                t0 = self.ticks
                yield from self._epoch(nd, k_room)
                if self.trace is not None:
                    self.trace.step(self.index, now, env.now - now, plan, self.ticks - t0)
            else:
                if not nd:
                    dseqs, ctx_max, ctx_sum = (), 0, 0
                elif self.fast:
                    dseqs = self.decoding
                    ctx_max, ctx_sum = _tick_contexts(nd, self._key_max, self._key_sum,
                                                      self.ticks)
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
                    chunks.append((n, s.prefilled, s.completes_with(n)))
                if self.spec is not None and nd:
                    # Speculative: the target verifies k + 1 tokens per sequence (and
                    # the draft proposes them) in this step.
                    dt = self.spec.step_time(cost, nd, ctx_max, ctx_sum, chunks) + self._copy_s
                else:
                    dt = cost.step_time(nd, ctx_max, ctx_sum, chunks) + self._copy_s
                if self._load_s:
                    dt += self._load_s     # the admissions' KV loaded first
                rec.steps += 1
                rec.step_time_total += dt
                rec.swap_copy_s += self._copy_s
                self.busy_s += dt
                self.steps_run += 1
                if self.util is not None:
                    self.util.step(dt, nd, ctx_sum, chunks)
                yield env.timeout(dt)
                if self.trace is not None:
                    self.trace.step(self.index, now, dt, plan)
                t = self._step_end = env.now
                if self.fast:
                    if nd:
                        self._decode_fast(t, 1, t, None)
                elif self.spec is not None:
                    self._decode_spec(dseqs, t)
                else:
                    self._decode_slow(dseqs, t)
                self._prefill(plan.prefill, t)
                self._finish_due(t)
            if env.now - self._last_sample >= self._series_interval:
                self._sample(env.now)
                if self.util is not None:
                    self.util.sample(env.now)

    def _see_arrivals(self) -> None:
        """Async scheduling: move into the waiting queue the arrivals the decision now
        sees (``asyncsched.sees``): those that came by the previous decision, or all of
        them when the engine had nothing planned ahead: no step ended just now (it
        waited: idle, or every decoder blocked on its client), or nothing to run."""
        idle = (self.env.now != self._step_end
                or not (self.decoding or self.prefilling or len(self.waiting) or self.swapped))
        keep = []
        for s in self._inbox:
            if _sees(s.enqueued, self._decided_at, idle):
                self.waiting.push(s)
            else:
                keep.append(s)
        self._inbox = keep

    def _admit(self, plan: StepPlan, now: float) -> StepPlan:
        """Move the plan's admissions into the running set (``KVSpace.admit_plan``); with
        asynchronous loads, one whose KV is loading waits (``loading``), its chunk out of
        this step."""
        rec = self.rec
        deferred = []

        def admitted(seq, cached: int, recovered: int) -> None:
            rid = seq.rid
            self.waiting.remove(seq)
            if cached:
                rec.cached_tokens[rid] += cached
                self.kv_tokens += cached
                self._outstanding -= cached
            rec.scheduled[rid], waited, again = _admission_times(rec.scheduled[rid],
                                                                 seq.preempted_at, now)
            if again:
                rec.preempted_s[rid] += waited
                # Dropped KV that a re-admission's prefix hit recovers is not recomputed.
                rec.recomputed_tokens[rid] -= recovered
            loaded = self.kv.manager.loaded
            if loaded:
                # Its KV from the CPU tier: copied before the step's forward pass (sync),
                # or while other steps run (async).
                tok, secs = _load_charge(loaded, self.kv.bs, self.block_bytes,
                                         self.offload_bps)
                if rec.kv_load_s is not None:
                    rec.loaded_tokens[rid] += tok
                    rec.kv_load_s[rid] += secs
                if self._async_load:
                    # One link: a load starts when the one before it ends.
                    ready = (now if now > self._link_free else self._link_free) + secs
                    self._link_free = ready
                    seq.where = "w"
                    self.loading.append((ready, seq))
                    deferred.append(rid)
                    return
                self._load_s += secs
            seq.where = "p"
            self.prefilling.append(seq)

        plan = self.kv.admit_plan(plan, self.by_id.__getitem__, admitted)
        if deferred:
            plan = StepPlan(decode=plan.decode,
                            prefill=tuple(c for c in plan.prefill if c[0] not in deferred),
                            admit=plan.admit)
        return plan

    def _loads_landed(self, now: float) -> None:
        """Asynchronous loads whose KV has landed by ``now``: those requests prefill from
        the next step on (vLLM schedules them once ``finished_recving`` reports them)."""
        keep = []
        for e in self.loading:
            if e[0] <= now:
                e[1].where = "p"
                self.prefilling.append(e[1])
            else:
                keep.append(e)
        self.loading = keep

    def _epoch(self, nd: int, k: int):
        """``k`` decode-only steps, or fewer if an admissible arrival (or a cancel)
        interrupts: up to the first finish, within the blocks free for growth."""
        env = self.env
        now = env.now
        ctx0 = epoch_context(self.cost.padded, nd, self._key_max, self._key_sum, self.ticks)
        ends = np.empty(k)
        E.step_ends(float(now), np.asarray(self.cost.decode_times(nd, ctx0, k), dtype=np.float64),
                    k, ends)
        self._in_epoch = True
        self._epoch_ends = ends
        try:
            yield env.timeout(ends[-1] - now)
            m = k
        except simpy.Interrupt:
            # Steps run to completion: the one in progress ends, then the engine re-plans.
            m = E.steps_run(ends, k, float(env.now))
            self._in_epoch = False
            yield env.timeout(max(ends[m - 1] - env.now, 0.0))
        self._in_epoch = False
        self._epoch_ends = None
        self.rec.steps += m
        self.rec.step_time_total += ends[m - 1] - now
        self.busy_s += ends[m - 1] - now
        self.steps_run += m
        if self.util is not None:
            self.util.decode_run(ends[m - 1] - now, m, nd, self._key_sum + nd * self.ticks)
        gaps = [ends[i + 1] - ends[i] for i in range(m - 1)] if m > 1 else None
        self._decode_fast(env.now, m, ends[0], gaps)
        if self.kv.paged:
            self._catch_up_growth()
        self._finish_due(env.now)
