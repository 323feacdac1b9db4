"""The plug-in families, each a ``simulator.registry.Registry``: scheduling policies
(``POLICIES``, filled by ``model.scheduling.register_policy``), arrival processes,
length distributions, workload sources, cost models and routers, picked by a ``kind:``
(or name) field. The built-in plug-ins register themselves when imported; the
composition root ``config.plugins`` imports them all (and a user's own).
"""
from __future__ import annotations

from simulator.registry import Registry

__all__ = ["Registry", "POLICIES", "ARRIVALS", "LENGTHS", "WORKLOADS", "COST_MODELS", "ROUTERS"]

POLICIES: Registry = Registry("policy")
ARRIVALS: Registry = Registry("arrival process", default="poisson")
LENGTHS: Registry = Registry("length distribution", default="constant")
WORKLOADS: Registry = Registry("workload", default="synthetic")
COST_MODELS: Registry = Registry("cost model", default="fitted")
ROUTERS: Registry = Registry("router", default="round_robin")
