"""``cluster``: the serving fleet: replicas (or pools of replicas of different GPU
types), the router, admission control and the autoscaler in front of them."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from simulator.config.faults import BreakerConfig, DegradeConfig, FaultsConfig
from simulator.config.traffic import (AdmissionConfig, AutoscalerConfig, check_router_params,
                                      router_spec)
from simulator.config.pluginfield import plugin
from simulator.config.registry import COST_MODELS, ROUTERS
from simulator.config.strict import StrictModel


ROLES = ("mixed", "prefill", "decode")
REGION_ROUTERS = ("nearest_region", "region_load_rtt")


class PoolConfig(StrictModel):
    """One pool of a mixed fleet (``cluster.pools``): ``replicas`` of the engine on their
    own cost model (``cost``: a ``model.cost`` of its own, e.g. a roofline on another GPU
    type or TP; left out: ``model.cost``), hence their own step times and KV capacity
    (its memory plan), billed at their own price. ``role``: what its replicas do with a
    request (``cluster.disagg``): ``mixed`` serves it whole (the default, a colocated
    engine), ``prefill`` runs its prompt and first token and hands its KV on,
    ``decode`` takes that KV and generates the rest."""

    name: str = Field(..., min_length=1, max_length=64, description="the pool's name "
                      "(summary.json cluster.pools, autoscaler.pool)")
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed", description="mixed (whole requests), prefill or decode (disaggregated "
        "serving: a prefill pool and a decode pool with a KV link between them)")
    replicas: int = Field(1, ge=0, le=10_000, description="replicas of this pool (with an "
                          "autoscaler on this pool: the start)")
    cost: Optional[plugin(COST_MODELS)] = Field(None, description="this pool's cost model "
                                                "(null: model.cost)")
    gpus_per_replica: Optional[int] = Field(None, ge=1, description="GPUs one replica "
                                            "occupies (default: tp x pp of a roofline cost "
                                            "model, else cluster.gpus_per_replica)")
    gpu_cost_per_hour: Optional[float] = Field(None, ge=0, description="price of one of its "
                                               "GPU-hours (default: cluster.gpu_cost_per_hour)")


class KVTransferConfig(StrictModel):
    """The link a prefill replica sends a request's KV cache over to its decode replica
    (disaggregated serving, ``cluster.disagg``): a transfer of B bytes takes
    ``latency_us + B / gbs``, and the transfers leaving one prefill replica share its
    one link (they queue on it, first come first served).

    Defaults: ``gbs`` 50 GB/s is one 400 Gb/s NDR InfiniBand port (NVIDIA ConnectX-7
    datasheet: 400 Gb/s = 50 GB/s per port), a replica with one NIC for its KV traffic
    (a TP-8 node with one port per GPU moves up to 8 x 50 = 400 GB/s: set it); within one
    NVLink domain (H100 NVLink 4: 450 GB/s per direction per GPU, NVIDIA H100 datasheet)
    it is far higher. ``latency_us`` 10 us: a few microseconds of RDMA network latency
    (NIC plus switch hops) and the transfer's request and completion messages, rounded
    up; at 50 GB/s it is the time of 500 KB, under two tokens of a 70B model's KV."""

    gbs: float = Field(50.0, gt=0, description="GB/s (1e9 bytes/s) of one prefill "
                       "replica's outgoing KV link")
    latency_us: float = Field(10.0, ge=0, description="fixed time of one transfer, us")


class ClusterConfig(StrictModel):
    """Replicas of the engine behind a router (``router``: a registered router's name,
    or ``{kind: name, ...its parameters}``), with optional admission control and an
    autoscaler (``config.traffic``); with an autoscaler ``replicas`` is the start.
    ``pools``: a mixed fleet, replicas of different GPU types or cost models behind one
    router (``cluster.pools``); ``replicas`` is then their total (set when left out)."""

    replicas: int = Field(1, ge=1, le=10_000, description="serving replicas (with pools: "
                          "their total)")
    router: str = Field("round_robin", description="a registered router's name: "
                        "round_robin, random, least_outstanding, cache_aware, "
                        "nearest_region, region_load_rtt")
    router_params: dict[str, Any] = Field(default_factory=dict,
                                          description="the router's own parameters")
    gpus_per_replica: int = Field(1, ge=1, description="GPUs one replica occupies (what the "
                                  "planner prices); with a roofline cost model it must equal "
                                  "tp x pp, and is set to it when left out")
    gpu_cost_per_hour: Optional[float] = Field(None, ge=0, description="price of one GPU-hour "
                                               "(summary.json cluster.cost_usd)")
    admission: Optional[AdmissionConfig] = None
    autoscaler: Optional[AutoscalerConfig] = None
    pools: Optional[list[PoolConfig]] = Field(None, min_length=1, description="a mixed "
                                              "fleet: pools of replicas, each with its own "
                                              "cost model and price")
    faults: Optional[FaultsConfig] = Field(None, description="replicas that fail and "
                                           "recover (config.faults)")
    breaker: Optional[BreakerConfig] = Field(None, description="a circuit breaker per "
                                             "replica in the gateway (config.faults)")
    degrade: Optional[DegradeConfig] = Field(None, description="degradation when "
                                             "overloaded: a smaller model's pool or "
                                             "shorter outputs (config.faults)")
    kv_transfer: Optional[KVTransferConfig] = Field(
        None, description="the KV link from prefill to decode pools (disaggregated "
        "serving; default: one 400 Gb/s InfiniBand port, 50 GB/s, 10 us)")

    _spec = model_validator(mode="before")(classmethod(lambda cls, v: router_spec(v)))

    @model_validator(mode="after")
    def _pools(self):
        if self.pools is None:
            return self
        names = [p.name for p in self.pools]
        dup = sorted({x for x in names if names.count(x) > 1})
        if dup:
            raise ValueError(f"cluster.pools: pool name {dup[0]!r} is used twice")
        total = sum(p.replicas for p in self.pools)
        if total < 1:
            raise ValueError("cluster.pools: the pools hold no replica (total replicas 0)")
        if "replicas" not in self.model_fields_set:
            self.replicas = total
            self.__pydantic_fields_set__.discard("replicas")   # still derived, not given
        elif self.replicas != total:
            raise ValueError(f"cluster.replicas ({self.replicas}) must equal the pools' "
                             f"total ({total}); leave it out with pools")
        check_roles(self)
        return self

    @model_validator(mode="after")
    def _faults(self):
        f = self.faults
        for i, o in enumerate(f.outages if f is not None else []):
            if o.replica >= self.replicas:
                raise ValueError(f"cluster.faults.outages[{i}].replica: {o.replica} is not a "
                                 f"replica (there are {self.replicas}, numbered from 0)")
        dg = self.degrade
        if dg is not None and dg.pool is not None and dg.pool not in [p.name for p in
                                                                      self.pools or []]:
            raise ValueError(f"cluster.degrade.pool {dg.pool!r} is not a pool of cluster.pools"
                             f" ({', '.join(p.name for p in self.pools or []) or 'none given'})")
        if dg is not None and dg.pool is not None and len(self.pools) < 2:
            raise ValueError("cluster.degrade.pool needs another pool beside it to serve "
                             "the traffic that is not degraded")
        if f is not None or self.breaker is not None or dg is not None:
            what = ("cluster.faults" if f is not None else "cluster.breaker"
                    if self.breaker is not None else "cluster.degrade")
            auto = self.autoscaler
            if auto is not None and (f is not None or self.breaker is not None):
                raise ValueError(f"{what} with cluster.autoscaler is not modelled (the "
                                 "autoscaler's slots come and go); leave one out")
            if auto is not None and dg.pool is not None and dg.pool == (
                    auto.pool or self.pools[0].name):
                raise ValueError(f"cluster.degrade.pool {dg.pool!r} is the pool the "
                                 "autoscaler scales; degrade to another pool")
            if self.disaggregated:
                raise ValueError(f"{what} on a disaggregated cluster (pools with roles) is "
                                 "not modelled; leave it out")
        return self

    @property
    def disaggregated(self) -> bool:
        """Whether prefill and decode run on separate pools (a pool has a role)."""
        return any(p.role != "mixed" for p in self.pools or [])

    @model_validator(mode="after")
    def _kv_transfer(self):
        if self.kv_transfer is not None and not self.disaggregated:
            raise ValueError("cluster.kv_transfer is the link between prefill and decode "
                             "pools; give the pools roles (cluster.pools[].role) or leave it out")
        return self

    @field_validator("router")
    @classmethod
    def _router(cls, v: str) -> str:
        if v not in ROUTERS.names():
            raise ValueError(f"unknown router {v!r}; known: {', '.join(ROUTERS.names())}")
        return v

    @model_validator(mode="after")
    def _router_params(self):
        check_router_params(self.router, self.router_params)
        return self


def check_roles(cl: ClusterConfig) -> None:
    """A disaggregated cluster (a pool with a role) needs prefill and decode replicas and
    no ``mixed`` pool beside them; the autoscaler does not scale a role (``ValueError``
    naming the pool and its role)."""
    roles = {p.role for p in cl.pools or []}
    if roles <= {"mixed"}:
        return
    if "mixed" in roles:
        p = next(p for p in cl.pools if p.role == "mixed")
        raise ValueError(f"cluster.pools: pool {p.name!r} has role 'mixed' beside prefill/decode "
                         "pools; a disaggregated cluster has only prefill and decode pools")
    for role in ("prefill", "decode"):
        n = sum(p.replicas for p in cl.pools if p.role == role)
        if n < 1:
            have = ", ".join(f"{p.name!r} ({p.role}, {p.replicas} replicas)" for p in cl.pools)
            raise ValueError(f"cluster.pools: a disaggregated cluster needs at least one "
                             f"{role} replica; the pools are {have}")
    if cl.router in REGION_ROUTERS:
        # A region router's replicas are the fleet's slots by index, but each role routes
        # among its own ready replicas that can hold the request (a subset).
        raise ValueError(f"cluster.router: {cl.router!r} is not modelled on a disaggregated "
                         "cluster (pools with roles); use least_outstanding, round_robin, "
                         "random or cache_aware")
    if cl.autoscaler is not None:
        raise ValueError("cluster.autoscaler: autoscaling a disaggregated cluster (pools with "
                         "roles) is not modelled; size its pools by hand or with latsim plan")
