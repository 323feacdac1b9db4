"""KV memory as the executors hold it: the rules of ``rules`` bound to a block manager.
What admitting a request takes, how much memory it may grow into, whom to preempt when
a running request needs a block and none is free, and what a preemption does to the
request: the SimPy replica and the real engine both call these methods; the compiled
loop calls the same ``rules`` kernels on its arrays.

``KVRules`` is the scenario's ``engine.kv`` in executor terms. ``KVSpace`` binds
the rules to a block manager (``manager``) and a function naming a request's
prompt blocks (``prefixkeys``); a policy prices an admission through it
(``SchedulerState.kv``), and the executor admits, grows and frees through it.

- ``paged``: a request is admitted when the blocks of the tokens it must prefill
  fit (minus its prefix-cache hit), and grows a block at a time while decoding.
- ``contiguous``: it reserves ``max_model_len`` tokens (or, when that is not set,
  its own prompt + output, i.e. its ``max_tokens``) at admission and never grows.
- A ``watermark`` fraction of the blocks is kept free at admission (vLLM v0 does
  this) so that a new request does not force a preemption at its first decode.
- ``lookahead`` (speculative decoding, ``k``): a decode step writes the KV of up to
  ``k`` draft tokens besides its own (``rules.decode_slots``), so paged admission
  reserves them with the prompt (as vLLM's ``num_lookahead_tokens``) and every step
  grows a sequence to hold them; contiguous reservations already hold every slot a
  request can write (drafts stop at its last token: ``rules.spec_lookahead``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from simulator import kernel
from simulator.model.kv import rules as kvr
from simulator.model.kv.blocks import blocks_for
from simulator.model.kv.manager import make_kv_manager
from simulator.model.scheduling.plan import Seq, StepPlan

_policy_blocks = kernel.python_of(kvr.policy_blocks)   # every step: no compiled dispatch


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
    lookahead: int = 0                 # speculative decoding: draft tokens a step verifies
    offload_blocks: Optional[int] = None   # a CPU tier of this many blocks (``offload``)
    offload_async: bool = False        # its loads overlap other requests' steps

    @classmethod
    def from_config(cls, kv) -> "KVRules":
        return cls(block_size=kv.block_size, allocation=kv.allocation,
                   max_model_len=kv.max_model_len, watermark=kv.watermark,
                   preemption=kv.preemption, victim=kv.victim,
                   prefix_caching=kv.prefix_caching)


def select_victim(running: Iterable[Seq], order: str) -> Seq:
    """The request to preempt (``kvr.later_victim``): ``priority`` = lowest class
    first (largest priority number), then the latest arrival; ``latest`` = the latest
    arrival."""
    if order not in ("priority", "latest"):
        raise ValueError(f"unknown victim order {order!r}")
    by_priority = order == "priority"
    best = None
    for s in running:
        if best is None or kvr.later_victim(s.priority, s.enqueued, s.rid, best.priority,
                                              best.enqueued, best.rid, by_priority):
            best = s
    if best is None:
        raise ValueError("no running request to preempt")
    return best


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
                                       track_ids=track_ids, cpu_blocks=rules.offload_blocks)
        self.capacity = capacity_blocks
        self.watermark_blocks = kvr.watermark_blocks(float(rules.watermark), capacity_blocks)
        self.max_len = -1 if rules.max_model_len is None else rules.max_model_len
        self.keys_of = keys_of if self.manager.prefix_caching else (lambda s: None)
        self.lookahead = rules.lookahead

    # -- what a request takes --------------------------------------------------------
    def admission_tokens(self, seq: Seq) -> int:
        """Token slots allocated when ``seq`` is admitted (``rules.admission_tokens``;
        paged, with speculative decoding: its first verify's drafts too)."""
        tokens = kvr.admission_tokens(self.paged, seq.prefill_len, self.max_len,
                                      seq.prompt_tokens, seq.output_tokens)
        if self.lookahead and self.paged:
            # The prefill emits one token; the next step verifies drafts after it.
            tokens = kvr.decode_slots(tokens, self.decode_lookahead(seq, seq.generated + 1))
        return tokens

    def decode_lookahead(self, seq: Seq, generated: Optional[int] = None) -> int:
        """Draft tokens ``seq`` verifies at its next step (``rules.spec_lookahead``; 0
        without speculative decoding) when it holds ``generated`` tokens."""
        if not self.lookahead:
            return 0
        g = seq.generated if generated is None else generated
        return kvr.spec_lookahead(self.lookahead, seq.output_tokens - g)

    def fits(self, seq: Seq) -> Optional[str]:
        """None if ``seq`` can ever run here, else why not (``kvr.never_fits``)."""
        why = kvr.never_fits(self.paged, seq.prompt_tokens, seq.output_tokens, self.max_len,
                               self.bs, self.capacity, self.watermark_blocks)
        total = seq.prompt_tokens + seq.output_tokens
        if why == kvr.OVER_MAX_MODEL_LEN:
            return f"{total} tokens exceed max_model_len {self.max_len}"
        if why == kvr.OVER_CAPACITY:
            need = blocks_for(total if self.paged else self.admission_tokens(seq), self.bs)
            return f"needs {need} KV blocks, the cache has {self.capacity}"
        return None

    def admission(self, seq: Seq) -> tuple[int, int]:
        """``(cached_tokens, blocks)`` admitting ``seq`` now would take (for policies)."""
        return self.manager.admission(self.admission_tokens(seq), self.keys_of(seq))

    def policy_free(self, hold: bool = False) -> int:
        """Blocks a policy may admit against (``rules.policy_blocks``): the free ones but
        the watermark; none in a step that holds admissions back (``hold``: it preempted,
        or requests are still swapped out)."""
        return _policy_blocks(hold, self.manager.num_free, self.watermark_blocks)

    # -- what the executor does ------------------------------------------------------------
    def admit(self, seq: Seq) -> int:
        """Allocate ``seq``'s admission blocks; sets ``seq.prefilled`` to its prefix hit
        and ``seq.cached_tokens``; returns the hit (tokens)."""
        cached = self.manager.allocate(seq.rid, self.admission_tokens(seq), self.keys_of(seq))
        seq.prefilled = cached
        seq.cached_tokens += cached
        return cached

    def recovered(self, seq: Seq, cached: int) -> int:
        """Of the KV ``seq`` lost at its last preemption by recompute, what the prefix
        hit ``cached`` of its re-admission recovers (not recomputed after all)."""
        return kvr.recovered_by_hit(cached, seq.dropped)

    def needs_block(self, seq: Seq, context: int) -> bool:
        """Whether ``seq`` needs another block to hold ``context`` tokens."""
        return blocks_for(context, self.bs) > self.manager.blocks_of(seq.rid)

    def growth_blocks(self, seq: Seq, tokens: int) -> int:
        """Blocks ``seq`` must take to hold ``tokens`` tokens (0 if it holds them)."""
        need = blocks_for(tokens, self.bs) - self.manager.blocks_of(seq.rid)
        return need if need > 0 else 0

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
                  preempt: Callable[[Seq], None],
                  blocks: Optional[Callable[[Seq], int]] = None) -> list:
        """Preempt until each request in ``due`` (decoders about to cross a block
        boundary) can take one more block (``blocks(seq)`` more, when given: a
        speculative step's drafts may cross several): victims are chosen by
        ``select_victim`` among ``running()`` and handed to ``preempt``, which must take
        them out of the running set; a victim that was due leaves ``due``. Returns the
        victims."""
        victims = []
        need = len(due) if blocks is None else sum(blocks(s) for s in due)
        while need > self.manager.num_free:
            victim = select_victim(running(), self.rules.victim)
            if victim in due:
                due.remove(victim)
                need -= 1 if blocks is None else blocks(victim)
            preempt(victim)
            victims.append(victim)
        return victims

    def preemption(self, seq: Seq, decoding: bool, cpu_used: int, cpu_blocks: int) -> tuple:
        """How ``seq`` is preempted (``rules.swaps_out``): ``(swap, blocks)``, its blocks
        being what a swap copies. ``cpu_blocks < 0``: unlimited swap space. Decides
        only; ``release_preempted`` then frees the blocks (after a swap's copy)."""
        blocks = self.manager.blocks_of(seq.rid)
        return bool(kvr.swaps_out(decoding, self.rules.preemption == "swap", cpu_used,
                                  blocks, cpu_blocks)), blocks

    def release_preempted(self, seq: Seq, decoding: bool, swapped: bool) -> int:
        """Free a preempted request's blocks. Recomputed (not ``swapped``): it will
        prefill again what its KV held (``rules.recompute_loss``: a decoder its prompt and
        generated tokens), from zero; returns those tokens (0 for a swap)."""
        self.free(seq)
        if swapped:
            return 0
        lost = kvr.recompute_loss(decoding, seq.prompt_tokens, seq.generated, seq.prefilled)
        seq.dropped = lost
        if decoding:
            seq.prefill_len = seq.prompt_tokens + seq.generated
        seq.prefilled = 0
        return lost

    def swap_in(self, seq: Seq) -> int:
        """Bring a swapped-out request's blocks back if they fit now
        (``rules.swap_in_fits``); returns its tokens, or 0 if they do not fit."""
        tokens = seq.prompt_tokens + seq.generated
        if not kvr.swap_in_fits(tokens, self.bs, self.watermark_blocks, self.manager.num_free):
            return 0
        self.manager.allocate(seq.rid, tokens)
        return tokens

    def take_over(self, seq: Seq, reserve: bool = True) -> int:
        """Take over ``seq``, whose KV (its prompt and generated tokens) was made on another
        replica (a disaggregated decode replica taking in a hand-off, ``loops.simpy.handoff``):
        it reserves what admitting it here would (``admission_tokens``: contiguous, its
        ``max_model_len`` or max tokens, since it never grows) or the KV it brings,
        whichever is more, if those blocks fit above the watermark (``rules.swap_in_fits``:
        KV coming back from elsewhere, as a swap-in). Returns the tokens of its KV, or 0
        when it does not fit (nothing reserved); ``reserve`` False only says whether it
        would."""
        held = seq.prompt_tokens + seq.generated
        tokens = max(self.admission_tokens(seq), held)
        if not kvr.swap_in_fits(tokens, self.bs, self.watermark_blocks, self.manager.num_free):
            return 0
        if reserve:
            self.manager.allocate(seq.rid, tokens)
        return held

    def admit_plan(self, plan: StepPlan, lookup: Callable[[int], Seq],
                   admitted: Callable[[Seq, int, int], None]) -> StepPlan:
        """Allocate the blocks of the plan's admissions, in order, and call
        ``admitted(seq, cached_tokens, recovered)`` for each (the executor moves it to its
        running set; ``recovered``: see ``recovered``). A policy prices admissions against the cache as it was before this
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
            admitted(seq, cached, self.recovered(seq, cached))
        if dropped:
            plan = StepPlan(decode=plan.decode,
                            prefill=tuple(c for c in plan.prefill if c[0] not in dropped),
                            admit=tuple(r for r in plan.admit if r not in dropped))
        return plan
