"""The plug-in families whose kinds are scenario keys, each a
``simulator.registry.Registry``: arrival processes, length distributions, workload
sources, cost models and routers, picked by a ``kind:`` field (the README's YAML
reference lists every kind of each, ``config.reference``). Scheduling policies are the
same type of registry (``model.scheduling.POLICIES``, filled by ``register_policy``).
The built-in plug-ins register themselves when imported; the composition root
``config.plugins`` imports them all (and a user's own).
"""
from __future__ import annotations

from simulator.registry import Registry

__all__ = ["Registry", "ARRIVALS", "LENGTHS", "WORKLOADS", "COST_MODELS", "ROUTERS"]

ARRIVALS: Registry = Registry("arrival process", default="poisson")
LENGTHS: Registry = Registry("length distribution", default="constant")
WORKLOADS: Registry = Registry("workload", default="synthetic")
COST_MODELS: Registry = Registry("cost model", default="fitted")
ROUTERS: Registry = Registry("router", default="round_robin")
