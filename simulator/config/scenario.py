"""The scenario: one typed configuration tree (pydantic), loaded from YAML.

A scenario names the traffic (``workload``), the wire (``network``, ``stream``),
the serving fleet (``cluster``), the engine and its scheduling policy
(``engine``), the model and its measured cost profile (``model``), the SLOs and
the seed. Every section forbids unknown keys, so a typo is an error, not a
silently ignored setting. ``load_scenario`` turns any validation problem into a
one-line ``LatsimError`` naming the file, the field and the value.

The sections live in their own modules (``cluster``, ``engine``, ``model``, ``wire``,
``traffic``; reading the file safely: ``yamlfile``); this one holds the whole tree, the
checks that span sections, and loading.
"""
from __future__ import annotations

import re

from pathlib import Path
from typing import Any, Optional, Union

from pydantic import (Field, ValidationError, field_validator,
                      model_validator)

from simulator.config.plugins import load_plugins  # (importing registers the built-ins)
from simulator.config.traffic import (ClientConfig,
                                      ReportConfig, check_traffic)
from simulator.config.wire import NetworkConfig, StreamConfig  # noqa: F401  (part of the tree)
from simulator.errors import LatsimError, read_text
from simulator.config.pluginfield import plugin
from simulator.config.registry import WORKLOADS
from simulator.model.policies.priority_aging import MIN_AGING_S
from simulator.model.scheduling import check_policy_name
from simulator.workload.classes import SLO
from simulator.config.cluster import ClusterConfig
from simulator.config.engine import (EngineConfig, KVConfig, SpeculativeConfig,
                                     _check_policy_params, _policy_spec)
from simulator.config.edge import EdgeConfig
from simulator.config.model import ModelConfig
from simulator.config.presets import apply_presets
from simulator.config.strict import StrictModel, checked_as
from simulator.config.yamlfile import MAX_SCENARIO_BYTES, apply_overrides, check_numbers, safe_yaml


class Scenario(StrictModel):
    """A whole scenario; see module docstring."""

    name: str = Field("scenario", max_length=200)
    seed: int = Field(0, ge=0, description="seeds every random stream of the run")
    workload: plugin(WORKLOADS)
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    slo: SLO = Field(default_factory=SLO, description="default SLO for classes without one")
    plugins: list[str] = Field(default_factory=list, description="modules to import before "
                               "the rest is read (a user's policies, workloads, routers): "
                               "import paths, or .py files relative to the scenario")
    policies: Optional[list[Union[str, "PolicyRun"]]] = Field(
        None, description="run each of these: a policy name, or {policy, label, engine "
                          "fields to override for that run}")
    max_sim_time_s: Optional[float] = Field(None, gt=0, description="stop the clock here")
    client: Optional[ClientConfig] = Field(None, description="clients' timeouts and retries "
                                           "(None: patient clients that never retry)")
    report: ReportConfig = Field(default_factory=ReportConfig)
    edge: Optional[EdgeConfig] = Field(None, description="an edge node in front of the "
                                       "cluster: a result cache, a small model")

    # ``engine.preset``: a serving engine's defaults under the keys the scenario states.
    _preset = model_validator(mode="before")(classmethod(lambda cls, v: apply_presets(v)))

    @model_validator(mode="after")
    def _traffic(self):
        check_traffic(self)
        if any(not isinstance(p, str) and (p.cluster or "client" in p.model_fields_set)
               for p in self.policies or []):
            for _label, run in self.policy_runs():
                check_traffic(run)
        return self

    @model_validator(mode="after")
    def _edge(self):
        if self.edge is not None or any(not isinstance(p, str) and p.edge
                                        for p in self.policies or []):
            from simulator.config.edge import check_edge
            check_edge(self)
        return self

    @model_validator(mode="after")
    def _pool_costs(self, info):
        if self.cluster.pools:
            settle_pool_costs(self, getattr(info, "context", None))
        return self

    @model_validator(mode="after")
    def _speculative(self):
        runs = [(None, self)]
        if any(not isinstance(p, str) and p.speculative for p in self.policies or []):
            runs += self.policy_runs()
        for label, run in runs:
            if run.engine.speculative is not None and not run.model.cost.prices_verify:
                from simulator.model.speculative import speculative_cost_error
                where = "engine.speculative" if label is None else \
                    f"policies ({label!r}): speculative"
                raise ValueError(f"{where}: " + speculative_cost_error(run.model.cost.kind))
            if run.engine.speculative is not None and run.cluster.pools:
                # A pool's replicas are built with the pool's own cost model, which has
                # no draft or verify pricing: refuse rather than silently not speculate.
                where = "engine.speculative" if label is None else \
                    f"policies ({label!r}): speculative"
                raise ValueError(f"{where}: speculative decoding is not modelled on a mixed "
                                 f"fleet (cluster.pools); use one pool type per run")
        return self

    @model_validator(mode="after")
    def _sizes(self):
        # The event loops keep arrays of replicas x batch slots and clients x pooled
        # connections: beyond these a run cannot be held in memory (or is a typo).
        slots = self.cluster.replicas * self.engine.max_num_seqs
        if slots > 10**7:
            raise ValueError(f"cluster.replicas x engine.max_num_seqs = {slots:,} batch slots; "
                             "at most 10,000,000")
        return self

    @model_validator(mode="after")
    def _policy_kv(self):
        # A run's engine.kv is the scenario's with its entry's ``kv`` changes over it
        # (``policy_runs``): the merged one must hold together too (prefix_caching with
        # allocation, offload with prefix_caching), found now rather than mid-sweep.
        for p in self.policies or []:
            if isinstance(p, str) or not p.kv:
                continue
            try:
                KVConfig.model_validate({**self.engine.kv.model_dump(exclude_unset=True),
                                         **p.kv})
            except ValidationError as e:
                msg = e.errors()[0]["msg"].removeprefix("Value error, ")
                raise ValueError(f"policies ({p.name!r}): kv: {msg}") from None
        return self

    @field_validator("policies")
    @classmethod
    def _policies(cls, v):
        if v is not None and not v:
            raise ValueError("policies list is empty")
        if v is not None:
            labels = [p if isinstance(p, str) else p.name for p in v]
            if len(set(labels)) != len(labels):
                raise ValueError(f"policy labels repeat: {labels}; give each a label")
            for p in v:
                if isinstance(p, str):
                    check_policy_name(p)
        return v

    def policy_runs(self) -> list[tuple[str, "Scenario"]]:
        """``(label, scenario)`` for each entry of ``policies`` (or the engine's one)."""
        if not self.policies:
            return [(self.engine.policy, self)]
        runs = []
        for p in self.policies:
            if isinstance(p, str):
                same = p == self.engine.policy
                eng = self.engine.model_copy(update={
                    "policy": p, "policy_params": self.engine.policy_params if same else {}})
                label = p
            else:
                # Only what was given, so what was left out stays left out (e.g. a
                # roofline's engine.kv.gpu_memory_gb, which must not be given).
                data = self.engine.model_dump(exclude_unset=True)
                if p.policy != self.engine.policy:
                    data["policy_params"] = {}
                data.update(p.model_dump(exclude={"label", "kv", "cluster", "client",
                                                  "speculative", "edge"}, exclude_none=True))
                if "speculative" in p.model_fields_set:
                    data["speculative"] = p.speculative
                if p.kv:
                    data["kv"] = {**data.get("kv", {}), **p.kv}
                eng = EngineConfig.model_validate(data)
                label = p.name
                edge = ({"edge": p.edge_of(self)} if "edge" in p.model_fields_set else {})
                if p.cluster or "client" in p.model_fields_set:
                    runs.append((label, self.model_copy(update={"engine": eng, **edge,
                                                                **p.traffic_update(self)})))
                    continue
                runs.append((label, self.model_copy(update={"engine": eng, **edge})))
                continue
            runs.append((label, self.model_copy(update={"engine": eng})))
        return runs


def settle_pool_costs(sc: "Scenario", context=None) -> None:
    """Check each pool's own cost model against the scenario's model as ``model.cost`` is
    checked (a roofline's parallelism, a profile's model) and fill in what it takes from
    ``model`` (a roofline's model name); ``ValueError`` naming the pool."""
    base = {"name": sc.model.name} if sc.model.name else {"shape": sc.model.shape.model_dump()}
    for p in sc.cluster.pools or []:
        if p.cost is None:
            continue
        try:
            m = ModelConfig.model_validate({**base, "cost": p.cost.model_dump(mode="json")},
                                           context=context)
        except ValidationError as e:
            err = e.errors()[0]
            msg = err["msg"].removeprefix("Value error, ")
            raise ValueError(f"cluster.pools[{p.name!r}].cost: {msg}") from None
        p.cost = m.cost


class PolicyRun(StrictModel):
    """One entry of ``policies:`` with its own engine settings (``policy``: a name, or
    ``{kind: name, ...its parameters}``)."""

    policy: str = Field(..., description="the run's policy, as engine.policy")
    policy_params: Optional[dict[str, Any]] = Field(None, description="as engine.policy_params")
    label: Optional[str] = Field(None, description="the run's name in tables and files "
                                 "(default: the policy's)")
    max_num_seqs: Optional[int] = Field(None, ge=1, description="as engine.max_num_seqs")
    max_num_batched_tokens: Optional[int] = Field(None, ge=1,
                                                  description="as engine.max_num_batched_tokens")
    chunk_size: Optional[int] = Field(None, ge=1, description="as engine.chunk_size")
    aging_s: Optional[float] = Field(None, ge=MIN_AGING_S, description="as engine.aging_s")
    kv: Optional[dict[str, Any]] = Field(None, description="engine.kv fields to change for "
                                         "this run (e.g. preemption, gpu_memory_gb)")
    cluster: Optional[dict[str, Any]] = Field(None, description="cluster fields to change "
                                              "for this run (router, admission, autoscaler, "
                                              "replicas)")
    client: Optional[dict[str, Any]] = Field(None, description="client fields to change for "
                                             "this run; null: patient clients")
    speculative: Optional[dict[str, Any]] = Field(None, description="engine.speculative for "
                                                  "this run; null: off")
    edge: Optional[dict[str, Any]] = Field(None, description="edge sections to change for "
                                           "this run; null: no edge")

    _edge = checked_as("edge", EdgeConfig)

    def edge_of(self, base: "Scenario") -> Optional[EdgeConfig]:
        """This run's edge: the base scenario's with this entry's sections changed
        (``edge: null``: none)."""
        if self.edge is None:
            return None
        old = base.edge.model_dump(exclude_unset=True) if base.edge is not None else {}
        return EdgeConfig.model_validate({**old, **self.edge})

    _speculative = checked_as("speculative", SpeculativeConfig)

    _spec = model_validator(mode="before")(classmethod(lambda cls, v: _policy_spec(v)))
    _known = field_validator("policy")(classmethod(lambda cls, v: check_policy_name(v)))

    _cluster = checked_as("cluster", ClusterConfig)

    _client = checked_as("client", ClientConfig)

    def traffic_update(self, base: "Scenario") -> dict:
        """The ``cluster`` and ``client`` of this run: the base scenario's with this
        entry's fields changed (``client: null`` removes the clients' model)."""
        out = {}
        if self.cluster:
            data = base.cluster.model_dump(exclude_unset=True)
            if "router" in self.cluster and "router_params" not in self.cluster:
                data["router_params"] = {}
            out["cluster"] = ClusterConfig.model_validate({**data, **self.cluster})
        if "client" in self.model_fields_set:
            if self.client is None:
                out["client"] = None
            else:
                old = base.client.model_dump() if base.client is not None else {}
                out["client"] = ClientConfig.model_validate({**old, **self.client})
        return out

    @model_validator(mode="after")
    def _params(self):
        _check_policy_params(self.policy, self.policy_params or {})
        return self

    _kv = checked_as("kv", KVConfig)

    @property
    def name(self) -> str:
        return self.label or self.policy


Scenario.model_rebuild()


# -- reading a scenario ----------------------------------------------------------------------

_UNION_TAGS = {"str", "PolicyRun"}


def _is_tag(part) -> bool:
    """A part of pydantic's error location that names a union branch or a validator
    (``str``, ``PolicyRun``, ``function-after[_params(), PolicyRun]``), not a field."""
    return part in _UNION_TAGS or bool(re.match(r"function-(after|before|wrap|plain)\[",
                                                  str(part)))


def _format_validation(e: ValidationError, source: str, data: dict) -> LatsimError:
    errs = e.errors()
    # A union (``policies``: a name or a mapping) reports one error per branch; the
    # deepest one is about what the user wrote, not about the branch not taken.
    err = max(errs, key=lambda x: len(x["loc"])) if len(errs) > 1 else errs[0]
    loc = ".".join(str(p) for p in err["loc"] if not _is_tag(p))
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] in ("plugin_field",):
        # The plug-in already folded its inner location and value into the message.
        inner = err["ctx"]["loc"]
        field = ".".join(p for p in (loc, inner) if p)
        return LatsimError(f"{err['ctx']['msg']}", source=source, field=field or None,
                           value=err["ctx"]["value"], has_value=True)
    if err["type"] == "plugin_kind":
        ctx = err["ctx"]
        return LatsimError(f"unknown {ctx['what']} kind; known: {ctx['known']}", source=source,
                           field=f"{loc}.kind" if loc else "kind", value=ctx["kind"],
                           has_value=True)
    if err["type"] == "extra_forbidden":
        return LatsimError("unknown key", source=source, field=loc,
                           value=err.get("input"), has_value=True)
    if err["type"] == "missing":
        return LatsimError("required field is missing", source=source, field=loc)
    # A check over a whole section (a model validator) gets the section as its input:
    # echoing that mapping says nothing the message does not.
    whole = isinstance(err.get("input"), dict)
    return LatsimError(msg, source=source, field=loc or None, value=err.get("input"),
                       has_value=not whole)


def validate_scenario(data: Any, source: str = "<scenario>",
                      base_dir: Optional[Path] = None) -> Scenario:
    """Validate a mapping into a ``Scenario``, or raise a one-line ``LatsimError``. Its
    ``plugins`` are imported first (``.py`` files relative to ``base_dir``). Every number
    must be finite and fit 64 bits (``check_numbers``)."""
    if not isinstance(data, dict):
        raise LatsimError("a scenario must be a YAML mapping", source=source,
                          value=type(data).__name__, has_value=True)
    check_numbers(data, source)
    load_plugins(data.get("plugins"), base_dir, source)
    try:
        # ``base_dir`` is how a relative path (profile, config.json) is found as the
        # loader finds it: relative to the scenario file first.
        return Scenario.model_validate(
            data, context={"base_dir": base_dir} if base_dir is not None else None)
    except ValidationError as e:
        raise _format_validation(e, source, data) from None
    except RecursionError:
        raise LatsimError("the scenario is nested too deeply", source=source) from None


def read_yaml(path: str | Path, max_bytes: int = MAX_SCENARIO_BYTES) -> Any:
    """Read a YAML file: an existing regular UTF-8 text file of at most ``max_bytes``,
    parsed with ``BoundedLoader``; one-line ``LatsimError`` for each problem."""
    p = Path(path)
    text = read_text(p, max_bytes=max_bytes, what="scenario file")
    data = safe_yaml(text, str(p))
    if data is None:
        raise LatsimError("file is empty", source=str(p))
    return data


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> tuple[Scenario, Path]:
    """Load, override and validate a scenario file; returns it and its directory."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise LatsimError("a scenario must be a YAML mapping", source=str(path),
                          value=type(data).__name__, has_value=True)
    data = apply_overrides(data, overrides, source=str(path))
    base = Path(path).resolve().parent
    return validate_scenario(data, source=str(path), base_dir=base), base
