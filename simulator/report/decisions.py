"""A decision trace: why a request waited, step by step (``latsim run --chrome-trace``).

A ``DecisionTrace`` rides on a run's recorder (``simulate(..., trace=...)``); the SimPy
replica calls it at each scheduling decision (``decide``) and at each step or decode
epoch it runs (``step``). It records, for every traced request still waiting at a
decision, the reason it was passed over:

- ``memory``: the first request the step did not admit needs more KV blocks than are
  free once the step's admissions are counted (``needed`` vs ``free``);
- ``max_num_seqs``: the running requests (with the step's admissions) fill the slots;
- ``token_budget``: the step's tokens used the budget, or its whole prompt does not fit
  what is left (a fill rule that does not split prompts);
- ``held``: the step admitted nothing because running requests were preempted or
  swapped ones come back first (vLLM's order);
- ``policy``: none of these: the fill rule itself took no more (a static batch in
  flight, a decode step of ``fifo``);
- ``order``: it was behind the request above in the policy's order (head-of-line), and
  ``went_first`` lists who the step admitted ahead of it.

Consecutive decisions with the same reason (and the same request blocking it) are one
record with a count of ``steps`` and the span ``t``..``until``. The reasons are read
from the limits the fill rule is called with (``Policy.fill_limits``) and the same
admission prices the policy saw (``plan.admission_cost``, pure); nothing the run does
depends on the trace, so a traced run is bit for bit the untraced one (tested). Without
a trace the replica's only cost is one ``is None`` test per step.

With a gateway (traffic control) the executors see attempts: their waits are recorded
under their requests (``rid_of``), the step track keeps attempt ids (a first attempt
has its request's id, a retry one from ``n`` on).

Admission control at the gateway (rate limits, queue bounds, shedding) is read from the
recorder afterwards (``reject_reason``, ``attempts``, ``retry_s``) by ``chrome``.
"""
from __future__ import annotations

from typing import Iterable, Optional

from simulator.model.scheduling.plan import admission_cost

__all__ = ["DecisionTrace", "REASONS"]

REASONS = ("memory", "max_num_seqs", "token_budget", "held", "policy", "order")


class DecisionTrace:
    """What one run's scheduling did and why each traced request waited (module doc).
    ``requests``: the ids to trace (None: every request)."""

    def __init__(self, requests: Optional[Iterable[int]] = None) -> None:
        self.ids = None if requests is None else frozenset(int(r) for r in requests)
        # (replica, start, seconds, n_decode, prefill chunks, admitted, steps)
        self.steps: list[tuple] = []
        # rid -> list of records (dicts, see ``_note``)
        self.waits: dict[int, list[dict]] = {}
        # A gateway's run (traffic control): the request of each attempt id (-1: none
        # yet), so that a retry's waits are its request's; None: ids are requests.
        self.rid_of = None

    def request(self, rid: int) -> int:
        """The request an executor's ``rid`` (an attempt, with a gateway) belongs to."""
        if self.rid_of is None:
            return rid
        r = int(self.rid_of[rid])
        return r if r >= 0 else rid

    def traced(self, rid: int) -> bool:
        return self.ids is None or self.request(rid) in self.ids

    # -- called by the replica ---------------------------------------------------------
    def step(self, replica: int, start: float, seconds: float, plan, steps: int = 1) -> None:
        """A step (or a decode epoch of ``steps`` steps) that ran ``plan``."""
        self.steps.append((replica, float(start), float(seconds), len(plan.decode),
                           plan.prefill, plan.admit, steps))

    def decide(self, replica: int, policy, state, plan, hold: bool) -> None:
        """Why each traced waiting request was not admitted by ``plan`` (module doc)."""
        waiting = state.waiting
        if not len(waiting):
            return
        left = len(waiting) if self.ids is None else sum(self.traced(s.rid) for s in waiting)
        if not left:
            return
        budget, _chunk, max_seqs = policy.fill_limits()
        admitted = set(plan.admit)
        used = plan.num_tokens
        running = state.num_running + len(admitted)
        free = state.free_blocks
        went_first: list[int] = []
        blocker = None
        for pos, seq in enumerate(waiting.candidates(state.now)):
            rid = seq.rid
            if rid in admitted:
                free -= admission_cost(seq, state)[1]
                went_first.append(self.request(rid))
                continue
            if blocker is None:
                cached, need = admission_cost(seq, state)
                blocker = (self.request(rid),) + _why(hold, running, max_seqs, need, free, used, budget,
                                        seq.remaining_prefill - cached, policy.name)
                if self.traced(rid):
                    self._note(rid, replica, state.now, blocker[1],
                               dict(blocker[2], went_first=list(went_first)))
                    left -= 1
            elif self.traced(rid):
                self._note(rid, replica, state.now, "order",
                           {"behind": blocker[0], "behind_reason": blocker[1], "ahead": pos,
                            "went_first": list(went_first),
                            "text": f"behind request {blocker[0]} ({blocker[1]}), "
                                    f"{pos} ahead in the policy's order"})
                left -= 1
            if not left:
                break

    def _note(self, rid: int, replica: int, now: float, reason: str, detail: dict) -> None:
        recs = self.waits.setdefault(self.request(rid), [])
        key = (replica, reason, detail.get("behind"))
        if recs and recs[-1]["_key"] == key:
            last = recs[-1]
            last["until"] = float(now)
            last["steps"] += 1
            last["detail"] = detail      # the latest numbers (free blocks, who went first)
            return
        now = float(now)
        recs.append({"_key": key, "replica": replica, "t": now, "until": now, "steps": 1,
                     "reason": reason, "detail": detail})

    def records(self, rid: int) -> list[dict]:
        """The wait records of ``rid``: ``replica``, ``t``, ``until``, ``steps``,
        ``reason`` and its ``detail``, in time order."""
        return [{k: v for k, v in r.items() if k != "_key"} for r in self.waits.get(rid, [])]


def _why(hold: bool, running: int, max_seqs: int, need: int, free: int, used: int,
         budget: int, prefill: int, policy: str) -> tuple[str, dict]:
    """The reason the first request a plan left out was left out (module doc), checked
    in the order the fill rules check their limits."""
    if hold:
        return "held", {"text": "admissions held: running requests were preempted or "
                                "swapped ones come back first"}
    if running >= max_seqs:
        return "max_num_seqs", {"running": running, "max_num_seqs": max_seqs,
                                "text": f"{running} running of max_num_seqs {max_seqs}"}
    if need > free:
        return "memory", {"needed_blocks": int(need), "free_blocks": int(free),
                          "text": f"KV memory: needs {need} blocks, {free} free"}
    if used >= budget or used + prefill > budget:
        return "token_budget", {"used": used, "budget": budget, "prefill": int(prefill),
                                "text": f"token budget: {used} of {budget} used, its "
                                        f"prefill {prefill}"}
    return "policy", {"text": f"the fill rule of {policy!r} took no more"}
