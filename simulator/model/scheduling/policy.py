"""A scheduling policy: a *fill rule* and a *queue discipline*, registered by name.

One engine step is a token budget filled with work (see ``plan``). A policy says how:

- its **fill rule** (a ``@kernel``) decides how many decodes the step runs, how many
  tokens each running prefill advances by, and which of the waiting requests, offered
  in the discipline's order, it admits and with how many tokens;
- its **queue discipline** (an order-key ``@kernel`` and a requeue rule) orders the
  waiting requests: lower key first, ties to the earlier arrival.

Both are pure functions of numbers and arrays. ``Policy.schedule`` calls them for the
SimPy replica and the real engine; the compiled loop calls the very same kernels on its
own arrays. A policy is one module under ``simulator.model.policies`` (or a user's own
module, loaded by import path) that subclasses ``Policy`` and registers itself with
``@register_policy(name)``, with its own pydantic ``Params``.

The fill rule's protocol. The executor offers the candidates lazily: the first ``k``
waiting requests in queue order, with their prefill tokens (after a prefix-cache hit)
and the KV blocks admitting each would take. The rule returns ``(n_decode, n_prefill,
n_admit, more)``: decode the first ``n_decode`` decoders, advance the first
``n_prefill`` prefilling requests by ``out_pre[i]`` tokens, admit the first ``n_admit``
candidates with ``out_cand[j]`` tokens each; ``more`` is True when the rule used up the
candidates it was given without a limit stopping it, so the executor offers more (all
of them if it must) and asks again. A rule is pure, so asking again is safe; offering
candidates a few at a time keeps a step's cost independent of the queue's length.

The order key's contract. A policy orders the waiting queue by a key, lower first, ties
to the earlier arrival (then, among equals, a request requeued at the front first):

- ``order_key(self, req) -> float``, a plain method, is a plug-in's way: ``req`` is a
  ``view.Waiting`` (read-only: ``priority``, ``class_name``, ``slo_ttft_s`` /
  ``slo_tpot_s`` / ``slo_e2el_s`` where the scenario gives them, ``enqueued``,
  ``prompt_tokens``, ``remaining_prefill``, ``output_tokens``, ``generated``,
  ``progress``, ``ttft_deadline``, and ``now`` / ``waited``). Every waiting request is
  compared, within and across classes, whatever ``by_class`` says. A key that reads
  ``now`` or ``waited`` must set ``time_dependent = True`` (it is then recomputed at
  every decision); any other key is computed once, when a request joins the queue.
  Shortest prompt first: ``return req.prompt_tokens``; last in, first out: ``return
  -req.enqueued``; earliest TTFT deadline: ``return req.ttft_deadline`` (a class
  without a TTFT target needs a number of its own there: None is not a key).
  Such a policy runs on the SimPy loop and the real engine (the compiled loop knows
  only the built-in keys).
- ``order_kernel(prio, enq, progress, now, p)``, a ``@kernel`` of numbers (``p``: the
  policy's ``order_params``), is the built-in policies' way, also run compiled. One
  declared ``queues.arrival_ordered`` (within a class an earlier arrival never has a
  higher key) over ``by_class`` FIFOs has only the classes' heads compared; any other
  kernel has every request compared, as ``order_key``.
- neither: arrival order (the requeue rule decides where a preempted request waits).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np

from simulator.config.strict import StrictModel

from simulator.kernel import kernel, python_of
from simulator.registry import Registry
from simulator.model.scheduling.plan import EMPTY_PLAN, SchedulerState, StepPlan, admission_cost
# A discipline's requeue rules are the queue's (``queues``); named here for policies.
from simulator.model.scheduling.queues import (REQUEUE_ARRIVAL, REQUEUE_FRONT,  # noqa: F401
                                               REQUEUE_RESUMED, WaitingQueue)


@kernel(inline=True)
def next_offer(offered, n_waiting, more, cap):
    """How many waiting requests (in the discipline's order) the fill rule is offered
    next, or 0 when the plan is final: one at first, then twice as many each time the
    rule says it could take more (``more``), up to all of them (or ``cap``). A plan
    admits at most the free sequence slots, so this looks at a few, not the queue."""
    if not more or offered >= n_waiting or offered >= cap:
        return 0
    k = 2 * offered
    if k > n_waiting:
        k = n_waiting
    return k if k < cap else cap


_next_offer = python_of(next_offer)      # once per fill: no compiled dispatch

__all__ = ["Limits", "Policy", "PolicyParams", "POLICIES", "register_policy", "policy_names",
           "policy_class", "make_policy", "check_policy_name", "REQUEUE_FRONT",
           "REQUEUE_ARRIVAL", "REQUEUE_RESUMED"]


@dataclass(frozen=True)
class Limits:
    """Engine limits a policy must respect."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192


class PolicyParams(StrictModel):
    """A policy's own parameters (subclassed by each policy; unknown keys are errors).
    A field left ``None`` takes the engine's field of the same name, if it has one
    (``engine.chunk_size``, ``engine.aging_s``)."""



class Policy:
    """Base class of scheduling policies (see module doc). Subclasses set ``name``,
    ``Params``, ``fill_kernel``, ``order_kernel``, ``requeue`` and ``by_class``, and may
    override ``order_params`` (the numbers ``order_kernel`` reads)."""

    name: ClassVar[str] = ""
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    fill_kernel: ClassVar[Any] = None       # the fill rule (a @kernel)
    order_kernel: ClassVar[Any] = None      # the queue's order key (a @kernel)
    order_key: ClassVar[Any] = None         # or a method of a view.Waiting (module doc)
    requeue: ClassVar[int] = REQUEUE_FRONT
    by_class: ClassVar[bool] = False        # one FIFO per priority class (else one FIFO)
    time_dependent: ClassVar[bool] = False  # the order changes with time alone (aging)

    def __init__(self, limits: Limits = Limits(), params: Optional[PolicyParams] = None,
                 **values) -> None:
        self.limits = limits
        self.params = params if params is not None else self.Params(**values)
        cs = getattr(self.params, "chunk_size", None)
        self.chunk_size = int(cs) if cs is not None else limits.max_num_batched_tokens
        self._order = np.asarray(self.order_params(), dtype=np.float64)
        # priority -> view.ClassInfo (name, SLO) for ``order_key``; a simulation fills it
        # from the scenario (``view.class_table``), the real engine knows none.
        self.classes: dict = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.limits}, {self.params!r})"

    # -- what the queue discipline reads ------------------------------------------------
    def order_params(self) -> list[float]:
        """The numbers ``order_kernel`` reads (``p`` in its signature)."""
        return [0.0]

    @property
    def order_array(self) -> np.ndarray:
        return self._order

    def new_queue(self):
        """An empty waiting queue ordered by this policy's discipline."""
        return WaitingQueue(self)

    def warm_up(self) -> None:
        """Compile (or load from numba's cache) this policy's kernels now, so that a real
        engine's first step does not pay for it (it can take a second, and would show
        as a late first step)."""
        z = np.zeros(1, np.int64)
        budget, chunk, max_seqs = self.fill_limits()
        self.fill_kernel(budget, chunk, max_seqs, 0, 0, 0, z, 0, z, z, 0, z, z)
        if self.order_kernel is not None:
            self.order_kernel(0, 0.0, 0.0, 0.0, self._order)

    # -- the decision ------------------------------------------------------------------
    def fill_limits(self) -> tuple[int, int, int]:
        """``(budget, chunk, max_seqs)`` the fill rule is called with (a policy may fill
        within tighter limits than the engine's, e.g. a static batch size)."""
        return self.limits.max_num_batched_tokens, self.chunk_size, self.limits.max_num_seqs

    def schedule(self, state: SchedulerState) -> StepPlan:
        """The step to run now: the fill rule over the state (see module doc). Pure: it
        reads the state and mutates nothing."""
        budget, chunk, max_seqs = self.fill_limits()
        dec, pre = state.decoding, state.prefilling
        n_pre = len(pre)
        pre_rem = np.fromiter((s.remaining_prefill for s in pre), np.int64, n_pre)
        out_pre = np.zeros(n_pre, np.int64)
        n_wait = len(state.waiting)
        cands: list = []
        rem: list[int] = []
        need: list[int] = []
        it = iter(state.waiting.candidates(state.now)) if n_wait else None
        k = min(n_wait, 1)
        while True:
            while len(cands) < k:
                seq = next(it)
                cached, blocks = admission_cost(seq, state)
                cands.append(seq)
                rem.append(seq.remaining_prefill - cached)
                need.append(blocks)
            out_cand = np.zeros(len(cands), np.int64)
            nd, npc, na, more = self.fill_kernel(
                budget, chunk, max_seqs, state.num_running, state.free_blocks, len(dec),
                pre_rem, n_pre,
                np.asarray(rem, np.int64), np.asarray(need, np.int64), len(cands),
                out_pre, out_cand)
            k = _next_offer(k, n_wait, more, n_wait)
            if not k:
                break
        if not nd and not npc and not na:
            return EMPTY_PLAN
        chunks = [(pre[i].rid, int(out_pre[i])) for i in range(npc)]
        chunks += [(cands[j].rid, int(out_cand[j])) for j in range(na)]
        return StepPlan(decode=tuple(s.rid for s in dec[:nd]), prefill=tuple(chunks),
                        admit=tuple(cands[j].rid for j in range(na)))


# -- the registry ----------------------------------------------------------------------
# name -> (the policy's ``Params``, its class): the registry type of every plug-in family
# (``simulator.registry``). The built-in policies (``simulator.model.policies``) are
# imported by the composition root ``config.plugins``, and by this package
# (``model.scheduling``) for library use.
POLICIES: Registry = Registry("policy")


def register_policy(name: str):
    """Class decorator: register a ``Policy`` subclass under ``name`` (unique)."""

    def deco(cls: type[Policy]) -> type[Policy]:
        if POLICIES.holder(name) not in (None, cls):
            raise RuntimeError(f"policy {name!r} registered twice")
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise TypeError(f"policy {name!r} must subclass simulator.model.scheduling.Policy")
        cls.name = name
        # Kernels are plain functions held by the class, never methods.
        for attr in ("fill_kernel", "order_kernel"):
            v = cls.__dict__.get(attr)
            if v is not None and not isinstance(v, staticmethod):
                setattr(cls, attr, staticmethod(v))
        if cls.fill_kernel is None:
            raise TypeError(f"policy {name!r} has no fill_kernel")
        POLICIES.register(name, cls.Params, cls)
        return cls

    return deco


def policy_names() -> list[str]:
    return POLICIES.names()


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name``; ``ValueError`` listing the known ones."""
    return POLICIES.factory(name)


def check_policy_name(name: str) -> str:
    """``name`` if it is a registered policy, else ``ValueError`` listing the known ones."""
    policy_class(name)
    return name


def make_policy(name: str, *, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                params: Optional[dict] = None, **engine_defaults) -> Policy:
    """Build the policy registered as ``name``: its ``Params`` from ``params``, with any
    field left unset taken from ``engine_defaults`` by name (``chunk_size``, ``aging_s``:
    the engine-level settings), then the field's own default."""
    cls = policy_class(name)
    values = dict(params or {})
    for f in cls.Params.model_fields:
        if values.get(f) is None and engine_defaults.get(f) is not None:
            values[f] = engine_defaults[f]
    return cls(Limits(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
               cls.Params(**values))
