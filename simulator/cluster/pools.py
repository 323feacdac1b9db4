"""A mixed fleet (``cluster.pools``): pools of replicas that differ in GPU type, TP or
cost model, behind one router.

Each pool is a run of replica slots (pools in the order given; a pool's slots follow
the previous pool's). Its replicas step on its own cost model (``pool.cost``, else
``model.cost``), hold the KV blocks its own memory plan leaves (a roofline's
``catalog.plan_memory`` on its GPU type and TP x PP; ``engine.kv.num_blocks``, when
given, for every pool) and are billed ``gpus_per_replica`` GPUs at its own
``gpu_cost_per_hour``. The engine (policy, batch limits, KV rules) is the scenario's.

The router sees every ready replica of every pool: a load-aware router (least
outstanding tokens, cache-aware with its load term) sends more to the faster pool
because its queues drain sooner; round robin shares evenly whatever the speed. A
request too large for a replica's KV cache goes to one whose cache can hold it, and
is refused (413) only when no ready replica can. An autoscaler scales one pool
(``cluster.autoscaler.pool``, default the first); that pool has
``max(replicas, max_replicas)`` slots, every other pool its ``replicas``.

A mixed fleet runs on the traffic model (``loops.traffic``; the compiled loop does
not model pools, and ``auto`` says so). Its outputs: ``summary.json``
``cluster.pools`` (per pool: GPU type, replicas, KV blocks, requests served and
completed, GPU-hours, cost) whose GPU-hours and cost add up to the cluster's, and
``pool`` on the replica rows of ``timeseries.csv``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from simulator.errors import LatsimError


@dataclass
class Pool:
    """One pool as the run builds it (see module doc)."""

    name: str
    first: int            # its first slot
    n_slots: int
    replicas: int         # ready at the start
    capacity: int         # KV blocks per replica
    kv_args: dict         # ``Replica``'s KV keyword arguments
    gpus: int             # GPUs per replica
    price: Optional[float]
    cost: Any             # its cost config
    scaled: bool          # the autoscaler's pool
    role: str = "mixed"   # mixed | prefill | decode (``cluster.disagg``)

    @property
    def slots(self) -> range:
        return range(self.first, self.first + self.n_slots)

    @property
    def gpu(self) -> Optional[str]:
        """The GPU type its cost model prices on (None: a measured profile's own)."""
        return gpu_type(self.cost)


def gpu_type(cost) -> Optional[str]:
    """The GPU type a ``model.cost`` states (``CostModel.hardware``), else None."""
    hw = cost.hardware()
    return hw[0] if hw is not None else None


def pool_scenario(sc, pool):
    """The scenario as one replica of ``pool`` sees it: ``model.cost`` is the pool's,
    ``cluster`` a plain one of its replicas (its ``gpus_per_replica``)."""
    from simulator.config.cluster import ClusterConfig
    cost = pool.cost if pool.cost is not None else sc.model.cost
    cl: dict = {"replicas": max(1, pool.replicas)}
    gpus = pool.gpus_per_replica
    if gpus is None and cost.gpus_per_replica() is None:
        gpus = sc.cluster.gpus_per_replica
    if gpus is not None:
        cl["gpus_per_replica"] = gpus
    return sc.model_copy(update={"model": sc.model.model_copy(update={"cost": cost}),
                                 "cluster": ClusterConfig(**cl)})


def plan_pools(sc) -> list[Pool]:
    """The pools of ``sc`` (which has ``cluster.pools``), with each one's KV capacity
    worked out; a pool whose model does not fit its GPU (or whose GPUs per replica
    contradict its TP x PP) is a one-line ``LatsimError`` naming the pool."""
    from simulator.deploy.replica import replica_capacity, replica_kv_args
    cl = sc.cluster
    auto = cl.autoscaler
    scaled = (auto.pool or cl.pools[0].name) if auto is not None else None
    out, first = [], 0
    for p in cl.pools:
        psc = pool_scenario(sc, p)
        try:
            cap = replica_capacity(psc)
        except LatsimError as e:
            raise LatsimError(f"pool {p.name!r}: {e}", field=f"cluster.pools.{p.name}") from None
        n = max(p.replicas, auto.max_replicas) if p.name == scaled else p.replicas
        out.append(Pool(name=p.name, first=first, n_slots=n, replicas=p.replicas,
                        capacity=cap, kv_args=replica_kv_args(psc),
                        gpus=psc.cluster.gpus_per_replica,
                        price=gpu_hour_price(gpu_type(psc.model.cost),
                                             p.gpu_cost_per_hour, cl.gpu_cost_per_hour),
                        cost=psc.model.cost, scaled=p.name == scaled, role=p.role))
        first += n
    return out


def gpu_hour_price(gpu: Optional[str], pool_price: Optional[float] = None,
                   cluster_price: Optional[float] = None, prices=None) -> Optional[float]:
    """$ per GPU-hour of a replica's GPUs: the one rule ``latsim run`` (a pool's
    ``cost_usd``) and ``latsim plan`` (a configuration's $ per hour) price by. What the
    command line says wins over what the scenario says: a price named for the GPU type
    (``prices`` a mapping, ``--cost-per-gpu-hour gpu=price,...``: it names the hardware,
    which a plan's GPU axis may change under a pool), else one plan-wide price
    (``prices`` a number); then the pool's own ``gpu_cost_per_hour``, else
    ``cluster.gpu_cost_per_hour``; None when none applies."""
    if isinstance(prices, dict):
        if gpu in prices:
            return float(prices[gpu])
    elif prices is not None:
        return float(prices)
    for price in (pool_price, cluster_price):
        if price is not None:
            return float(price)
    return None


def slot_pools(pools: list[Pool]) -> list[Pool]:
    """The pool of each slot."""
    return [p for p in pools for _ in p.slots]
