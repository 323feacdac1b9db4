"""KV memory rules shared by both executors: what admitting a request takes, how
much memory it may grow into, and whom to preempt when a running request needs a
block and none is free.

``KVRules`` is the scenario's ``engine.kv`` in executor terms. ``KVSpace`` binds
the rules to a block manager (``blockmanager``) and a function naming a request's
prompt blocks (``prefixkeys``); a policy prices an admission through it
(``SchedulerState.kv``), and the executor admits, grows and frees through it.

- ``paged``: a request is admitted when the blocks of the tokens it must prefill
  fit (minus its prefix-cache hit), and grows a block at a time while decoding.
- ``contiguous``: it reserves ``max_model_len`` tokens (or, when that is not set,
  its own prompt + output, i.e. its ``max_tokens``) at admission and never grows.
- A ``watermark`` fraction of the blocks is kept free at admission (vLLM v0 does
  this) so that a new request does not force a preemption at its first decode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from simulator.model.kv.manager import make_kv_manager
from simulator.model.kv.blocks import blocks_for
from simulator.model.scheduling import Seq, StepPlan


@dataclass(frozen=True)
class KVRules:
    """The executor-facing part of ``engine.kv``."""

    block_size: int = 16
    allocation: str = "paged"          # paged | contiguous
    max_model_len: Optional[int] = None
    watermark: float = 0.0             # fraction of blocks kept free at admission
    preemption: str = "recompute"      # recompute | swap
    victim: str = "priority"           # priority | latest
    prefix_caching: bool = False

    @classmethod
    def from_config(cls, kv) -> "KVRules":
        return cls(block_size=kv.block_size, allocation=kv.allocation,
                   max_model_len=kv.max_model_len, watermark=kv.watermark,
                   preemption=kv.preemption, victim=kv.victim,
                   prefix_caching=kv.prefix_caching)


def select_victim(running: Iterable[Seq], order: str) -> Seq:
    """The request to preempt: ``priority`` = lowest class first (largest priority
    number), then the latest arrival; ``latest`` = the latest arrival (vLLM's FCFS
    rule: the request that came last loses its memory first)."""
    if order == "priority":
        return max(running, key=lambda s: (s.priority, s.enqueued, s.rid))
    if order == "latest":
        return max(running, key=lambda s: (s.enqueued, s.rid))
    raise ValueError(f"unknown victim order {order!r}")


class KVSpace:
    """A block manager under ``KVRules``; see module doc."""

    def __init__(self, capacity_blocks: int, rules: KVRules,
                 keys_of: Callable[[Seq], Optional[list]] = lambda s: None,
                 track_ids: bool = False) -> None:
        self.rules = rules
        self.bs = rules.block_size
        self.paged = rules.allocation == "paged"
        self.manager = make_kv_manager(capacity_blocks, rules.block_size,
                                       prefix_caching=rules.prefix_caching and self.paged,
                                       track_ids=track_ids)
        self.capacity = capacity_blocks
        self.watermark_blocks = int(rules.watermark * capacity_blocks)
        self.keys_of = keys_of if self.manager.prefix_caching else (lambda s: None)

    # -- what a request takes --------------------------------------------------------
    def admission_tokens(self, seq: Seq) -> int:
        """Token slots allocated when ``seq`` is admitted."""
        if self.paged:
            return seq.prefill_len
        r = self.rules.max_model_len
        return r if r is not None else seq.prompt_tokens + seq.output_tokens

    def fits(self, seq: Seq) -> Optional[str]:
        """None if ``seq`` can ever run here, else why not (it is then rejected)."""
        total = seq.prompt_tokens + seq.output_tokens
        r = self.rules.max_model_len
        if r is not None and total > r:
            return f"{total} tokens exceed max_model_len {r}"
        need = blocks_for(total if self.paged else self.admission_tokens(seq), self.bs)
        if need > self.capacity - self.watermark_blocks:
            return f"needs {need} KV blocks, the cache has {self.capacity}"
        return None

    def admission(self, seq: Seq) -> tuple[int, int]:
        """``(cached_tokens, blocks)`` admitting ``seq`` now would take (for policies)."""
        return self.manager.admission(self.admission_tokens(seq), self.keys_of(seq))

    def policy_free(self, reserved: int = 0) -> int:
        """Blocks a policy may admit against: free minus watermark minus ``reserved``."""
        return self.manager.num_free - self.watermark_blocks - reserved

    # -- what the executor does ------------------------------------------------------------
    def admit(self, seq: Seq) -> int:
        """Allocate ``seq``'s admission blocks; sets ``seq.prefilled`` to its prefix hit
        and ``seq.cached_tokens``; returns the hit (tokens)."""
        cached = self.manager.allocate(seq.rid, self.admission_tokens(seq), self.keys_of(seq))
        seq.prefilled = cached
        seq.cached_tokens += cached
        return cached

    def needs_block(self, seq: Seq, context: int) -> bool:
        """Whether ``seq`` needs another block to hold ``context`` tokens."""
        return blocks_for(context, self.bs) > self.manager.blocks_of(seq.rid)

    def grow(self, seq: Seq, context: int) -> int:
        return self.manager.grow(seq.rid, context)

    def computed(self, seq: Seq) -> None:
        """``seq.prefilled`` tokens now hold KV: name their full blocks for reuse."""
        if self.manager.prefix_caching:
            self.manager.register(seq.rid, self.keys_of(seq), seq.prefilled)

    def free(self, seq: Seq) -> int:
        """Release ``seq``'s blocks (finish, cancel, preemption); returns how many."""
        return self.manager.free(seq.rid)

    def holds(self, seq: Seq) -> bool:
        return self.manager.holds(seq.rid)

    def reserved_tokens(self) -> int:
        """Token slots held by requests (used blocks x block size)."""
        return self.manager.num_used * self.bs

    # -- steps shared by both executors -----------------------------------------------------
    def make_room(self, due: list, running: Callable[[], list],
                  preempt: Callable[[Seq], None]) -> list:
        """Preempt until each request in ``due`` (decoders about to cross a block
        boundary) can take one more block: victims are chosen by ``select_victim``
        among ``running()`` and handed to ``preempt``, which must take them out of
        the running set; a victim that was due leaves ``due``. Returns the victims."""
        victims = []
        need = len(due)
        while need > self.manager.num_free:
            victim = select_victim(running(), self.rules.victim)
            if victim in due:
                due.remove(victim)
                need -= 1
            preempt(victim)
            victims.append(victim)
        return victims

    def admit_plan(self, plan: StepPlan, lookup: Callable[[int], Seq],
                   admitted: Callable[[Seq, int], None]) -> StepPlan:
        """Allocate the blocks of the plan's admissions, in order, and call
        ``admitted(seq, cached_tokens)`` for each (the executor moves it to its running
        set). A policy prices admissions against the cache as it was before this
        step; an earlier admission of the same step can evict a cached block a later
        one counted on. That one then prefills from its smaller hit (same chunk
        size), or, if its blocks no longer fit, stays waiting and its chunk is
        dropped from the returned plan."""
        dropped = None
        chunk = dict(plan.prefill)
        for rid in plan.admit:
            seq = lookup(rid)
            if self.admission(seq)[1] > self.manager.num_free:
                dropped = (dropped or set()) | {rid}
                continue
            cached = self.admit(seq)
            if seq.prefilled + chunk[rid] > seq.prefill_len:
                raise RuntimeError(f"plan over-prefills request {rid}")
            admitted(seq, cached)
        if dropped:
            plan = StepPlan(decode=plan.decode,
                            prefill=tuple(c for c in plan.prefill if c[0] not in dropped),
                            admit=tuple(r for r in plan.admit if r not in dropped))
        return plan
