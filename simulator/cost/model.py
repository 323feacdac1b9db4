"""The cost-model interface: what every ``model.cost`` kind declares, and what its built
model answers each step. Everything outside ``simulator.cost`` asks a cost model through
these two protocols, never by its ``kind``.

``CostModel`` is a kind's ``model.cost`` config (a pydantic model registered in
``COST_MODELS``), the part known before a run:

- ``gpus_per_replica()``: the GPUs one replica takes (``tp x pp`` of a roofline), or None
  where the kind does not say (``cluster.gpus_per_replica`` does);
- ``memory(scenario)``: a ``ReplicaMemory``, the bytes one replica needs: its weights
  and its KV cache per token (the whole replica's and one GPU's slice), and the KV
  blocks it holds (``kv_capacity``, with a one-line error when the model does not fit);
- ``capacity_line(scenario, blocks)``: the printed sentence on where that capacity comes from;
- ``fit_reason(scenario)``: why the model cannot be held at all (a planner skips such a
  point), or None;
- ``hardware()``: the (GPU type, TP) the config prices, or None (a measured profile's
  hardware is the one it was measured on);
- ``describes_model`` / ``model_formats(arch)`` / ``with_model(name)`` / ``profile_path``:
  how it agrees with ``model.name`` and ``model.shape`` (``config.model``);
- class facts: ``prices_verify`` (it prices a speculative verify step),
  ``hardware_fields`` (fields naming the hardware, which a plan's GPU axes may set; empty
  for a kind measured on one machine), ``measured`` (it reads a measured profile).

``StepCost`` is the built model (``COST_MODELS.build``) a loop calls. Contracts, checked
for every registered kind by ``tests/test_costmodel_contract.py``:

- ``step_time(n_decode, ctx_max, ctx_sum, chunks)`` is a positive number of seconds
  and never decreases when work is added (more decodes, longer contexts, longer
  chunks, more chunks), unless the class says why not in ``not_monotone`` (a table of
  measured rows follows their noise);
- ``decode_times(batch, ctx0, k)`` is ``k`` calls of ``step_time`` on a growing context;
- ``min_step_s`` bounds every step from below;
- ``compiled_reason()``: None when the compiled loop can run it (its kernels price the
  same step), else the one-line reason (``loops.compiled.kernel_reason`` reports it);
  ``compiled_kernels`` names those kernels (``"table"``: ``cost.table``'s, ``"physics"``:
  ``cost.physics``' with the model's constants ``stepping_constants()``), None for none.

Two mixins hold the memory rules of the built-in kinds: ``cost.replica.ShapeSized``
(``profile``, ``fitted``: ``model.shape`` on ``engine.kv.gpu_memory_gb``) and
``cost.replica.CatalogSized`` (``roofline``: the catalogue's architecture on its GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Protocol, Sequence, runtime_checkable

from simulator.config.registry import COST_MODELS

__all__ = ["CostModel", "ReplicaMemory", "StepCost", "compiled_reason", "cost_class", "kind_fact",
           "missing_methods"]


@dataclass(frozen=True)
class ReplicaMemory:
    """What one replica of a cost model needs in memory, in bytes."""

    weight_bytes: float               # all the weights (summed over the replica's GPUs)
    kv_bytes_per_token: float         # one cached token, the whole replica
    kv_bytes_per_token_per_gpu: float  # one GPU's slice of it (== the whole on one GPU)
    gpus: int                         # GPUs the replica takes
    kv_blocks: int                    # KV blocks it holds (what the run gets)


@runtime_checkable
class CostModel(Protocol):
    """A ``model.cost`` kind (see the module docstring for each method's contract)."""

    kind: str
    prices_verify: ClassVar[bool]
    hardware_fields: ClassVar[tuple]
    measured: ClassVar[bool]
    describes_model: ClassVar[bool]

    def gpus_per_replica(self) -> Optional[int]: ...

    def memory(self, scenario: Any) -> ReplicaMemory: ...

    def kv_capacity(self, scenario: Any) -> int: ...

    def kv_bytes_per_token(self, scenario: Any, per_gpu: bool = False) -> float: ...

    def capacity_line(self, scenario: Any, blocks: int) -> str: ...

    def fit_reason(self, scenario: Any) -> Optional[str]: ...

    def hardware(self) -> Optional[tuple]: ...

    def model_formats(self, arch: Any) -> Optional[tuple]: ...

    def with_model(self, name: str) -> Any: ...

    @property
    def profile_path(self) -> Optional[str]: ...


@runtime_checkable
class StepCost(Protocol):
    """A built cost model, as the loops call it (contracts in the module docstring)."""

    padded: bool
    not_monotone: ClassVar[Optional[str]]
    compiled_kernels: ClassVar[Optional[str]]

    def step_time(self, n_decode: int, decode_ctx_max: int, decode_ctx_sum: int,
                  chunks: Sequence[tuple]) -> float: ...

    def decode_times(self, batch: int, ctx0: float, k: int) -> list: ...

    @property
    def min_step_s(self) -> float: ...

    def compiled_reason(self) -> Optional[str]: ...


_CONFIG_METHODS = ("gpus_per_replica", "memory", "kv_capacity", "kv_bytes_per_token",
                   "capacity_line", "fit_reason", "hardware", "model_formats", "with_model")
_CONFIG_FACTS = ("prices_verify", "hardware_fields", "measured", "describes_model",
                 "profile_path")


def missing_methods(config_cls: type) -> list[str]:
    """The ``CostModel`` members a config class lacks (a registered kind must have all:
    ``COST_MODELS`` refuses one without them, naming them)."""
    return [m for m in _CONFIG_METHODS + _CONFIG_FACTS if not hasattr(config_cls, m)]


COST_MODELS.check = missing_methods


def cost_class(kind: str) -> type:
    """The config class of a registered kind (its class facts answer questions about
    a ``model.cost`` mapping before it is validated, e.g. in a planner's search)."""
    return COST_MODELS.config_class(kind)


def kind_fact(kind, fact: str, default):
    """A class fact (``hardware_fields``, ``measured``, ``prices_verify``...) of the kind
    named ``kind`` in a ``model.cost`` mapping; ``default`` for a kind not registered."""
    try:
        return getattr(cost_class(kind), fact)
    except (KeyError, TypeError):
        return default


def compiled_reason(cost) -> Optional[str]:
    """None when the compiled loop can run the built model ``cost``, else why not: its own
    ``compiled_reason()``; a model without one (a user's plug-in) is named."""
    ask = getattr(type(cost), "compiled_reason", None)
    if ask is None:
        return f"cost model {type(cost).__name__}"
    return ask(cost)
