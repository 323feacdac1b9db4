"""The replica model without SimPy: the same model, run by its own event loop.

``simulate`` builds the SimPy model of ``replica`` and ``wire``. Most large runs use
only part of it: chunked or fifo scheduling, no per-request stream models, no
prefix caching, frames that always leave faster than a step (the replica's *fast*
bookkeeping with decode epochs). For those, this module replays the *same* model
with a plain event loop and the two policies' decisions written inline, because a
SimPy step (event objects, generator resumption, a ``SchedulerState`` and a frozen
``StepPlan`` per step) costs several times the work the step itself does.

It is not an approximation:

- events are processed in SimPy's order - by time, then priority (an interrupt is
  urgent), then the order they were scheduled in - and they are scheduled at the
  same moments as in the SimPy model, so ties resolve the same way;
- every formula is the replica's (ticks, finish and growth heaps, epochs cut by an
  admissible arrival at the next step boundary, growth caught up after an epoch),
  with the same floating-point operations in the same order;
- the cost model, routers, connection pools and recorder are the very objects the
  SimPy model uses.

``tests/test_fastloop.py`` checks that every recorded array, the ITL histogram, the
time series, the step tallies and the end time are identical, bit for bit, on
random configurations. The inline decisions are a second copy of ``FifoPolicy`` /
``ChunkedPolicy``: that test is what keeps them the same.

When a run needs what this loop does not model (a preemption: growth finds too few
free blocks; an empty plan, which the SimPy model reports as an error) it raises
``Unsupported`` and ``simulate`` runs the scenario again with SimPy.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections import deque
from itertools import accumulate
from typing import Optional

from .kvcache import blocks_for
from .replica import MAX_EPOCH_STEPS
from .scheduling.policies import ChunkedPolicy, FifoPolicy

URGENT, NORMAL = 0, 1                       # SimPy's priorities
_ARRIVE, _DELIVER, _END, _WAKE, _INTERRUPT, _STOP = range(6)


class Unsupported(Exception):
    """This run needs the SimPy model (the message says why)."""


def unsupported_reason(policy, rules, rich: bool, mode: str, cost_model,
                       frame_time: float, costs, router: str) -> Optional[str]:
    """Why this loop cannot run the configuration (None if it can)."""
    if mode != "auto":
        return f"bookkeeping mode {mode!r} was asked for"
    if rich:
        return "per-request stream models"
    if cost_model is not None:
        return "a cost model passed in"
    if type(policy) not in (ChunkedPolicy, FifoPolicy):
        return f"policy {policy.name!r}"
    if rules.prefix_caching and rules.allocation == "paged":
        return "prefix caching"
    if router not in ("round_robin", "random", "least_outstanding"):
        return f"router {router!r}"
    lim = policy.limits
    if lim.max_num_seqs > lim.max_num_batched_tokens:
        return "max_num_seqs above the token budget"
    if any(frame_time > c.min_step_s for c in costs):
        return "frames slower than the fastest step"
    return None


class _Req:
    """A request inside this loop (the fields of ``replica.SimSeq`` it needs)."""

    __slots__ = ("rid", "prompt", "output", "client", "pooled", "prefilled", "generated",
                 "held", "key", "finish_tick", "ver", "grow_tick", "join_tick", "last_t")

    def __init__(self, rid: int, prompt: int, output: int, client: int, pooled: bool) -> None:
        self.rid = rid
        self.prompt = prompt
        self.output = output
        self.client = client
        self.pooled = pooled
        self.prefilled = 0
        self.generated = 0
        self.held = 0
        self.key = 0
        self.finish_tick = 0
        self.ver = 0
        self.grow_tick = 0
        self.join_tick = 0
        self.last_t = 0.0


class _Stats:
    """The block-manager tallies ``kvreport.kv_run_stats`` reads (no prefix cache)."""

    __slots__ = ("queried_blocks", "hit_blocks", "queried_tokens", "cached_tokens",
                 "evictions", "admissions")

    def __init__(self) -> None:
        for k in self.__slots__:
            setattr(self, k, 0)


class FastReplica:
    """One replica: ``Replica``'s fast bookkeeping with the policy inlined."""

    def __init__(self, loop: "FastLoop", index: int, policy, cost, capacity: int, rules,
                 rec, frame_time: float, one_way: float, series_interval: float) -> None:
        self.loop = loop
        self.index = index
        self.cost = cost
        lim = policy.limits
        self.fifo = type(policy) is FifoPolicy
        self.budget = lim.max_num_batched_tokens
        self.max_seqs = lim.max_num_seqs
        self.chunk = getattr(policy, "chunk_size", 0)
        self.capacity = capacity
        self.num_free = capacity
        self.watermark = int(rules.watermark * capacity)
        self.paged = rules.allocation == "paged"
        self.bs = rules.block_size
        self.max_model_len = rules.max_model_len
        self.stats = _Stats()
        self.rec = rec
        self.ft = frame_time
        self.one_way = one_way
        self.waiting: deque[_Req] = deque()
        self.decoding: list[_Req] = []
        self.prefilling: list[_Req] = []
        self.kv_tokens = 0
        self._outstanding = 0
        self.ticks = 0
        self.finish_heap: list = []
        self.grow_heap: list = []
        self.last_dec_end = -1.0
        self.key_sum = 0
        self.key_max = 0
        self.last_tok: dict[float, int] = {}
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
            return s.prompt
        r = self.max_model_len
        return r if r is not None else s.prompt + s.output

    def adm_blocks(self, s: _Req) -> int:
        """Blocks admitting ``s`` takes (``KVSpace.admission`` without a prefix cache)."""
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
        self.waiting.append(s)
        self._outstanding += s.prompt + s.output
        if self.idle:
            if not self.wake_pending:
                self.wake_pending = True
                self.loop.push(now, NORMAL, _WAKE, self)
        elif self.in_epoch and (
                was_empty and len(self.decoding) + len(self.prefilling) < self.max_seqs
                and self.adm_blocks(s) <= self.num_free - self.watermark):
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
        if not (decoding or prefilling or waiting):
            self.idle = True
            return
        ticks = self.ticks
        if self.paged and decoding:
            heap = self.grow_heap
            if heap and heap[0][0] <= ticks:
                due = []
                while heap and heap[0][0] <= ticks:
                    e = heapq.heappop(heap)
                    if e[2] == e[3].ver:
                        due.append(e[3])
                if len(due) > self.num_free:
                    raise Unsupported("a preemption (KV blocks short for growth)")
                bs = self.bs
                for s in due:
                    need = -(-(s.key + ticks) // bs) - s.held
                    if need > 0:
                        self.num_free -= need
                        s.held += need
                    s.grow_tick = s.held * bs - s.key + 1
                    heapq.heappush(heap, (s.grow_tick, s.rid, s.ver, s))
        free = self.num_free - self.watermark
        chunks = []
        admit = 0
        if self.fifo:
            nd = 0
            used = 0
            budget = self.budget
            for s in prefilling:
                n = s.prompt - s.prefilled
                if chunks and used + n > budget:
                    break
                chunks.append((s, n))
                used += n
            if waiting:
                running = len(decoding) + len(prefilling)
                for s in waiting:
                    if running >= self.max_seqs:
                        break
                    need = self.adm_blocks(s)
                    n = s.prompt - s.prefilled
                    if (chunks and used + n > budget) or need > free:
                        break
                    chunks.append((s, n))
                    admit += 1
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
                n = s.prompt - s.prefilled
                n = n if n < cs else cs
                n = n if n < left else left
                chunks.append((s, n))
                left -= n
            if left > 0 and waiting:
                running = nd + len(prefilling)
                for s in waiting:
                    if left <= 0 or running >= self.max_seqs:
                        break
                    need = self.adm_blocks(s)
                    if need > free:
                        break
                    n = s.prompt - s.prefilled
                    n = n if n < cs else cs
                    n = n if n < left else left
                    chunks.append((s, n))
                    admit += 1
                    left -= n
                    running += 1
                    free -= need
        if not nd and not chunks:
            raise Unsupported("an empty plan")
        if admit:
            rec_sched = self.rec.scheduled
            st = self.stats
            for _ in range(admit):
                s = waiting.popleft()
                tokens = self.adm_tokens(s)
                need = -(-tokens // self.bs)
                self.num_free -= need
                s.held = need
                st.admissions += 1
                st.queried_tokens += tokens
                rec_sched[s.rid] = now
                prefilling.append(s)
        loop = self.loop
        rec = self.rec
        if nd and not chunks:
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
        parts = [(n, s.prefilled, s.prefilled + n >= s.prompt) for s, n in chunks]
        dt = self.cost.step_time(nd, ctx_max, ctx_sum, parts) + 0.0
        rec.steps += 1
        rec.step_time_total += dt
        self.step = (nd, chunks)
        self.epoch = None
        self.ver += 1
        loop.push(now + dt, NORMAL, _END, self, self.ver)

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
                self._catch_up_growth()
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
    def _decode(self, t: float, m: int, first_end: float, later_gaps) -> None:
        itl = self.rec.itl
        nd = len(self.decoding)
        for tl, c in self.last_tok.items():
            if c:
                itl.add(first_end - tl, c)
        if later_gaps is not None:
            itl.add_many(later_gaps, nd)
        self.last_tok = {t: nd}
        self.last_dec_end = t
        self.ticks += m
        self.kv_tokens += m * nd
        self._outstanding -= m * nd

    def _prefill(self, chunks, t: float) -> None:
        rec = self.rec
        ft = self.ft
        tokens = 0
        for s, n in chunks:
            s.prefilled += n
            done = s.prefilled >= s.prompt
            tokens += n + done
            if not done:
                continue
            self.prefilling.remove(s)
            s.generated += 1
            rec.first_token[s.rid] = t
            rec.first_delivered[s.rid] = t + ft + self.one_way
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

    def _join(self, s: _Req, last_token_t: float) -> None:
        ticks = self.ticks
        s.ver += 1
        key = s.prompt + s.generated - ticks
        s.key = key
        s.join_tick = ticks
        s.last_t = last_token_t
        s.finish_tick = ticks + s.output - s.generated
        heapq.heappush(self.finish_heap, (s.finish_tick, s.rid, s.ver, s))
        self.key_sum += key
        if len(self.decoding) == 1 or key > self.key_max:
            self.key_max = key
        self.last_tok[last_token_t] = self.last_tok.get(last_token_t, 0) + 1
        if self.paged:
            s.grow_tick = s.held * self.bs - key + 1
            heapq.heappush(self.grow_heap, (s.grow_tick, s.rid, s.ver, s))

    def _catch_up_growth(self) -> None:
        heap = self.grow_heap
        bs = self.bs
        ticks = self.ticks
        while heap and heap[0][0] < ticks:
            tick, _, ver, s = heapq.heappop(heap)
            if ver != s.ver:
                continue
            need = -(-(s.key + tick) // bs) - s.held
            if need > 0:
                if need > self.num_free:
                    raise Unsupported("growth beyond the free blocks")
                self.num_free -= need
                s.held += need
            s.grow_tick = s.held * bs - s.key + 1
            heapq.heappush(heap, (s.grow_tick, s.rid, s.ver, s))

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
        self.last_tok[t] -= len(done)
        recompute = False
        ft = self.ft
        for s in done:
            s.generated = s.output
            s.ver += 1
            self.key_sum -= s.key
            recompute |= s.key == self.key_max
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
        self.num_free += s.held
        s.held = 0
        self.kv_tokens -= s.prompt + s.generated
        self.loop.pools.release(s.client, arrived, s.pooled)

    def _sample(self, t: float) -> None:
        ts, wq, run, blk, kv, shared = self.series
        ts.append(t)
        wq.append(len(self.waiting))
        run.append(len(self.decoding) + len(self.prefilling))
        blk.append(self.capacity - self.num_free)
        kv.append(self.kv_tokens)
        shared.append(0)
        self.last_sample = t


class FastLoop:
    """The event loop: arrivals, deliveries, and each replica's step ends (see module doc)."""

    def __init__(self, *, rec, n_replicas: int, policy, costs, capacity,
                 rules, router, pools, net, frame_time: float, one_way: float,
                 series_interval: float, arrival, prompt, output, clients,
                 until: Optional[float]) -> None:
        self.now = 0.0
        self._heap: list = []
        self._eid = 0
        self.rec = rec
        self.router = router
        self.pools = pools
        self.net = net
        self.one_way = one_way
        self.arrival = arrival.tolist()
        self.prompt = prompt.tolist()
        self.output = output.tolist()
        self.clients = [int(c) for c in clients]
        self.until = until
        self.replicas = [FastReplica(self, i, policy, costs[i], capacity, rules, rec,
                                     frame_time, one_way, series_interval)
                         for i in range(n_replicas)]
        self._next = 0        # the arrival process: next request, and its clock ``t``
        self._t = 0.0

    def push(self, t: float, prio: int, kind: int, obj=None, ver: int = 0) -> None:
        heapq.heappush(self._heap, (t, prio, self._eid, kind, obj, ver))
        self._eid += 1

    def run(self) -> float:
        """Run to the end (or ``until``); returns the clock at the end, as SimPy's ``now``."""
        # SimPy's start: each replica's process and then the arrival process are
        # initialised (urgent, at 0); ``run(until)`` then schedules its stop (urgent).
        self._eid = len(self.replicas)
        self.push(0.0, URGENT, _ARRIVE)
        if self.until is not None:
            self.push(float(self.until), URGENT, _STOP)
        heap = self._heap
        pop = heapq.heappop
        resumed = False
        while heap:
            t, _, _, kind, obj, ver = pop(heap)
            self.now = t
            if kind == _END:
                if ver == obj.ver:
                    obj.ended(t)
            elif kind == _DELIVER:
                self._deliver(obj, t)
            elif kind == _ARRIVE:
                self._arrivals(t, resumed)
                resumed = True
            elif kind == _WAKE:
                obj.woken(t)
            elif kind == _INTERRUPT:
                obj.interrupted(t)
            else:
                break
        return self.now

    def _arrivals(self, now: float, resumed: bool) -> None:
        """``simulate.arrivals``: send every request whose time has come."""
        arrival, prompt, output, clients = self.arrival, self.prompt, self.output, self.clients
        pools, net, rec = self.pools, self.net, self.rec
        new_conn = rec.new_connection
        handshake = net.handshake
        rid = self._next
        n = len(arrival)
        while rid < n:
            a = arrival[rid]
            if not resumed and a > self._t:
                self.push(now + (a - self._t), NORMAL, _ARRIVE)
                self._t = a
                self._next = rid
                return
            resumed = False
            c = clients[rid]
            is_new, pooled = pools.acquire(c, now)
            new_conn[rid] = is_new
            p = prompt[rid]
            s = _Req(rid, p, output[rid], c, pooled)
            t_net = net.send_time(p) + (handshake if is_new else 0.0)
            self.push(now + t_net, NORMAL, _DELIVER, s)
            rid += 1
        self._next = n

    def _deliver(self, s: _Req, now: float) -> None:
        rec = self.rec
        rid = s.rid
        rec.enqueued[rid] = now
        replicas = self.replicas
        if replicas[0].rejects(s):
            rec.rejected[rid] = True
            self.pools.release(s.client, now + self.one_way, s.pooled)
            return
        k = self.router.pick(replicas, s)
        rec.replica[rid] = k
        replicas[k].enqueue(s, now)
