"""Scheduling: the step plan, waiting-queue disciplines and policies, by name."""
from simulator.model.scheduling.plan import EMPTY_PLAN, SchedulerState, Seq, StepPlan, admission_cost
from simulator.model.scheduling.policies import ChunkedPolicy, FifoPolicy, Limits, PriorityAgingPolicy
from simulator.model.scheduling.queues import AgingPriorityQueue, FifoQueue

__all__ = [
    "EMPTY_PLAN", "SchedulerState", "Seq", "StepPlan", "ChunkedPolicy", "FifoPolicy",
    "Limits", "PriorityAgingPolicy", "AgingPriorityQueue", "FifoQueue", "make_policy",
    "POLICIES", "check_policy_name", "admission_cost",
]

POLICIES = ("fifo", "chunked", "priority_aging")


def check_policy_name(name: str) -> str:
    """``name`` if it is a registered policy, else ``ValueError`` listing the known ones."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return name


def make_policy(name: str, *, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                chunk_size: int | None = None, aging_s: float = 30.0):
    """Build a policy by its registered name (``fifo``, ``chunked``, ``priority_aging``)."""
    limits = Limits(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    cs = chunk_size if chunk_size is not None else max_num_batched_tokens
    if name == "fifo":
        return FifoPolicy(limits=limits)
    if name == "chunked":
        return ChunkedPolicy(limits=limits, chunk_size=cs)
    if name == "priority_aging":
        return PriorityAgingPolicy(limits=limits, chunk_size=cs, aging_s=aging_s)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
