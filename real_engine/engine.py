"""Continuous batching over the simulator's scheduling policies, on a real model.

``EngineCore`` is the real executor of DESIGN.md §2: it holds the requests
(``simulator.scheduling.Seq``), a waiting queue made by ``policy.new_queue()``
and the running lists ``decoding``/``prefilling``; each ``step()`` snapshots a
``SchedulerState``, asks the policy for a ``StepPlan`` -- the very objects the
SimPy replica uses -- and executes that plan as one token-packed forward.

Semantics (the simulator assumes exactly these):

- admission reserves ``request_blocks(prompt, output)`` KV blocks at once (no
  preemption); ``free_blocks`` in the state is the unreserved capacity;
- a prefill chunk advances ``prefilled``; the chunk that completes the prompt
  samples the request's first token at the end of that step;
- a decode samples one token; a request produces exactly ``output_tokens``
  tokens (EOS is ignored) and finishes in the step producing the last, freeing
  its blocks; ``output_tokens == 1`` finishes in its last prefill step;
- sampling is greedy argmax over the LM head of the sampled rows only; the
  sampled ids are copied to the host (a device sync) before the step ends.

``execute(plan)`` runs a plan's forward on the current state without applying
it: the profiler times exactly this, so the profile describes the engine that
serves.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from simulator.kvcache import request_blocks
from simulator.scheduling import SchedulerState, Seq, StepPlan

from .graphs import DecodeGraphs
from .kv import HostStep, build_host_step, to_device
from .model import Transformer


@dataclass
class Request:
    """Executor-private data of a request (``Seq.payload``): its token ids."""

    prompt_ids: np.ndarray
    out_ids: list = field(default_factory=list)


@dataclass
class StepResult:
    """What one ``step()`` did. Times are on the engine's clock (seconds)."""

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

    @property
    def wall_s(self) -> float:
        return self.t_end - self.t_start

    @property
    def n_decode(self) -> int:
        return len(self.plan.decode)

    @property
    def n_prefill_tokens(self) -> int:
        return self.plan.num_prefill_tokens


class EngineCore:
    """A continuous-batching engine: requests in, one packed forward per ``step()``."""

    def __init__(self, model: Transformer, policy, *, num_blocks: Optional[int] = None,
                 block_size: int = 16, cuda_graphs: Optional[bool] = None,
                 graph_max_batch: int = 64, clock: Callable[[], float] = time.perf_counter,
                 seed: int = 0) -> None:
        self.model = model
        self.policy = policy
        self.device = model.device
        self.cache = model.new_cache(num_blocks or default_num_blocks(model), block_size)
        self.clock = clock
        self.waiting = policy.new_queue()
        self.decoding: list[Seq] = []
        self.prefilling: list[Seq] = []
        self.seqs: dict[int, Seq] = {}
        self.rng = np.random.default_rng(seed)
        on_cuda = self.device.type == "cuda"
        self.graphs = (DecodeGraphs(model, self.cache, max_batch=graph_max_batch)
                       if (on_cuda if cuda_graphs is None else cuda_graphs) else None)
        self.use_graphs = self.graphs is not None

    # -- requests ---------------------------------------------------------------
    def add_request(self, rid: int, prompt: int | Sequence[int], output_tokens: int,
                    priority: int = 0, now: Optional[float] = None) -> Seq:
        """Enqueue a request. ``prompt`` is its token ids, or a length (random ids)."""
        if rid in self.seqs:
            raise ValueError(f"request {rid} already exists")
        ids = (self.rng.integers(0, self.model.cfg.vocab, int(prompt), dtype=np.int64)
               if np.isscalar(prompt) else np.asarray(prompt, dtype=np.int64))
        P, O = len(ids), int(output_tokens)
        if P < 1 or O < 1:
            raise ValueError(f"request {rid}: prompt and output must be >= 1 token")
        if P + O > self.model.cfg.max_seq_len:
            raise ValueError(f"request {rid}: {P}+{O} tokens exceed max_seq_len "
                             f"{self.model.cfg.max_seq_len}")
        need = request_blocks(P, O, self.cache.block_size)
        if need > self.cache.num_blocks:
            raise ValueError(f"request {rid} needs {need} KV blocks, the cache has "
                             f"{self.cache.num_blocks}")
        seq = Seq(rid, self.clock() if now is None else now, P, O, priority=priority,
                  blocks_needed=need, payload=Request(ids))
        self.seqs[rid] = seq
        self.waiting.push(seq)
        return seq

    def cancel(self, rid: int) -> bool:
        """Drop a request now, waiting or running; its blocks are freed at once."""
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return False
        if self.cache.holds(rid):
            self.cache.release(rid)
            for lst in (self.decoding, self.prefilling):
                if seq in lst:
                    lst.remove(seq)
        else:
            self.waiting.remove(seq)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.decoding or self.prefilling or len(self.waiting))

    @property
    def num_running(self) -> int:
        return len(self.decoding) + len(self.prefilling)

    # -- one iteration ------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule, execute and apply one iteration."""
        t0 = self.clock()
        state = SchedulerState(now=t0, waiting=self.waiting, decoding=self.decoding,
                               prefilling=self.prefilling, free_blocks=self.cache.num_free)
        plan = self.policy.schedule(state)
        for rid in plan.admit:
            seq = self.seqs[rid]
            self.waiting.remove(seq)
            self.cache.reserve(rid, seq.blocks_needed)
            self.prefilling.append(seq)
        t1 = self.clock()
        timings = {"schedule": t1 - t0}
        if plan.is_empty:
            return StepResult(plan, {}, (), tuple(plan.admit), t0, t1, self.num_running,
                              len(self.waiting), timings)
        sampled, graphed = self.execute(plan, timings)
        t2 = self.clock()
        tokens, finished = self._apply(plan, sampled)
        t3 = self.clock()
        timings["apply"] = t3 - t2
        return StepResult(plan, tokens, finished, tuple(plan.admit), t0, t3, self.num_running,
                          len(self.waiting), timings, graphed)

    def host_step(self, plan: StepPlan) -> HostStep:
        """Describe a plan's packed step from the current state (host only)."""
        decodes, chunks = [], []
        for rid in plan.decode:
            s = self.seqs[rid]
            r: Request = s.payload
            # The input is the last sampled token; it sits at position prompt+generated-1.
            decodes.append((self.cache.table(rid), s.prompt_tokens + s.generated, r.out_ids[-1]))
        for rid, n in plan.prefill:
            s = self.seqs[rid]
            if not 0 < n <= s.remaining_prefill:
                raise ValueError(f"plan prefills {n} tokens of request {rid}, "
                                 f"{s.remaining_prefill} remain")
            p = s.prefilled
            chunks.append((self.cache.table(rid), p, s.payload.prompt_ids[p:p + n],
                           p + n == s.prompt_tokens))
        return build_host_step(decodes, chunks, self.cache)

    def execute(self, plan: StepPlan, timings: Optional[dict] = None) -> tuple[np.ndarray, bool]:
        """Run ``plan``'s forward and greedy sampling; state is not changed.

        Returns the sampled ids (decodes in plan order, then each prefill chunk
        that completes its prompt, in plan order) on the host, and whether a CUDA
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
        i = 0
        for rid in plan.decode:
            s = self.seqs[rid]
            tok = int(sampled[i])
            i += 1
            s.payload.out_ids.append(tok)
            s.generated += 1
            tokens[rid] = tok
            if s.generated >= s.output_tokens:
                finished.append(rid)
        newly_decoding = []
        for rid, n in plan.prefill:
            s = self.seqs[rid]
            s.prefilled += n
            if s.prefilled == s.prompt_tokens:
                tok = int(sampled[i])
                i += 1
                s.payload.out_ids.append(tok)
                s.generated = 1
                tokens[rid] = tok
                self.prefilling.remove(s)
                if s.generated >= s.output_tokens:
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
        blocks reserved). For the profiler: builds a step's state without serving
        up to it. The KV of the 'already computed' tokens is whatever the cache holds."""
        seq = self.add_request(rid, prompt_tokens, output_tokens)
        self.waiting.remove(seq)
        self.cache.reserve(rid, seq.blocks_needed)
        seq.prefilled = prefilled
        seq.generated = generated
        seq.payload.out_ids.extend(self.rng.integers(0, self.model.cfg.vocab, generated).tolist())
        (self.decoding if prefilled == prompt_tokens else self.prefilling).append(seq)
        return seq

    def clear(self) -> None:
        """Cancel every request (waiting and running)."""
        for rid in list(self.seqs):
            self.cancel(rid)


def default_num_blocks(model: Transformer, block_size: int = 16,
                       gpu_fraction: float = 0.6) -> int:
    """KV blocks to allocate: on a GPU, ``gpu_fraction`` of the free memory; on the
    CPU, room for 64k tokens (enough for every test and profile here)."""
    c = model.cfg
    per = 2 * c.n_layers * c.n_kv_heads * block_size * c.head_dim * model.dtype.itemsize
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        return max(16, int(free * gpu_fraction) // per)
    return 65536 // block_size
