"""Scheduling: the step plan (``plan``), policies as fill rules and queue disciplines
registered by name (``policy``; the built-in ones are ``simulator.model.policies``), and
the waiting queue that follows a discipline (``queues``)."""
from simulator.model.scheduling.plan import (EMPTY_PLAN, SchedulerState, Seq, StepPlan,
                                             admission_cost)
from simulator.model.scheduling.policy import (POLICIES, Limits, Policy, PolicyParams,
                                               check_policy_name, make_policy, policy_class,
                                               policy_names, register_policy)
from simulator.model.scheduling.queues import WaitingQueue

__all__ = [
    "EMPTY_PLAN", "SchedulerState", "Seq", "StepPlan", "admission_cost", "POLICIES", "Limits",
    "Policy", "PolicyParams", "check_policy_name", "make_policy", "policy_class",
    "policy_names", "register_policy", "WaitingQueue",
]

# The built-in policies register themselves on import (after the names above exist).
import simulator.model.policies  # noqa: E402,F401
