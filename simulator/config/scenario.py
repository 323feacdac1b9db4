"""The scenario: one typed configuration tree (pydantic), loaded from YAML.

A scenario names the traffic (``workload``), the wire (``network``, ``stream``),
the serving fleet (``cluster``), the engine and its scheduling policy
(``engine``), the model and its measured cost profile (``model``), the SLOs and
the seed. Every section forbids unknown keys, so a typo is an error, not a
silently ignored setting. ``load_scenario`` turns any validation problem into a
one-line ``LatsimError`` naming the file, the field and the value.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_serializer, model_validator)

from simulator.config.plugins import load_plugins  # (importing registers the built-ins)
from simulator.config.traffic import (AdmissionConfig, AutoscalerConfig, ClientConfig,
                                      ReportConfig, check_router_params, check_traffic,
                                      router_spec)
from simulator.config.wire import NetworkConfig, StreamConfig  # noqa: F401  (part of the tree)
from simulator.errors import LatsimError, read_text
from simulator.config.pluginfield import plugin
from simulator.config.registry import COST_MODELS, ROUTERS, WORKLOADS
from simulator.model.scheduling import check_policy_name, make_policy, policy_class
from simulator.workload.classes import SLO


class _Strict(BaseModel):
    # Unknown keys are errors; so is a float that is not finite (inf, nan).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


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


class KVConfig(_Strict):
    """KV cache: capacity from GPU memory (or an explicit block count), allocation,
    preemption under memory pressure, and prefix caching (see ``kvspace``)."""

    block_size: int = Field(16, ge=1, le=4096)
    num_blocks: Optional[int] = Field(None, ge=1, description="overrides the memory-derived count")
    gpu_memory_gb: float = Field(80.0, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    allocation: Literal["paged", "contiguous"] = Field(
        "paged", description="paged: blocks on demand; contiguous: reserve max length up front")
    max_model_len: Optional[int] = Field(None, ge=1, description="longest request (prompt + "
                                         "output); contiguous reserves this much per request")
    watermark: float = Field(0.0, ge=0, lt=1, description="fraction of blocks kept free "
                             "at admission")
    preemption: Literal["recompute", "swap"] = "recompute"
    victim: Literal["priority", "latest"] = Field(
        "priority", description="whom to preempt: lowest class then latest arrival, or latest")
    swap_space_gb: float = Field(4.0, ge=0, description="CPU memory for swapped-out KV")
    swap_gb_per_s: float = Field(25.0, gt=0, description="GPU<->CPU copy bandwidth (PCIe)")
    prefix_caching: bool = False

    @model_validator(mode="after")
    def _coherent(self):
        if self.prefix_caching and self.allocation == "contiguous":
            raise ValueError("prefix_caching needs allocation: paged (contiguous "
                             "reservations are private to a request)")
        return self


def _policy_spec(data: Any) -> Any:
    """``policy: {kind: name, param: value, ...}`` -> ``policy: name`` plus
    ``policy_params`` (the same thing, flat enough for ``--set`` and sweep axes)."""
    if isinstance(data, dict) and isinstance(data.get("policy"), dict):
        data = dict(data)
        spec = dict(data["policy"])
        kind = spec.pop("kind", None)
        if not isinstance(kind, str):
            raise ValueError("policy: a mapping needs a 'kind' naming the policy")
        data["policy"] = kind
        data["policy_params"] = {**(data.get("policy_params") or {}), **spec}
    return data


def _check_policy_params(name: str, params: dict) -> None:
    """The named policy takes these parameters (its own ``Params``)."""
    cls = policy_class(name)
    try:
        cls.Params(**params)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        msg = "unknown parameter" if err["type"] == "extra_forbidden" else \
            err["msg"].removeprefix("Value error, ")
        raise ValueError(f"policy {name!r}, parameter {key!r}: {msg}") from None


class SpeculativeConfig(_Strict):
    """Speculative decoding (``engine.speculative``): each decode step proposes ``k``
    draft tokens per sequence (``draft``: a small draft model, ``draft_model``, run
    ``k`` times; ``ngram``: prompt lookup on the host) and the target verifies them in
    one pass; each draft is accepted with probability ``acceptance`` (i.i.d.)."""

    method: Literal["draft", "ngram"]
    k: int = Field(4, ge=1, le=32, strict=True, description="draft tokens proposed per step")
    acceptance: float = Field(ge=0, le=1, description="probability each draft token is "
                              "accepted (i.i.d., Leviathan et al. 2023)")
    draft_model: Optional[str] = Field(None, description="method draft: a catalogued model "
                                       "(e.g. llama-3.2-1b) or a config.json path")

    @field_validator("draft_model")
    @classmethod
    def _known(cls, v):
        if v is not None:
            from simulator.cost import catalog
            try:
                catalog.model(v)
            except LatsimError as e:
                raise ValueError(str(e).removeprefix("field 'model': ")) from None
        return v

    @model_validator(mode="after")
    def _needs_draft(self):
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("method draft needs draft_model (a catalogued model, e.g. "
                             "llama-3.2-1b)")
        if self.method == "ngram" and self.draft_model is not None:
            raise ValueError("draft_model is for method draft (ngram proposes from the "
                             "prompt)")
        return self


class EngineConfig(_Strict):
    """One replica's engine: scheduling policy and its limits. ``policy`` is a
    registered policy's name, or ``{kind: name, ...its parameters}``."""

    policy: str = "chunked"
    policy_params: dict[str, Any] = Field(default_factory=dict,
                                          description="the policy's own parameters")
    max_num_seqs: int = Field(256, ge=1, le=1_000_000)
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget per step")
    chunk_size: Optional[int] = Field(None, ge=1, description="max prefill chunk (default: "
                                      "budget), for policies that chunk")
    aging_s: float = Field(30.0, gt=0, description="priority_aging: one class per aging_s "
                           "waited (its default)")
    kv: KVConfig = Field(default_factory=KVConfig)
    speculative: Optional[SpeculativeConfig] = Field(None, description="speculative "
                                                     "decoding what-if (None: off)")

    _spec = model_validator(mode="before")(classmethod(lambda cls, v: _policy_spec(v)))
    _policy = field_validator("policy")(classmethod(lambda cls, v: check_policy_name(v)))

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        # Off, it is not written (a scenario without it echoes as it did before).
        d = handler(self)
        if self.speculative is None and isinstance(d, dict):
            d.pop("speculative", None)
        return d

    @model_validator(mode="after")
    def _params(self):
        _check_policy_params(self.policy, self.policy_params)
        return self


def engine_policy(eng: EngineConfig, name: Optional[str] = None):
    """The ``Policy`` an engine config describes (``name`` overrides its policy; the
    engine's ``policy_params`` then apply only if they name the same policy)."""
    name = name or eng.policy
    return make_policy(name, max_num_seqs=eng.max_num_seqs,
                       max_num_batched_tokens=eng.max_num_batched_tokens,
                       params=eng.policy_params if name == eng.policy else None,
                       chunk_size=eng.chunk_size, aging_s=eng.aging_s)


class ModelShape(_Strict):
    """The served model's shape: what sets weight and KV memory. Filled from the
    catalogue when ``model.name`` names the model."""

    name: str = "llama3-8b"
    n_layers: int = Field(32, ge=1)
    d_model: int = Field(4096, ge=1)
    n_heads: int = Field(32, ge=1)
    n_kv_heads: int = Field(8, ge=1)
    head_dim: int = Field(128, ge=1)
    params_b: float = Field(8.03, gt=0, description="parameters, billions")
    dtype_bytes: int = Field(2, ge=1, description="bytes of a K or V element (and of a "
                             "weight unless weight_dtype_bytes says otherwise)")
    weight_dtype_bytes: Optional[float] = Field(None, gt=0, description="bytes per weight "
                                                "(default: dtype_bytes)")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        """Bytes of all the weights."""
        return self.params_b * 1e9 * (self.weight_dtype_bytes or self.dtype_bytes)


# The shape fields that say which model it is (a hand-typed shape must agree on them).
_SHAPE_DIMS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim")
_REPO_ROOT = Path(__file__).resolve().parents[2]


def _field_error(loc: str, msg: str, value: Any):
    """A validation error naming ``model.<loc>`` and its value (one line)."""
    from pydantic_core import PydanticCustomError
    return PydanticCustomError("plugin_field", "{loc}: {msg}", {"loc": loc, "msg": msg,
                                                                "value": value})


def _bare(e: Exception) -> str:
    """A LatsimError's message without its ``field '...':`` head and ``(got ...)`` tail
    (the validation error names the field and value again)."""
    import re
    msg = str(e)
    msg = re.sub(r"^.*?field '[^']*': ", "", msg)
    return re.sub(r" \(got .*\)$", "", msg)


def _search_dirs(info) -> list[Path]:
    """Where a relative model or profile path is looked up: the scenario's folder (when
    the loader passes it as context ``base_dir``), the working directory, the checkout."""
    ctx = getattr(info, "context", None) or {}
    base = ctx.get("base_dir") if isinstance(ctx, dict) else None
    return ([Path(base)] if base is not None else []) + [Path.cwd(), _REPO_ROOT]


def _shape_of(arch, kv_bytes: float, weight_bytes: Optional[float]) -> "ModelShape":
    return ModelShape(name=arch.name, n_layers=arch.layers, d_model=arch.hidden,
                      n_heads=arch.heads, n_kv_heads=arch.kv_heads, head_dim=arch.head_dim,
                      params_b=arch.param_count() / 1e9, dtype_bytes=max(1, int(kv_bytes)),
                      weight_dtype_bytes=weight_bytes)


def _profile_model_check(name: Optional[str], shape: "ModelShape", path: str, dirs) -> None:
    """A measured profile must be of the scenario's model: its ``meta.model`` dimensions
    (or, lacking them, its catalogued name) must match (one-line error otherwise)."""
    import json

    from simulator.cost import catalog
    p = Path(path)
    cands = [p] if p.is_absolute() else [Path(d) / p for d in dirs]
    found = next((q for q in cands if q.is_file()), None)
    if found is None:
        return      # the cost model reports a missing profile when it is built
    try:
        meta = json.loads(found.read_text()).get("meta") or {}
    except (ValueError, OSError, AttributeError):
        return      # ... and an unreadable one
    m = meta.get("model")
    if not isinstance(m, dict):
        return
    theirs = {"n_layers": m.get("n_layers"), "d_model": m.get("d_model"),
              "n_heads": m.get("n_heads"), "n_kv_heads": m.get("n_kv_heads"),
              "head_dim": m.get("head_dim")}
    what = f"model.name {name!r}" if name else "model.shape"
    hint = ("; to carry a measurement to another model or GPU use model.cost: {kind: roofline, "
            f"gpu: ..., calibrate: {path}}}")
    for k, v in theirs.items():
        if isinstance(v, (int, float)) and int(v) != getattr(shape, k):
            raise _field_error("cost.path", f"{what} has {k} {getattr(shape, k)} but the "
                               f"profile's meta.model ({m.get('name')!r}) has {int(v)}{hint}",
                               path)
    if name and isinstance(m.get("name"), str) and not any(
            isinstance(v, (int, float)) for v in theirs.values()):
        try:
            same = catalog.model(name).name == catalog.model(m["name"]).name
        except Exception:  # noqa: BLE001 - an uncatalogued name cannot be compared
            return
        if not same:
            raise _field_error("cost.path", f"model.name {name!r} but the profile's "
                               f"meta.model.name is {m['name']!r}{hint}", path)


class ModelConfig(_Strict):
    """The model and how its step cost is obtained. ``name`` (a catalogue name or a
    Hugging Face config.json path) fills ``shape`` from the catalogue; a hand-typed
    ``shape`` is kept for scenarios that name no model, and must agree with a named
    one. A roofline cost model takes its model from ``name``; a measured profile
    (``profile``, ``fitted``) must be of the named or shaped model."""

    name: Optional[str] = Field(None, description="catalogued model or config.json path")
    shape: ModelShape = Field(default_factory=ModelShape)
    cost: plugin(COST_MODELS) = Field(default_factory=lambda: COST_MODELS.validate(
        {"kind": "profile", "path": "profiles/h200-llama3-8b-refbench.json"}))

    @model_validator(mode="after")
    def _coherent(self, info):
        from simulator.cost import catalog
        cost = self.cost
        kind = getattr(cost, "kind", None)
        dirs = _search_dirs(info)
        name = self.name
        if kind == "roofline":
            if name and cost.model and not _same_model(name, cost.model, dirs):
                raise _field_error("cost.model", f"names another model than model.name "
                                   f"({name!r}); give the model once, as model.name", cost.model)
            name = name or cost.model
            if not name:
                raise _field_error("name", "a roofline cost model needs the model: a catalogued "
                                   "name or a config.json path", None)
        if name is None:
            if kind in ("profile", "fitted") and "shape" in self.model_fields_set:
                _profile_model_check(None, self.shape, cost.path, dirs)
            return self
        try:
            from simulator.cost.roofline.model import model_arch
            arch = model_arch(name, dirs)
        except LatsimError as e:
            raise _field_error("name", _bare(e), name) from None
        # A config.json found relative to the scenario is kept by its absolute path, so
        # whatever reads the scenario later finds it from anywhere.
        if arch.source and Path(arch.source).is_file():
            name = str(Path(arch.source).resolve())
        kv_bytes, w_bytes = 2.0, None
        if kind == "roofline":
            try:
                catalog.check_parallelism(arch, cost.tp, cost.pp)
            except LatsimError as e:
                which = "pp" if "'pp'" in str(e) else "tp"
                raise _field_error(f"cost.{which}", _bare(e), getattr(cost, which)) from None
            kv_bytes = catalog.dtype_bytes(cost.kv_dtype)
            w_bytes = catalog.weight_format(cost.weight_dtype).bytes_per_weight
        derived = _shape_of(arch, kv_bytes, w_bytes)
        given = self.shape.model_fields_set if "shape" in self.model_fields_set else set()
        for k in _SHAPE_DIMS + (("dtype_bytes",) if kind == "roofline" else ()):
            if k in given and getattr(self.shape, k) != getattr(derived, k):
                raise _field_error(f"shape.{k}", f"contradicts model.name {name!r}, whose "
                                   f"{k} is {getattr(derived, k)}; leave model.shape out when "
                                   f"naming the model", getattr(self.shape, k))
        keep = {k: getattr(self.shape, k) for k in given
                if k not in _SHAPE_DIMS and k != "name" and kind != "roofline"}
        self.shape = derived.model_copy(update=keep)
        self.name = name
        if kind == "roofline" and cost.model is None:
            self.cost = cost.model_copy(update={"model": name})
        if kind in ("profile", "fitted"):
            _profile_model_check(name, self.shape, cost.path, dirs)
        return self


def _same_model(a: str, b: str, dirs) -> bool:
    """Whether two model references resolve to the same catalogued shape."""
    from simulator.cost.roofline.model import model_arch
    try:
        x, y = model_arch(a, dirs), model_arch(b, dirs)
    except LatsimError:
        return a == b
    return (x.name, x.layers, x.hidden, x.heads, x.kv_heads) == (y.name, y.layers, y.hidden,
                                                                  y.heads, y.kv_heads)


class Scenario(_Strict):
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

    @model_validator(mode="after")
    def _traffic(self):
        check_traffic(self)
        if any(not isinstance(p, str) and (p.cluster or "client" in p.model_fields_set)
               for p in self.policies or []):
            for _label, run in self.policy_runs():
                check_traffic(run)
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
            if run.engine.speculative is not None and \
                    getattr(run.model.cost, "kind", None) not in ("fitted", "roofline"):
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
                                                  "speculative"}, exclude_none=True))
                if "speculative" in p.model_fields_set:
                    data["speculative"] = p.speculative
                if p.kv:
                    data["kv"] = {**data.get("kv", {}), **p.kv}
                eng = EngineConfig.model_validate(data)
                label = p.name
                if p.cluster or "client" in p.model_fields_set:
                    runs.append((label, self.model_copy(update={"engine": eng,
                                                                **p.traffic_update(self)})))
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


class PolicyRun(_Strict):
    """One entry of ``policies:`` with its own engine settings (``policy``: a name, or
    ``{kind: name, ...its parameters}``)."""

    policy: str
    policy_params: Optional[dict[str, Any]] = None
    label: Optional[str] = None
    max_num_seqs: Optional[int] = Field(None, ge=1)
    max_num_batched_tokens: Optional[int] = Field(None, ge=1)
    chunk_size: Optional[int] = Field(None, ge=1)
    aging_s: Optional[float] = Field(None, gt=0)
    kv: Optional[dict[str, Any]] = Field(None, description="engine.kv fields to change for "
                                         "this run (e.g. preemption, gpu_memory_gb)")
    cluster: Optional[dict[str, Any]] = Field(None, description="cluster fields to change "
                                              "for this run (router, admission, autoscaler, "
                                              "replicas)")
    client: Optional[dict[str, Any]] = Field(None, description="client fields to change for "
                                             "this run; null: patient clients")
    speculative: Optional[dict[str, Any]] = Field(None, description="engine.speculative for "
                                                  "this run; null: off")

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, v):
        if v is not None:
            SpeculativeConfig.model_validate(v)
        return v

    _spec = model_validator(mode="before")(classmethod(lambda cls, v: _policy_spec(v)))
    _known = field_validator("policy")(classmethod(lambda cls, v: check_policy_name(v)))

    @field_validator("cluster")
    @classmethod
    def _cluster(cls, v):
        if v is not None:
            ClusterConfig.model_validate(v)   # unknown keys and bad values fail at load time
        return v

    @field_validator("client")
    @classmethod
    def _client(cls, v):
        if v is not None:
            ClientConfig.model_validate(v)
        return v

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

    @field_validator("kv")
    @classmethod
    def _kv(cls, v):
        if v is not None:
            KVConfig.model_validate(v)   # unknown keys and bad values fail at load time
        return v

    @property
    def name(self) -> str:
        return self.label or self.policy


Scenario.model_rebuild()


# -- reading a scenario ----------------------------------------------------------------------

MAX_SCENARIO_BYTES = 16 * 2**20   # a scenario is a few KB; this only stops a wrong file
MAX_ALIAS_EXPANSION = 100_000     # nodes YAML aliases may add to a document ("billion laughs")
INT_LIMIT = 2**63                 # every integer ends up in an int64 array or kernel


def _expanded_size(root) -> int:
    """How many nodes the YAML node graph ``root`` stands for once every alias is
    expanded, computed on the graph (aliases are shared nodes) without expanding it;
    ``LatsimError`` for a recursive alias."""
    from yaml.nodes import MappingNode, SequenceNode
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            kids = (node.value if isinstance(node, SequenceNode) else
                    [x for kv in node.value for x in kv] if isinstance(node, MappingNode) else [])
            size[key] = min(1 + sum(size[id(k)] for k in kids), 2**62)
            continue
        if key in size:
            continue
        if key in on_path:
            raise LatsimError("a YAML alias refers to itself (a recursive structure)")
        on_path.add(key)
        stack.append((node, True))
        if isinstance(node, SequenceNode):
            stack.extend((k, False) for k in node.value if id(k) not in size)
        elif isinstance(node, MappingNode):
            stack.extend((x, False) for kv in node.value for x in kv if id(x) not in size)
    return size[id(root)]


def _distinct_nodes(root) -> int:
    """Nodes in the graph as written (each alias target once)."""
    from yaml.nodes import MappingNode, SequenceNode
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, MappingNode):
            stack.extend(x for kv in node.value for x in kv)
    return len(seen)


_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class BoundedLoader(_BaseLoader):  # type: ignore[misc, valid-type]
    """YAML's safe loader that refuses a document whose aliases expand it by more than
    ``MAX_ALIAS_EXPANSION`` nodes, or refer to themselves: the node graph is checked
    after composition, before anything is built from it."""

    def get_single_node(self):
        """The document's node graph, refused when its aliases expand it too far."""
        node = super().get_single_node()
        if node is not None:
            extra = _expanded_size(node) - _distinct_nodes(node)
            if extra > MAX_ALIAS_EXPANSION:
                raise LatsimError(f"YAML aliases expand the document by {extra:,} nodes, over "
                                  f"the limit of {MAX_ALIAS_EXPANSION:,} (a 'billion laughs' "
                                  "file?)")
        return node


def _load_bounded(text: str, source: str) -> Any:
    """``BoundedLoader`` on ``text``: its bounds and deep nesting are ``LatsimError``s
    naming ``source``; a syntax error stays a ``yaml.YAMLError``."""
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 (a safe loader)
    except LatsimError as e:
        raise LatsimError(str(e), source=source) from None
    except RecursionError:
        raise LatsimError("invalid YAML: nested too deeply", source=source) from None


def safe_yaml(text: str, source: str) -> Any:
    """Parse YAML text with ``BoundedLoader``; one-line ``LatsimError`` on any problem."""
    try:
        return _load_bounded(text, source)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise LatsimError(f"invalid YAML{where}: {problem}", source=source) from None
    except (ValueError, TypeError, OverflowError) as e:   # e.g. a timestamp out of range
        raise LatsimError(f"invalid YAML: {e}", source=source) from None


def check_numbers(data: Any, source: str, prefix: str = "") -> None:
    """Every float in a scenario mapping is finite and every integer fits 64 bits: a
    ``.inf`` rate or a ``.nan`` time is an error naming its field, before anything runs."""
    stack = [(prefix, data)]
    seen: set[int] = set()
    while stack:
        path, v = stack.pop()
        if isinstance(v, bool):
            continue
        if isinstance(v, float):
            if not math.isfinite(v):
                raise LatsimError("must be a finite number", source=source, field=path or None,
                                  value=v, has_value=True)
        elif isinstance(v, int):
            if not -INT_LIMIT < v < INT_LIMIT:
                raise LatsimError("integer out of range (at most 2^63 - 1 in magnitude)",
                                  source=source, field=path or None, value=v, has_value=True)
        elif isinstance(v, (dict, list, tuple)):
            if id(v) in seen:
                continue
            seen.add(id(v))
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                key = f"{path}[{k}]" if not isinstance(v, dict) else (
                    f"{path}.{k}" if path else str(k))
                stack.append((key, x))


def _set_path(data: dict, dotted: str, value: Any, source: str) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise LatsimError("cannot set a key inside a non-mapping", source=source, field=dotted)
        node = nxt
    node[keys[-1]] = value


def parse_override(text: str, source: str = "--set") -> tuple[str, Any]:
    """``a.b=value`` -> ``("a.b", parsed value)``; the value is read as YAML (bounded as a
    scenario file is). ``source`` names the option in errors (``--set``, ``--grid``)."""
    if "=" not in text:
        raise LatsimError("must look like a.b=value", source=source, value=text,
                          has_value=True)
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p.strip() for p in key.split(".")):
        raise LatsimError("the key before '=' is empty", source=source, value=text,
                          has_value=True)
    if not raw.strip():
        return key, ""
    try:
        val = _load_bounded(raw, source)
    except (yaml.YAMLError, ValueError, TypeError, OverflowError):
        val = raw   # not YAML: the text itself (e.g. a name with a colon)
    return key, val


def apply_overrides(data: dict, overrides: list[str] | None, source: str = "--set") -> dict:
    """Return a deep copy of ``data`` with every ``a.b=value`` override applied."""
    try:
        out = copy.deepcopy(data)
    except RecursionError:
        raise LatsimError("the scenario is nested too deeply", source=source) from None
    for text in overrides or []:
        key, val = parse_override(text)
        _set_path(out, key, val, source)
    return out


_UNION_TAGS = {"str", "PolicyRun"}


def _format_validation(e: ValidationError, source: str, data: dict) -> LatsimError:
    errs = e.errors()
    # A union (``policies``: a name or a mapping) reports one error per branch; the
    # deepest one is about what the user wrote, not about the branch not taken.
    err = max(errs, key=lambda x: len(x["loc"])) if len(errs) > 1 else errs[0]
    loc = ".".join(str(p) for p in err["loc"] if p not in _UNION_TAGS)
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
        return Scenario.model_validate(data)
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
