"""Compile (or load from numba's cache) every scheduling and memory kernel at once.

The SimPy model does not mind paying for a kernel at its first call; a real engine
does: a first step a second late is a latency the simulator would not predict.
``real_engine`` calls ``warm_up`` before it serves."""
from __future__ import annotations

from simulator.model.kv import prefixcache, rules
from simulator.model.scheduling import Limits, policy_class, policy_names


def warm_up() -> None:
    """Every registered policy's fill rule and order key, every memory rule and the
    prefix cache's (``PrefixKV`` runs them on every admission, growth and free)."""
    for name in policy_names():
        policy_class(name)(Limits()).warm_up()
    rules.warm_up()
    prefixcache.warm_up()
