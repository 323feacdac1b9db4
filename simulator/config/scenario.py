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
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from simulator.config.plugins import load_plugins  # (importing registers the built-ins)
from simulator.config.wire import NetworkConfig, StreamConfig  # noqa: F401  (part of the tree)
from simulator.errors import LatsimError
from simulator.config.pluginfield import plugin
from simulator.config.registry import COST_MODELS, ROUTERS, WORKLOADS
from simulator.model.scheduling import check_policy_name, make_policy, policy_class
from simulator.workload.classes import SLO


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClusterConfig(_Strict):
    """Replicas of the engine behind a router."""

    replicas: int = Field(1, ge=1)
    router: str = "round_robin"
    gpus_per_replica: int = Field(1, ge=1)

    @field_validator("router")
    @classmethod
    def _router(cls, v: str) -> str:
        if v not in ROUTERS.names():
            raise ValueError(f"unknown router {v!r}; known: {', '.join(ROUTERS.names())}")
        return v


class KVConfig(_Strict):
    """KV cache: capacity from GPU memory (or an explicit block count), allocation,
    preemption under memory pressure, and prefix caching (see ``kvspace``)."""

    block_size: int = Field(16, ge=1)
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


class EngineConfig(_Strict):
    """One replica's engine: scheduling policy and its limits. ``policy`` is a
    registered policy's name, or ``{kind: name, ...its parameters}``."""

    policy: str = "chunked"
    policy_params: dict[str, Any] = Field(default_factory=dict,
                                          description="the policy's own parameters")
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget per step")
    chunk_size: Optional[int] = Field(None, ge=1, description="max prefill chunk (default: "
                                      "budget), for policies that chunk")
    aging_s: float = Field(30.0, gt=0, description="priority_aging: one class per aging_s "
                           "waited (its default)")
    kv: KVConfig = Field(default_factory=KVConfig)

    _spec = model_validator(mode="before")(classmethod(lambda cls, v: _policy_spec(v)))
    _policy = field_validator("policy")(classmethod(lambda cls, v: check_policy_name(v)))

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
    """The served model's shape: what sets weight and KV memory."""

    name: str = "llama3-8b"
    n_layers: int = Field(32, ge=1)
    d_model: int = Field(4096, ge=1)
    n_heads: int = Field(32, ge=1)
    n_kv_heads: int = Field(8, ge=1)
    head_dim: int = Field(128, ge=1)
    params_b: float = Field(8.03, gt=0, description="parameters, billions")
    dtype_bytes: int = Field(2, ge=1)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.dtype_bytes


class ModelConfig(_Strict):
    """The model and how its step cost is obtained."""

    shape: ModelShape = Field(default_factory=ModelShape)
    cost: plugin(COST_MODELS) = Field(default_factory=lambda: COST_MODELS.validate(
        {"kind": "profile", "path": "profiles/h200-llama3-8b-refbench.json"}))


class Scenario(_Strict):
    """A whole scenario; see module docstring."""

    name: str = "scenario"
    seed: int = 0
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
                data = self.engine.model_dump()
                if p.policy != self.engine.policy:
                    data["policy_params"] = {}
                data.update(p.model_dump(exclude={"label", "kv"}, exclude_none=True))
                if p.kv:
                    data["kv"] = {**data["kv"], **p.kv}
                eng = EngineConfig.model_validate(data)
                label = p.name
            runs.append((label, self.model_copy(update={"engine": eng})))
        return runs


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

    _spec = model_validator(mode="before")(classmethod(lambda cls, v: _policy_spec(v)))
    _known = field_validator("policy")(classmethod(lambda cls, v: check_policy_name(v)))

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


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` -> ``("a.b", parsed value)``; the value is read as YAML."""
    if "=" not in text:
        raise LatsimError("override must look like a.b=value", source="--set", value=text,
                          has_value=True)
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise LatsimError("override key is empty", source="--set", value=text, has_value=True)
    try:
        val = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        val = raw
    return key, val


def apply_overrides(data: dict, overrides: list[str] | None, source: str = "--set") -> dict:
    """Return a deep copy of ``data`` with every ``a.b=value`` override applied."""
    out = copy.deepcopy(data)
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
        return LatsimError(f"{err['ctx']['msg']}", source=source, field=f"{loc}.{inner}",
                           value=err["ctx"]["value"], has_value=True)
    if err["type"] == "extra_forbidden":
        return LatsimError("unknown key", source=source, field=loc,
                           value=err.get("input"), has_value=True)
    if err["type"] == "missing":
        return LatsimError("required field is missing", source=source, field=loc)
    return LatsimError(msg, source=source, field=loc, value=err.get("input"), has_value=True)


def validate_scenario(data: Any, source: str = "<scenario>",
                      base_dir: Optional[Path] = None) -> Scenario:
    """Validate a mapping into a ``Scenario``, or raise a one-line ``LatsimError``. Its
    ``plugins`` are imported first (``.py`` files relative to ``base_dir``)."""
    if not isinstance(data, dict):
        raise LatsimError("a scenario must be a YAML mapping", source=source,
                          value=type(data).__name__, has_value=True)
    load_plugins(data.get("plugins"), base_dir, source)
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise _format_validation(e, source, data) from None


def read_yaml(path: str | Path) -> dict:
    """Read a YAML file into a mapping, with one-line errors."""
    p = Path(path)
    if not p.exists():
        raise LatsimError("file not found", source=str(p))
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise LatsimError(f"invalid YAML{where}: {problem}", source=str(p)) from None
    if data is None:
        raise LatsimError("file is empty", source=str(p))
    return data


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> tuple[Scenario, Path]:
    """Load, override and validate a scenario file; returns it and its directory."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise LatsimError("a scenario must be a YAML mapping", source=str(path))
    data = apply_overrides(data, overrides, source=str(path))
    base = Path(path).resolve().parent
    return validate_scenario(data, source=str(path), base_dir=base), base
