"""The scheduler's vocabulary: what a policy sees (`Seq`, `SchedulerState`) and
what it returns (`StepPlan`).

One engine iteration is a token budget filled with work: one token for each
decoding request plus zero or more prefill chunks. A policy is a pure function of
the state that fills the budget; the executor (the SimPy replica or the real
torch engine) applies the plan. Both executors call the same policy objects, so a
difference between simulation and reality is a cost-model error, never a logic
drift.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from simulator.kernel import python_of
from simulator.model.scheduling.progress import emit_tokens, prefill_progress

# Once per request and step from Python: the plain functions (no compiled dispatch).
_prefill_progress, _emit_tokens = python_of(prefill_progress), python_of(emit_tokens)


class Seq:
    """One request as the scheduler sees it.

    Executors own the mutable fields and update them after applying a plan; a
    policy only reads them. ``enqueued`` is when the request became visible to the
    scheduler (its arrival at the replica), which is what waiting time and aging
    are measured from.
    """

    __slots__ = (
        "rid", "enqueued", "priority", "prompt_tokens", "output_tokens",
        "prefilled", "generated", "blocks_needed", "cached_tokens", "payload",
        "prefill_len", "dropped",
    )

    def __init__(self, rid: int, enqueued: float, prompt_tokens: int, output_tokens: int,
                 priority: int = 0, blocks_needed: int = 0, cached_tokens: int = 0,
                 payload: object = None) -> None:
        self.rid = rid
        self.enqueued = enqueued
        self.priority = priority
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.prefilled = 0           # prompt tokens whose KV is computed
        self.generated = 0           # output tokens produced so far
        self.blocks_needed = blocks_needed  # KV blocks to reserve on admission
        self.cached_tokens = cached_tokens  # prompt tokens served from a prefix cache
        self.payload = payload       # executor-private data (e.g. token ids)
        # Tokens to prefill before decoding: the prompt, or after a preemption by
        # recompute the prompt plus the tokens generated so far (their KV was dropped).
        self.prefill_len = prompt_tokens
        self.dropped = 0             # KV tokens dropped at its last preemption by recompute

    @property
    def remaining_prefill(self) -> int:
        return self.prefill_len - self.prefilled

    # -- what a step does to a request (``progress``: the rules every executor calls) ----
    def prefill_chunk(self, n: int) -> bool:
        """``n`` more prompt tokens computed; True when that completes the prefill (the
        step then yields a token: the first one, or after a recompute the next one)."""
        self.prefilled, done = _prefill_progress(self.prefilled, n, self.prefill_len)
        return done

    def completes_with(self, n: int) -> bool:
        """Whether a chunk of ``n`` tokens would complete the prefill (a step's cost
        depends on it: the completing chunk runs the LM head); changes nothing."""
        return _prefill_progress(self.prefilled, n, self.prefill_len)[1]

    def emit(self, n: int = 1) -> bool:
        """``n`` more output tokens (a decode's; a speculative verify's accepted ones);
        True when the request has all its tokens."""
        self.generated, done = _emit_tokens(self.generated, n, self.output_tokens)
        return done

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"Seq(rid={self.rid}, prio={self.priority}, prompt={self.prompt_tokens}, "
                f"prefilled={self.prefilled}, generated={self.generated}/{self.output_tokens})")


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one engine iteration does.

    ``decode``: ids of running requests that each produce one token.
    ``prefill``: ``(rid, n_tokens)`` chunks; a chunk that completes a prompt also
    produces that request's first token at the end of the step.
    ``admit``: ids moved from the waiting queue into the running set by this step
    (always a subset of the prefill ids).
    """

    decode: tuple[int, ...] = ()
    prefill: tuple[tuple[int, int], ...] = ()
    admit: tuple[int, ...] = ()

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)

    @property
    def num_tokens(self) -> int:
        """Packed tokens in the step: what the token budget bounds."""
        return len(self.decode) + self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


EMPTY_PLAN = StepPlan()


@dataclass(slots=True)
class SchedulerState:
    """A read-only snapshot handed to a policy at each decision.

    ``decoding`` and ``prefilling`` are the running requests, in admission order;
    ``waiting`` is the policy's own queue object (see ``queues``); ``free_blocks``
    is the KV capacity a policy may still admit against. ``kv``, when given, prices
    an admission: ``kv.admission(seq) -> (cached_tokens, blocks)`` (a prefix-cache
    hit skips prefill and takes fewer blocks); without it a request costs
    ``seq.blocks_needed`` blocks and has nothing cached.
    """

    now: float
    waiting: "WaitingQueueLike"
    decoding: Sequence[Seq]
    prefilling: Sequence[Seq]
    free_blocks: int
    num_running: int = field(default=-1)
    kv: object = None

    def __post_init__(self) -> None:
        if self.num_running < 0:
            self.num_running = len(self.decoding) + len(self.prefilling)


def admission_cost(seq: Seq, state: SchedulerState) -> tuple[int, int]:
    """``(cached_tokens, blocks)`` admitting ``seq`` would take now (see ``kv``)."""
    kv = state.kv
    if kv is None:
        return 0, seq.blocks_needed
    return kv.admission(seq)


class WaitingQueueLike:  # pragma: no cover - typing protocol only
    """Protocol of a waiting queue: push, requeue (a preempted request goes back to
    the head of its turn), remove, len, and ordered candidates."""

    def push(self, seq: Seq) -> None: ...
    def requeue(self, seq: Seq) -> None: ...
    def remove(self, seq: Seq) -> None: ...
    def __len__(self) -> int: ...
    def candidates(self, now: float) -> Iterable[Seq]: ...
