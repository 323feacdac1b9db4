"""Continuous batching over the simulator's scheduling policies, on a real model.

``EngineCore`` is the real executor of the simulator's policies: it holds the requests
(``simulator.model.scheduling.Seq``), a waiting queue made by ``policy.new_queue()``
and the running lists ``decoding``/``prefilling``; each ``step()`` snapshots a
``SchedulerState``, asks the policy for a ``StepPlan`` -- the very objects the
SimPy replica uses -- and executes that plan as one token-packed forward.

KV memory is a ``simulator.model.kv.space.KVSpace`` over the simulator's block manager
(``kv_rules``: allocation, preemption, victim order, watermark, prefix caching),
so the engine's memory decisions are the simulator's (``simulator.loops.simpy.replica`` and
``simulator.loops.simpy.memory`` are the reference). Semantics (the simulator assumes exactly
these):

- one ``step()``: (1) every decoder whose next token crosses a block boundary
  takes a block (``paged``); while blocks are short a victim
  (``kv.space.select_victim`` over decoding + prefilling) is preempted; (2) if
  nobody was preempted, swapped-out requests come back, oldest first, while they
  fit; (3) the policy plans with ``free_blocks = 0`` if anything was preempted or
  is still swapped out, else ``kv.policy_free()``, and prices admissions through
  ``kv`` (prefix hits); (4) admissions allocate their blocks (``kv.admit``: an
  admitted request starts its prefill at its cached tokens, attending to the
  shared blocks as prior context); (5) the forward; (6) prefill progress (full
  computed blocks are registered for reuse), tokens, finishes.
- a prefill chunk advances ``prefilled``; the chunk that completes
  ``prefill_len`` samples a token at the end of that step: the first one, or,
  for a request recomputing after a preemption, its next one;
- preemption by ``recompute``: the victim's blocks are freed, ``prefilled = 0``,
  ``prefill_len = prompt + generated`` (a decoder) and it is requeued at the head
  of its turn; readmitted, it prefills its prompt and generated token ids.
  ``swap``: a decoding victim's blocks are copied to host tensors (up to
  ``swap_blocks`` blocks in all) and back when it returns; a prefilling victim,
  or one the swap space cannot take, is recomputed;
- a decode samples one token; a request produces exactly ``output_tokens``
  tokens (EOS is ignored) and finishes in the step producing the last, freeing
  its blocks; ``output_tokens == 1`` finishes in its last prefill step;
- ``pause``d requests keep their blocks and count towards ``max_num_seqs`` but
  are neither scheduled, grown nor picked as victims; ``cancel`` frees a
  request's blocks at once, wherever it is;
- sampling is greedy argmax over the LM head of the sampled rows only; the
  sampled ids are copied to the host (a device sync) before the step ends.

``execute(plan)`` runs a plan's forward on the current state without applying
it: the profiler times exactly this, so the profile describes the engine that
serves.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from simulator.model.kv.blocks import kv_bytes_per_token, request_blocks
from simulator.model.kv.space import KVRules, KVSpace
from simulator.model.kv.prefixkeys import keys_from_tokens
from simulator.model.scheduling import SchedulerState, Seq, StepPlan
from simulator.model.warmup import warm_up as warm_up_kernels

from real_engine.engine_memory import EngineMemory
from real_engine.graphs import DecodeGraphs
from real_engine.kv import HostStep, PagedKVCache, build_host_step, to_device
from real_engine.model import Transformer


@dataclass
class Request:
    """Executor-private data of a request (``Seq.payload``): its token ids, and what
    its KV memory went through."""

    prompt_ids: np.ndarray
    out_ids: list = field(default_factory=list)
    preemptions: int = 0
    recomputed_tokens: int = 0   # KV dropped by recompute preemptions, prefilled again
    swapped_blocks: int = 0      # blocks of its KV in host memory now (swap)
    swapped: Optional[tuple] = None   # the host copy of its KV while swapped out
    preempted_at: float = 0.0
    preempted_s: float = 0.0     # time spent preempted (waiting again or swapped)
    _ids: Optional[np.ndarray] = field(default=None, repr=False)
    _keys: Optional[list] = field(default=None, repr=False)

    def prefill_ids(self, prefill_len: int) -> np.ndarray:
        """Token ids of the first ``prefill_len`` positions: the prompt, then the
        generated tokens (a request recomputing after a preemption)."""
        P = len(self.prompt_ids)
        if prefill_len == P:
            return self.prompt_ids
        ids = self._ids
        if ids is None or len(ids) != prefill_len:
            ids = self._ids = np.concatenate(
                [self.prompt_ids, np.asarray(self.out_ids[:prefill_len - P], np.int64)])
        return ids

    def keys(self, block_size: int) -> list:
        """Prefix-cache keys of the prompt's full blocks. Only the prompt is named, as
        the simulator names it (``simulator.model.kv.prefixkeys``): a request recomputing after
        a preemption can hit its own prompt blocks, never its generated ones (naming
        those too would change which cached blocks are evicted first, so the two
        executors' hits would drift apart)."""
        if self._keys is None:
            self._keys = keys_from_tokens(self.prompt_ids, block_size)
        return self._keys


@dataclass
class StepResult:
    """What one ``step()`` did. Times are on the engine's clock (seconds).

    ``chunks``: per prefill chunk of the plan, ``(n, prior, completes)`` as the
    simulator's cost model sees it (``prior`` counts cached tokens: a prefix hit,
    or earlier chunks); ``ctx_sum``/``ctx_max``: the decodes' contexts (KV entries
    attended, the new token included). ``preempted``: requests preempted before
    the plan (in order), ``swapped_in``: swapped-out requests brought back."""

    plan: StepPlan
    tokens: dict            # rid -> token id emitted by this step
    finished: tuple         # rids that produced their last token in this step
    admitted: tuple
    t_start: float
    t_end: float
    n_running: int          # after the step
    n_waiting: int
    timings: dict = field(default_factory=dict)   # seconds: schedule, prepare, issue, sync, apply
    graphed: bool = False
    preempted: tuple = ()
    swapped_in: tuple = ()
    chunks: tuple = ()
    ctx_sum: int = 0
    ctx_max: int = 0

    @property
    def wall_s(self) -> float:
        return self.t_end - self.t_start

    @property
    def n_decode(self) -> int:
        return len(self.plan.decode)

    @property
    def n_prefill_tokens(self) -> int:
        return self.plan.num_prefill_tokens


class EngineCore(EngineMemory):
    """A continuous-batching engine: requests in, one packed forward per ``step()``.

    ``kv_rules`` (``simulator.model.kv.space.KVRules``): paged or contiguous allocation,
    preemption by recompute or swap, victim order, watermark, prefix caching;
    ``block_size``, when given, overrides ``kv_rules.block_size``. ``swap_blocks``:
    host swap space in blocks (None: unlimited)."""

    def __init__(self, model: Transformer, policy, *, num_blocks: Optional[int] = None,
                 block_size: Optional[int] = None, kv_rules: KVRules = KVRules(),
                 swap_blocks: Optional[int] = None, cuda_graphs: Optional[bool] = None,
                 graph_max_batch: int = 64, clock: Callable[[], float] = time.perf_counter,
                 seed: int = 0) -> None:
        if block_size is not None and block_size != kv_rules.block_size:
            kv_rules = dataclasses.replace(kv_rules, block_size=block_size)
        if kv_rules.allocation not in ("paged", "contiguous"):
            raise ValueError(f"unknown KV allocation {kv_rules.allocation!r}")
        if kv_rules.preemption not in ("recompute", "swap"):
            raise ValueError(f"unknown preemption {kv_rules.preemption!r}")
        if kv_rules.victim not in ("priority", "latest"):
            raise ValueError(f"unknown victim order {kv_rules.victim!r}")
        self.model = model
        self.policy = policy
        # The scheduling and memory rules are compiled kernels: load them before serving.
        warm_up_kernels()
        self.device = model.device
        bs = kv_rules.block_size
        n = num_blocks or default_num_blocks(model, bs)
        self.kv = KVSpace(n, kv_rules, keys_of=self._keys_of, track_ids=True)
        c = model.cfg
        self.cache = PagedKVCache(c.n_layers, c.n_kv_heads, c.head_dim, n, block_size=bs,
                                  device=model.device, dtype=model.dtype, kv=self.kv)
        self.swap_blocks = swap_blocks
        self.cpu_used = 0                      # blocks held in host memory by swapped requests
        self.clock = clock
        self.waiting = policy.new_queue()
        self.decoding: list[Seq] = []
        self.prefilling: list[Seq] = []
        # Decoding requests taken off the schedule by ``pause`` (they keep their KV).
        self.paused: dict[int, Seq] = {}
        # Decoding requests whose KV is in host memory (``swap`` preemption), oldest first.
        self.swapped: deque[Seq] = deque()
        self.seqs: dict[int, Seq] = {}
        self.stats = {"preemptions": 0, "recomputed_tokens": 0, "swap_outs": 0,
                      "swapped_blocks": 0, "cached_tokens": 0}
        self.rng = np.random.default_rng(seed)
        on_cuda = self.device.type == "cuda"
        self.graphs = (DecodeGraphs(model, self.cache, max_batch=graph_max_batch)
                       if (on_cuda if cuda_graphs is None else cuda_graphs) else None)
        self.use_graphs = self.graphs is not None

    def _keys_of(self, seq: Seq) -> list:
        return seq.payload.keys(self.kv.bs)

    # -- requests ---------------------------------------------------------------
    def add_request(self, rid: int, prompt: int | Sequence[int], output_tokens: int,
                    priority: int = 0, now: Optional[float] = None) -> Seq:
        """Enqueue a request. ``prompt`` is its token ids, or a length (random ids).
        Raises ``ValueError`` if it could never run (too long for the model or the KV)."""
        if rid in self.seqs:
            raise ValueError(f"request {rid} already exists")
        ids = (self.rng.integers(0, self.model.cfg.vocab, int(prompt), dtype=np.int64)
               if np.isscalar(prompt) else np.asarray(prompt, dtype=np.int64))
        P, O = len(ids), int(output_tokens)
        if P < 1 or O < 1:
            raise ValueError(f"request {rid}: prompt and output must be >= 1 token")
        why = self.never_runs(P, O)
        if why is not None:
            raise ValueError(f"request {rid}: {why}")
        seq = Seq(rid, self.clock() if now is None else now, P, O, priority=priority,
                  blocks_needed=request_blocks(P, O, self.kv.bs), payload=Request(ids))
        self.seqs[rid] = seq
        self.waiting.push(seq)
        return seq

    def never_runs(self, prompt_tokens: int, output_tokens: int) -> Optional[str]:
        """Why a request of these lengths could never run here, or None: the model's
        context, then the KV memory rule the simulator applies (``KVSpace.fits``:
        capacity less the watermark, a contiguous slot's size). Reads only settings
        fixed at construction, so the server may ask from its own thread."""
        P, O = int(prompt_tokens), int(output_tokens)
        if P + O > self.model.cfg.max_seq_len:
            return f"{P}+{O} tokens exceed max_seq_len {self.model.cfg.max_seq_len}"
        return self.kv.fits(Seq(-1, 0.0, P, O))

    def cancel(self, rid: int) -> bool:
        """Drop a request now, wherever it is (waiting, running, paused, swapped out);
        its blocks are freed at once."""
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return False
        if self.cache.holds(rid):
            self.cache.release(rid)
            if self.paused.pop(rid, None) is None:
                (self.decoding if seq in self.decoding else self.prefilling).remove(seq)
        elif seq.payload.swapped is not None:
            self.swapped.remove(seq)
            self._drop_swap(seq)
        else:
            self.waiting.remove(seq)
        return True

    def pause(self, rid: int) -> bool:
        """Stop scheduling a decoding request, keeping its KV blocks (``block``
        backpressure: its client is not reading). The policy no longer sees it.
        False if ``rid`` is not decoding (finished, still prefilling, already paused)."""
        seq = self.seqs.get(rid)
        if seq is None or seq not in self.decoding:
            return False
        self.decoding.remove(seq)
        self.paused[rid] = seq
        return True

    def resume(self, rid: int) -> bool:
        """Put a paused request back among the decoding ones; False if it is not paused."""
        seq = self.paused.pop(rid, None)
        if seq is None:
            return False
        self.decoding.append(seq)
        return True

    @property
    def has_work(self) -> bool:
        # Paused requests are not work: a step would schedule nothing for them.
        return bool(self.decoding or self.prefilling or len(self.waiting) or self.swapped)

    @property
    def num_running(self) -> int:
        # Paused requests still hold their KV: they count as running.
        return len(self.decoding) + len(self.prefilling) + len(self.paused)

    # -- one iteration ------------------------------------------------------------
    def step(self) -> StepResult:
        """Make room, schedule, execute and apply one iteration (see module doc)."""
        t0 = self.clock()
        preempted = self._make_room(t0)
        swapped_in = self._swap_in(t0) if self.swapped and not preempted else []
        hold = bool(preempted) or bool(self.swapped)
        state = SchedulerState(now=t0, waiting=self.waiting, decoding=self.decoding,
                               prefilling=self.prefilling,
                               free_blocks=self.kv.policy_free(hold),
                               num_running=self.num_running, kv=self.kv)
        plan = self.policy.schedule(state)
        if plan.admit:
            plan = self._admit(plan, t0)
        t1 = self.clock()
        timings = {"schedule": t1 - t0}
        if plan.is_empty:
            return StepResult(plan, {}, (), tuple(plan.admit), t0, t1, self.num_running,
                              len(self.waiting), timings, preempted=tuple(preempted),
                              swapped_in=tuple(swapped_in))
        seqs = self.seqs
        ctx = [seqs[r].prompt_tokens + seqs[r].generated for r in plan.decode]
        chunks = tuple((n, seqs[r].prefilled, seqs[r].completes_with(n))
                       for r, n in plan.prefill)
        sampled, graphed = self.execute(plan, timings)
        t2 = self.clock()
        tokens, finished = self._apply(plan, sampled)
        t3 = self.clock()
        timings["apply"] = t3 - t2
        return StepResult(plan, tokens, finished, tuple(plan.admit), t0, t3, self.num_running,
                          len(self.waiting), timings, graphed, tuple(preempted),
                          tuple(swapped_in), chunks, sum(ctx), max(ctx, default=0))

    def host_step(self, plan: StepPlan) -> HostStep:
        """Describe a plan's packed step from the current state (host only)."""
        decodes, chunks = [], []
        cache = self.cache
        for rid in plan.decode:
            s = self.seqs[rid]
            r: Request = s.payload
            # The input is the last sampled token; it sits at position prompt+generated-1.
            decodes.append((cache.table(rid), s.prompt_tokens + s.generated, r.out_ids[-1]))
        for rid, n in plan.prefill:
            s = self.seqs[rid]
            if not 0 < n <= s.remaining_prefill:
                raise ValueError(f"plan prefills {n} tokens of request {rid}, "
                                 f"{s.remaining_prefill} remain")
            p = s.prefilled
            ids = s.payload.prefill_ids(s.prefill_len)
            chunks.append((cache.table(rid), p, ids[p:p + n], p + n == s.prefill_len))
        return build_host_step(decodes, chunks, cache)

    def execute(self, plan: StepPlan, timings: Optional[dict] = None) -> tuple[np.ndarray, bool]:
        """Run ``plan``'s forward and greedy sampling; state is not changed.

        Returns the sampled ids (decodes in plan order, then each prefill chunk
        that completes its prefill, in plan order) on the host, and whether a CUDA
        graph ran. Ends with the device-to-host copy, which synchronizes.
        """
        clock = time.perf_counter
        t0 = clock()
        h = self.host_step(plan)
        graphed = self.use_graphs and self.graphs.supports(h)
        with torch.no_grad():
            if graphed:
                t1 = clock()
                ids = self.graphs.run(h)
            else:
                meta = to_device(h, self.cache)
                t1 = clock()
                hidden = self.model(meta, self.cache)
                ids = self.model.logits(hidden, meta.sample_rows).argmax(-1)
            t2 = clock()
            out = ids.cpu().numpy()
        if timings is not None:
            timings.update(prepare=t1 - t0, issue=t2 - t1, sync=clock() - t2)
        return out, graphed

    def _apply(self, plan: StepPlan, sampled: np.ndarray) -> tuple[dict, tuple]:
        """Advance the requests by the plan's outcome; free finished ones."""
        tokens: dict[int, int] = {}
        finished: list[int] = []
        kv = self.kv
        i = 0
        for rid in plan.decode:
            s = self.seqs[rid]
            tok = int(sampled[i])
            i += 1
            s.payload.out_ids.append(tok)
            tokens[rid] = tok
            if s.emit():
                finished.append(rid)
        newly_decoding = []
        for rid, n in plan.prefill:
            s = self.seqs[rid]
            completes = s.prefill_chunk(n)
            kv.computed(s)
            if not completes:
                continue
            # The first token, or (recomputing after a preemption) the next one.
            tok = int(sampled[i])
            i += 1
            s.payload.out_ids.append(tok)
            tokens[rid] = tok
            self.prefilling.remove(s)
            if s.emit():
                finished.append(rid)
            else:
                newly_decoding.append(s)
        if finished:
            done = set(finished)
            self.decoding = [s for s in self.decoding if s.rid not in done]
            for rid in finished:
                self.cache.release(rid)
                del self.seqs[rid]
        self.decoding.extend(newly_decoding)
        return tokens, tuple(finished)

    # -- profiling hooks ------------------------------------------------------------
    def install_running(self, rid: int, prompt_tokens: int, output_tokens: int, *,
                        prefilled: int, generated: int = 0) -> Seq:
        """Put a request straight into the running set in a given state (random ids,
        blocks for prompt + output allocated, no prefix lookup). For the profiler:
        builds a step's state without serving up to it. The KV of the 'already
        computed' tokens is whatever the cache holds."""
        seq = self.add_request(rid, prompt_tokens, output_tokens)
        self.waiting.remove(seq)
        self.cache.reserve(rid, seq.blocks_needed)
        seq.prefilled = prefilled
        seq.generated = generated
        seq.payload.out_ids.extend(self.rng.integers(0, self.model.cfg.vocab, generated).tolist())
        (self.decoding if prefilled == prompt_tokens else self.prefilling).append(seq)
        return seq

    def clear(self) -> None:
        """Cancel every request (waiting, running, paused, swapped out)."""
        for rid in list(self.seqs):
            self.cancel(rid)


def default_num_blocks(model: Transformer, block_size: int = 16,
                       gpu_fraction: float = 0.6) -> int:
    """KV blocks to allocate: on a GPU, ``gpu_fraction`` of the free memory; on the
    CPU, room for 64k tokens (enough for every test and profile here)."""
    c = model.cfg
    per = int(kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim,
                                 model.dtype.itemsize)) * block_size
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        return max(16, int(free * gpu_fraction) // per)
    return 65536 // block_size
