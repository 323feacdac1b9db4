"""``engine``: the serving engine: batch limits, the scheduling policy (by name, with
its own parameters), KV-cache settings and speculative decoding."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import (Field, ValidationError, field_validator,
                      model_serializer, model_validator)

from simulator.errors import LatsimError
from simulator.model.kv.offload import PCIE4_X16_BPS
from simulator.model.policies.priority_aging import DEFAULT_AGING_S, MIN_AGING_S
from simulator.model.scheduling import check_policy_name, make_policy, policy_class
from simulator.config.strict import StrictModel
from simulator.wire.frontend import FrontendConfig


class OffloadConfig(StrictModel):
    """``engine.kv.offload``: a CPU-memory tier under the prefix cache (vLLM's offloading
    KV connector, ``--kv-offloading-size``; LMCache's CPU backend): computed prompt blocks
    are copied there (LRU), and a prefix found there and not on the GPU is loaded back
    over PCIe instead of recomputed (the rules: ``simulator.model.kv.offload``)."""

    cpu_gb: float = Field(ge=0, le=1e6, description="CPU memory for offloaded KV, per replica (all "
                          "its GPUs together, as vLLM's --kv-offloading-size); 0: a tier "
                          "that holds nothing")
    pcie_gb_per_s: float = Field(PCIE4_X16_BPS / 1e9, gt=0, description="host-to-device "
                                 "copy rate of one "
                                 "GPU's link (PCIe 4.0 x16 ~25, 5.0 x16 ~50 effective)")
    load: Literal["sync", "async"] = Field(
        "sync", description="sync: the admitting step waits for the copy (LMCache's "
        "default); async: the request waits, the others run (vLLM's OffloadingConnector)")


class KVConfig(StrictModel):
    """KV cache: capacity from GPU memory (or an explicit block count), allocation,
    preemption under memory pressure, and prefix caching (see ``simulator.model.kv.space``)."""

    block_size: int = Field(16, ge=1, le=4096, description="token slots per KV block")
    num_blocks: Optional[int] = Field(None, ge=1, description="overrides the memory-derived count")
    gpu_memory_gb: float = Field(80.0, gt=0, description="one GPU's memory (profile and "
                                 "fitted cost models; a roofline's GPU says its own)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="share of the GPU's "
                                          "memory for weights, activations and KV")
    allocation: Literal["paged", "contiguous"] = Field(
        "paged", description="paged: blocks on demand; contiguous: reserve max length up front")
    max_model_len: Optional[int] = Field(None, ge=1, description="longest request (prompt + "
                                         "output); contiguous reserves this much per request")
    watermark: float = Field(0.0, ge=0, lt=1, description="fraction of blocks kept free "
                             "at admission")
    preemption: Literal["recompute", "swap"] = Field(
        "recompute", description="a preempted request's KV: dropped and prefilled again, or "
        "copied to CPU memory and back")
    victim: Literal["priority", "latest"] = Field(
        "priority", description="whom to preempt: lowest class then latest arrival, or latest")
    swap_space_gb: float = Field(4.0, ge=0, description="CPU memory for swapped-out KV")
    swap_gb_per_s: float = Field(25.0, gt=0, description="GPU<->CPU copy bandwidth (PCIe)")
    prefix_caching: bool = Field(False, description="reuse cached blocks of a shared "
                                 "prompt prefix (block hashes, LRU of unreferenced blocks)")
    offload: Optional[OffloadConfig] = Field(None, description="a CPU tier under the "
                                             "prefix cache (turns prefix_caching on)")

    @model_validator(mode="after")
    def _coherent(self):
        if self.offload is not None:
            # The CPU tier holds prefix-cached blocks: offload turns prefix caching on
            # (vLLM's offloading connector works under its prefix cache).
            if "prefix_caching" in self.model_fields_set and not self.prefix_caching:
                raise ValueError("offload needs prefix_caching: true (the CPU tier holds "
                                 "prefix-cached blocks)")
            self.prefix_caching = True
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


class SpeculativeConfig(StrictModel):
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
                # The scenario's error quotes the value itself: drop the catalog's quote.
                msg = str(e).removeprefix("field 'model': ").rsplit(" (got ", 1)[0]
                raise ValueError(msg) from None
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


class EngineConfig(StrictModel):
    """One replica's engine: scheduling policy and its limits. ``policy`` is a
    registered policy's name, or ``{kind: name, ...its parameters}``. ``preset: vllm``
    fills vLLM's defaults first (``config.presets``, applied when the scenario is read:
    they depend on the GPU), ``async_scheduling`` and ``frontend`` model vLLM v1's
    engine-core loop and API server."""

    policy: str = Field("chunked", description="a registered policy's name (latsim "
                        "policies), or {kind: name, ...its parameters}")
    policy_params: dict[str, Any] = Field(default_factory=dict,
                                          description="the policy's own parameters")
    max_num_seqs: int = Field(256, ge=1, le=1_000_000,
                              description="requests running at once (batch slots)")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget per step")
    chunk_size: Optional[int] = Field(None, ge=1, description="max prefill chunk (default: "
                                      "budget), for policies that chunk")
    aging_s: float = Field(DEFAULT_AGING_S, ge=MIN_AGING_S, description="priority_aging: one class per aging_s "
                           "waited (its default)")
    kv: KVConfig = Field(default_factory=KVConfig)
    speculative: Optional[SpeculativeConfig] = Field(None, description="speculative "
                                                     "decoding what-if (None: off)")
    preset: Optional[Literal["vllm"]] = Field(None, description="fill the engine's "
                                              "defaults from a serving engine's "
                                              "(config.presets); explicit keys win")
    async_scheduling: bool = Field(False, description="plan step N+1 while step N runs "
                                   "(vLLM v1; model.scheduling.asyncsched)")
    frontend: Optional[FrontendConfig] = Field(None, description="the API server's costs "
                                               "(wire.frontend; None: none)")

    _spec = model_validator(mode="before")(classmethod(lambda cls, v: _policy_spec(v)))
    _policy = field_validator("policy")(classmethod(lambda cls, v: check_policy_name(v)))

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        # Off, it is not written (a scenario without it echoes as it did before).
        d = handler(self)
        # With a preset every other key is kept, so that the echo reads back the same
        # (an explicit ``async_scheduling: false`` would otherwise take the preset's).
        if isinstance(d, dict):
            keys = (("speculative", None),) if self.preset is not None else \
                (("speculative", None), ("preset", None), ("frontend", None),
                 ("async_scheduling", False))
            for key, off in keys:
                if getattr(self, key) == off:
                    d.pop(key, None)
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
