"""``cluster``: the serving fleet: replicas (or pools of replicas of different GPU
types), the router, admission control and the autoscaler in front of them."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, field_validator, model_validator

from simulator.config.traffic import (AdmissionConfig, AutoscalerConfig, check_router_params,
                                      router_spec)
from simulator.config.pluginfield import plugin
from simulator.config.registry import COST_MODELS, ROUTERS
from simulator.config.strict import _Strict


class PoolConfig(_Strict):
    """One pool of a mixed fleet (``cluster.pools``): ``replicas`` of the engine on their
    own cost model (``cost``: a ``model.cost`` of its own, e.g. a roofline on another GPU
    type or TP; left out: ``model.cost``), hence their own step times and KV capacity
    (its memory plan), billed at their own price."""

    name: str = Field(..., min_length=1, max_length=64)
    replicas: int = Field(1, ge=0, le=10_000, description="replicas of this pool (with an "
                          "autoscaler on this pool: the start)")
    cost: Optional[plugin(COST_MODELS)] = Field(None, description="this pool's cost model "
                                                "(null: model.cost)")
    gpus_per_replica: Optional[int] = Field(None, ge=1, description="GPUs one replica "
                                            "occupies (default: tp x pp of a roofline cost "
                                            "model, else cluster.gpus_per_replica)")
    gpu_cost_per_hour: Optional[float] = Field(None, ge=0, description="price of one of its "
                                               "GPU-hours (default: cluster.gpu_cost_per_hour)")


class ClusterConfig(_Strict):
    """Replicas of the engine behind a router (``router``: a registered router's name,
    or ``{kind: name, ...its parameters}``), with optional admission control and an
    autoscaler (``config.traffic``); with an autoscaler ``replicas`` is the start.
    ``pools``: a mixed fleet, replicas of different GPU types or cost models behind one
    router (``cluster.pools``); ``replicas`` is then their total (set when left out)."""

    replicas: int = Field(1, ge=1, le=10_000)
    router: str = "round_robin"
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
