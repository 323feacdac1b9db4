"""Workload sources. Importing this package registers the built-in ones."""
from . import arrivals, lengths, synthetic  # noqa: F401  (registration side effects)
from simulator.workload.base import Workload

__all__ = ["Workload", "build_workload"]


def build_workload(cfg, rng, base_dir):
    """Build the ``Workload`` a workload config describes (by its ``kind``)."""
    from simulator.config.registry import WORKLOADS
    return WORKLOADS.build(cfg, rng, base_dir)
