"""One replica of a scenario: its KV capacity, the KV keyword arguments of its
``Replica``, the bytes of one cached token and its GPUs, each asked of the scenario's
cost model (``CostModel``, ``simulator.cost.model``; the memory rules themselves are the
kind's, ``simulator.cost.replica``). A scenario with ``cluster.pools`` is one pool's
(``cluster.pools.pool_scenario``); the whole fleet's is ``deploy.fleet``.
"""
from __future__ import annotations

from simulator.errors import LatsimError
from simulator.model.kv.space import KVRules


def replica_capacity(scenario) -> int:
    """KV blocks one replica holds (``CostModel.kv_capacity``; with a roofline cost model
    it sets ``cluster.gpus_per_replica`` to tp x pp x dp when left out)."""
    return scenario.model.cost.kv_capacity(scenario)


def kv_bytes_per_token(scenario, per_gpu: bool = False) -> float:
    """KV bytes one cached token takes, in the scenario's KV format (``per_gpu``: one
    GPU's slice of it), as the cost model says (``CostModel.kv_bytes_per_token``)."""
    return scenario.model.cost.kv_bytes_per_token(scenario, per_gpu)


def roofline_memory_plan(scenario, require_fit: bool = True):
    """``catalog.plan_memory`` of a catalogued cost model's replica
    (``CatalogSized.memory_plan``)."""
    return scenario.model.cost.memory_plan(scenario, require_fit=require_fit)


def replica_gpus(sc) -> int:
    """GPUs one replica occupies: what its cost model takes (``gpus_per_replica()``: tp x
    pp x dp of a roofline), else ``cluster.gpus_per_replica`` (one-line error when they
    disagree)."""
    n = sc.model.cost.gpus_per_replica()
    if n is None:
        return sc.cluster.gpus_per_replica
    if "gpus_per_replica" in sc.cluster.model_fields_set and sc.cluster.gpus_per_replica != n:
        raise LatsimError(f"must equal the GPUs model.cost takes (tp x pp x dp) = {n}",
                          field="cluster.gpus_per_replica",
                          value=sc.cluster.gpus_per_replica, has_value=True)
    return n


def replica_kv_args(scenario) -> dict:
    """The KV keyword arguments of ``Replica`` for this scenario: rules, bytes per
    block (what a swap copies), CPU swap space in blocks and its bandwidth. A block's
    bytes are one GPU's slice of it (each GPU of the replica copies its own slice over
    its own link, in parallel), and ``swap_space_gb`` is per GPU, as vLLM's
    ``swap_space``. ``async_sched`` is set where the engine schedules asynchronously
    (``engine.async_scheduling``)."""
    kv = scenario.engine.kv
    block_bytes = kv_bytes_per_token(scenario, per_gpu=True) * kv.block_size
    args = {"kv_rules": KVRules.from_config(kv), "block_bytes": block_bytes,
            "swap_blocks": int(kv.swap_space_gb * 1e9 // block_bytes),
            "swap_bps": kv.swap_gb_per_s * 1e9}
    if kv.offload is not None:
        # A CPU tier (``model.kv.offload``): its blocks are whole ones (``cpu_gb`` is the
        # replica's); a load copies each GPU's slice over its own link, like a swap.
        from dataclasses import replace
        from simulator.model.kv.offload import tier_blocks
        from simulator.errors import check_memory
        from simulator.model.kv.blockpool import pool_size
        whole = kv_bytes_per_token(scenario) * kv.block_size
        blocks = tier_blocks(kv.offload.cpu_gb * 1e9, whole)
        # The tier's bookkeeping (a block pool of that many blocks), before any work.
        check_memory(8.0 * pool_size(blocks), f"a CPU KV tier of {blocks:,} blocks",
                     field="engine.kv.offload.cpu_gb", hint="give a smaller cpu_gb")
        args["kv_rules"] = replace(args["kv_rules"], offload_blocks=blocks,
                                   offload_async=kv.offload.load == "async")
        args["offload_bps"] = kv.offload.pcie_gb_per_s * 1e9
    if scenario.engine.async_scheduling:
        args["async_sched"] = True   # (``model.scheduling.asyncsched``)
    return args
