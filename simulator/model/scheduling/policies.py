"""Scheduling policies: different ways to fill one step's token budget.

Every policy is a pure object: ``schedule(state) -> StepPlan`` reads the state and
returns a frozen plan; it never mutates requests or queues. ``new_queue()`` gives
the waiting-queue discipline the policy orders admissions by. The SimPy replica
and ``real_engine`` call these very objects.

- ``fifo``: vLLM-v0-style continuous batching. When a waiting request can be
  admitted, the step is a prefill-only step of whole prompts (decodes pause, so a
  long prompt shows up as a long inter-token gap for every running request);
  otherwise the step decodes every running request.
- ``chunked``: Sarathi-style chunked prefill. Decodes first (one token each),
  then prefill chunks up to the token budget: the partially prefilled requests
  first, then new admissions in queue order.
- ``priority_aging``: ``chunked`` whose queue orders by priority class with aging.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

from simulator.model.scheduling.plan import EMPTY_PLAN, SchedulerState, StepPlan, admission_cost
from simulator.model.scheduling.queues import AgingPriorityQueue, FifoQueue

_rid = attrgetter("rid")


@dataclass(frozen=True)
class Limits:
    """Engine limits a policy must respect."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192



@dataclass(frozen=True)
class FifoPolicy:
    """Whole-prompt prefill steps that pause decodes (vLLM v0 continuous batching).

    A prefill step takes waiting requests in arrival order while their prompts fit
    in ``max_num_batched_tokens`` (a single prompt larger than the budget runs
    alone) and their KV blocks and a sequence slot are free. Admission is strictly
    in order: if the head cannot be admitted, nobody behind it is (head-of-line).
    """

    limits: Limits = Limits()
    name: str = "fifo"

    def new_queue(self) -> FifoQueue:
        return FifoQueue()

    def schedule(self, state: SchedulerState) -> StepPlan:
        lim = self.limits
        running = state.num_running
        free = state.free_blocks
        budget = lim.max_num_batched_tokens
        chunks: list[tuple[int, int]] = []
        used = 0
        # A request left mid-prefill (only possible if the executor split it) finishes first.
        for seq in state.prefilling:
            n = seq.remaining_prefill
            if chunks and used + n > budget:
                break
            chunks.append((seq.rid, n))
            used += n
        admit: list[int] = []
        if len(state.waiting):
            for seq in state.waiting.candidates(state.now):
                if running >= lim.max_num_seqs:
                    break
                cached, need = admission_cost(seq, state)
                n = seq.remaining_prefill - cached
                if (chunks and used + n > budget) or need > free:
                    break
                chunks.append((seq.rid, n))
                admit.append(seq.rid)
                used += n
                running += 1
                free -= need
        if chunks:
            return StepPlan(decode=(), prefill=tuple(chunks), admit=tuple(admit))
        if state.decoding:
            return StepPlan(decode=tuple(map(_rid, state.decoding)))
        return EMPTY_PLAN


@dataclass(frozen=True)
class ChunkedPolicy:
    """Chunked prefill (Sarathi): decodes first, then prefill chunks up to the budget.

    ``chunk_size`` caps one request's chunk in a step; ``max_num_batched_tokens``
    caps the whole step. Requests mid-prefill continue before new ones are
    admitted, so a long prompt is spread over several steps and decodes keep
    flowing between its chunks.
    """

    limits: Limits = Limits()
    chunk_size: int = 512
    name: str = "chunked"

    def new_queue(self):
        return FifoQueue()

    def schedule(self, state: SchedulerState) -> StepPlan:
        lim = self.limits
        budget = lim.max_num_batched_tokens
        dec = state.decoding
        if len(dec) > budget:
            # More decoders than tokens: the oldest decode; the rest wait a step.
            return StepPlan(decode=tuple(map(_rid, dec[:budget])))
        decode = tuple(map(_rid, dec))
        left = budget - len(decode)
        chunks: list[tuple[int, int]] = []
        for seq in state.prefilling:
            if left <= 0:
                break
            n = min(seq.remaining_prefill, self.chunk_size, left)
            chunks.append((seq.rid, n))
            left -= n
        admit: list[int] = []
        if left > 0 and len(state.waiting):
            running = state.num_running
            free = state.free_blocks
            for seq in state.waiting.candidates(state.now):
                if left <= 0 or running >= lim.max_num_seqs:
                    break
                cached, need = admission_cost(seq, state)
                if need > free:
                    break
                n = min(seq.remaining_prefill - cached, self.chunk_size, left)
                chunks.append((seq.rid, n))
                admit.append(seq.rid)
                left -= n
                running += 1
                free -= need
        if not decode and not chunks:
            return EMPTY_PLAN
        return StepPlan(decode=decode, prefill=tuple(chunks), admit=tuple(admit))


@dataclass(frozen=True)
class PriorityAgingPolicy(ChunkedPolicy):
    """Chunked prefill whose admissions follow priority classes with aging.

    A waiting request's key is ``priority - floor(wait_s / aging_s)``, recomputed
    at every decision, so a low-priority request gains one class per ``aging_s``
    seconds of waiting and cannot starve: after ``priority * aging_s`` it ties with
    a fresh P0 request and wins on arrival order.
    """

    aging_s: float = 30.0
    name: str = "priority_aging"

    def new_queue(self):
        return AgingPriorityQueue(self.aging_s)
