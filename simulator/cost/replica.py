"""What one replica of a cost model needs: the memory rules of the built-in kinds, as
the two mixins their ``model.cost`` configs inherit (the ``CostModel`` interface,
``simulator.cost.model``).

- ``ShapeSized`` (``profile``, ``fitted``): the model is ``model.shape``; the GPU's
  memory is ``engine.kv.gpu_memory_gb``; KV blocks are (memory x utilisation - weights) /
  block bytes. The replica's GPUs are ``cluster.gpus_per_replica``.
- ``CatalogSized`` (``roofline``): the model is the catalogue's architecture on ``tp x
  pp`` of its GPU type; KV blocks are what ``catalog.plan_memory`` leaves after the
  weights, activations and overhead; the replica takes ``tp x pp`` GPUs (``tp x pp x
  dp`` with ``dp`` data-parallel attention ranks, each caching its own requests' KV).

Given ``engine.kv.num_blocks`` are refused when more than that room holds (with a
catalogue model, or with ``gpu_memory_gb`` given too): a cache the GPU cannot hold is
no what-if.
"""
from __future__ import annotations

from typing import ClassVar, Optional

from simulator.cost.model import ReplicaMemory
from simulator.errors import LatsimError


def _too_many(kv, room: int, where: str) -> int:
    """``kv.num_blocks`` if ``room`` holds them, else a one-line error."""
    if kv.num_blocks > room:
        raise LatsimError(f"more blocks than fit: {where} leaves room for {room} blocks of "
                          f"{kv.block_size} tokens after the weights",
                          field="engine.kv.num_blocks", value=kv.num_blocks, has_value=True)
    return kv.num_blocks


def _kv_tail(kv) -> str:
    return (f"{kv.allocation}, preemption {kv.preemption}, prefix caching "
            f"{'on' if kv.prefix_caching else 'off'}")


class ShapeSized:
    """Memory of a cost model measured on one machine: ``model.shape`` on
    ``engine.kv.gpu_memory_gb`` (see the module docstring)."""

    prices_verify: ClassVar[bool] = False
    hardware_fields: ClassVar[tuple] = ()
    measured: ClassVar[bool] = True
    describes_model: ClassVar[bool] = False

    @property
    def profile_path(self) -> Optional[str]:
        return getattr(self, "path", None)

    def gpus_per_replica(self) -> Optional[int]:
        return None

    def hardware(self) -> Optional[tuple]:
        return None

    def model_formats(self, arch) -> Optional[tuple]:
        return None

    def with_model(self, name: str):
        return self

    def kv_bytes_per_token(self, scenario, per_gpu: bool = False) -> float:
        # A shape has no parallelism: the whole token either way.
        return float(scenario.model.shape.kv_bytes_per_token)

    def memory(self, scenario) -> ReplicaMemory:
        bpt = self.kv_bytes_per_token(scenario)
        return ReplicaMemory(scenario.model.shape.weight_bytes, bpt, bpt,
                             scenario.cluster.gpus_per_replica, self.kv_capacity(scenario))

    def kv_capacity(self, scenario) -> int:
        kv = scenario.engine.kv
        shape = scenario.model.shape
        free = kv.gpu_memory_gb * 1e9 * kv.gpu_memory_utilization - shape.weight_bytes
        per_block = shape.kv_bytes_per_token * kv.block_size
        room = int(free // per_block)
        if kv.num_blocks is None or "gpu_memory_gb" in kv.model_fields_set:
            if room < 1:
                raise LatsimError("the model's weights leave no memory for the KV cache",
                                  field="engine.kv.gpu_memory_gb", value=kv.gpu_memory_gb,
                                  has_value=True)
        if kv.num_blocks is None:
            return room
        if "gpu_memory_gb" not in kv.model_fields_set:
            return kv.num_blocks       # blocks given alone: the engine's own count
        return _too_many(kv, room, f"engine.kv.gpu_memory_gb = {kv.gpu_memory_gb:g} GB")

    def fit_reason(self, scenario) -> Optional[str]:
        return None     # a shape that does not fit is the run's own one-line error

    def capacity_line(self, scenario, blocks: int) -> str:
        kv = scenario.engine.kv
        tokens = blocks * kv.block_size
        shape = scenario.model.shape
        bpt = shape.kv_bytes_per_token
        gb = tokens * bpt / 1e9
        src = ("engine.kv.num_blocks" if kv.num_blocks is not None else
               f"{kv.gpu_memory_gb:g} GB x {kv.gpu_memory_utilization:g} - "
               f"{shape.weight_bytes / 1e9:.1f} GB weights")
        return (f"KV cache per replica: {blocks:,} blocks x {kv.block_size} tokens = "
                f"{tokens:,} tokens, {gb:.1f} GB ({src}; "
                f"{bpt:,} B/token = 2 x {shape.n_layers} layers x {shape.n_kv_heads} kv heads x "
                f"{shape.head_dim} x {shape.dtype_bytes} B); {_kv_tail(kv)}")


class CatalogSized:
    """Memory of a cost model of a catalogued architecture on ``tp x pp`` GPUs of a
    catalogued type (fields ``model``, ``gpu``, ``tp``, ``pp``, ``weight_dtype``,
    ``kv_dtype``; see the module docstring)."""

    prices_verify: ClassVar[bool] = True
    hardware_fields: ClassVar[tuple] = ("gpu", "tp", "pp")
    measured: ClassVar[bool] = False
    describes_model: ClassVar[bool] = True

    @property
    def profile_path(self) -> Optional[str]:
        return None

    def gpus_per_replica(self) -> Optional[int]:
        return self.tp * self.pp * self._dp()

    def _dp(self) -> int:
        # Data-parallel attention ranks (``roofline``'s ``dp``; 1 for a config without).
        return int(getattr(self, "dp", 1))

    def hardware(self) -> Optional[tuple]:
        return self.gpu, int(self.tp)

    def model_formats(self, arch) -> Optional[tuple]:
        """``(KV bytes per element, bytes per weight)`` of the shape this config prices,
        after checking its TP x PP splits ``arch`` (a one-line error naming tp or pp)."""
        from simulator.cost import catalog
        catalog.check_parallelism(arch, self.tp, self.pp)
        return (catalog.dtype_bytes(self.kv_dtype),
                catalog.weight_format(self.weight_dtype).bytes_per_weight)

    def with_model(self, name: str):
        return self if self.model is not None else self.model_copy(update={"model": name})

    def _arch(self):
        # ``model`` was resolved when the scenario was read (an absolute config.json
        # path or a catalogue name): ``roofline.model_arch`` with no folders to try.
        from simulator.cost import catalog
        return catalog.model(self.model)

    def kv_bytes_per_token(self, scenario, per_gpu: bool = False) -> float:
        """The catalogued architecture's (``ModelArch.kv_bytes_per_token``, all layers and
        KV heads; ``per_gpu``: one GPU's slice, its pipeline stage's layers and its KV
        heads, replicated heads counted on every GPU)."""
        from simulator.cost import catalog
        arch = self._arch()
        if per_gpu:
            return float(catalog.kv_bytes_per_token_per_gpu(arch, self.tp, self.pp,
                                                            self.kv_dtype))
        return float(arch.kv_bytes_per_token(self.kv_dtype))

    def memory_plan(self, scenario, require_fit: bool = True):
        """``catalog.plan_memory`` of a replica: the model on tp x pp of the GPU, the
        weight and KV formats, and the engine's ``gpu_memory_utilization``,
        ``block_size``, ``max_num_batched_tokens``, ``max_num_seqs`` and
        ``max_model_len``. ``engine.kv.gpu_memory_gb`` cannot be given with it (the GPU
        says)."""
        from simulator.cost import catalog
        eng = scenario.engine
        kv = eng.kv
        spec = catalog.gpu(self.gpu)
        if "gpu_memory_gb" in kv.model_fields_set:
            raise LatsimError(f"with a roofline cost model the memory is the GPU's ({spec.name}: "
                              f"{spec.memory_bytes / 2**30:.1f} GiB); leave it out",
                              field="engine.kv.gpu_memory_gb", value=kv.gpu_memory_gb,
                              has_value=True)
        try:
            return catalog.plan_memory(
                self._arch(), spec, self.tp, self.pp, weight_dtype=self.weight_dtype,
                kv_dtype=self.kv_dtype, gpu_memory_utilization=kv.gpu_memory_utilization,
                block_size=kv.block_size, max_num_batched_tokens=eng.max_num_batched_tokens,
                max_num_seqs=eng.max_num_seqs, max_model_len=kv.max_model_len,
                require_fit=require_fit, dp=self._dp())
        except LatsimError as e:
            raise LatsimError(str(e), field="model.cost") from None

    def settle_gpus(self, cluster) -> None:
        """``cluster.gpus_per_replica``: tp x pp x dp (set when left out, a one-line error
        when it says otherwise)."""
        n = self.gpus_per_replica()
        if "gpus_per_replica" not in cluster.model_fields_set:
            cluster.gpus_per_replica = n
        elif cluster.gpus_per_replica != n:
            names, dims = "tp x pp", f"{self.tp} x {self.pp}"
            if self._dp() > 1:
                names, dims = names + " x dp", dims + f" x {self._dp()}"
            raise LatsimError(f"must equal model.cost {names} = {dims} = {n}",
                              field="cluster.gpus_per_replica",
                              value=cluster.gpus_per_replica, has_value=True)

    def _check_context(self, scenario) -> None:
        """``engine.kv.max_model_len`` may not exceed the model's own longest context
        (``max_position_embeddings``): a server refuses to start so (vLLM does, unless
        told its positions are scaled), and the model was never trained past it."""
        from simulator.cost import catalog
        kv = scenario.engine.kv
        if kv.max_model_len is not None:
            catalog.check_context(self._arch(), kv.max_model_len, "max_model_len of",
                                  field="engine.kv.max_model_len")

    def kv_capacity(self, scenario) -> int:
        """The plan's blocks (or the given ones, refused past them). Sets
        ``cluster.gpus_per_replica`` to tp x pp when left out (``settle_gpus``)."""
        kv = scenario.engine.kv
        self.settle_gpus(scenario.cluster)
        self._check_context(scenario)
        if kv.num_blocks is None:
            return self.memory_plan(scenario).kv_blocks
        # Given blocks must still fit on the GPU, after the weights and the reserve.
        plan = self.memory_plan(scenario, require_fit=False)
        if plan.kv_blocks < 1:
            raise LatsimError(plan.reason, field="model.cost")
        return _too_many(kv, plan.kv_blocks,
                         f"{plan.model} on {plan.gpu} (TP{plan.tp} PP{plan.pp})")

    def memory(self, scenario) -> ReplicaMemory:
        blocks = self.kv_capacity(scenario)
        plan = self.memory_plan(scenario, require_fit=False)
        return ReplicaMemory(plan.weight_bytes_per_gpu * plan.num_gpus,
                             self.kv_bytes_per_token(scenario),
                             self.kv_bytes_per_token(scenario, per_gpu=True),
                             self.gpus_per_replica(), blocks)

    def fit_reason(self, scenario) -> Optional[str]:
        if scenario.engine.kv.num_blocks is not None:
            return None
        plan = self.memory_plan(scenario, require_fit=False)
        return None if plan.fits else plan.reason

    def capacity_line(self, scenario, blocks: int) -> str:
        """The capacity with the memory plan's own arithmetic, per GPU and in GiB (the
        budget, less the most loaded stage's weights, the activation reserve and the
        fixed overhead, over one GPU's bytes per token); given blocks say so."""
        kv = scenario.engine.kv
        tokens = blocks * kv.block_size
        plan = self.memory_plan(scenario, require_fit=False)
        gib = 2.0 ** 30
        # Each GPU caches its DP rank's share of the tokens.
        per_gpu = tokens / plan.dp * plan.kv_bytes_per_token_per_gpu / gib
        head = (f"{tokens // kv.block_size:,} blocks x {kv.block_size} tokens = {tokens:,} "
                f"tokens, {per_gpu:.1f} GiB on each of {plan.num_gpus} GPU(s)")
        if kv.num_blocks is not None:
            src = f"{head} (engine.kv.num_blocks; the GPU has room for {plan.kv_tokens:,} tokens)"
        else:
            src = (f"{head} ({plan.gpu_memory_utilization:g} x {plan.gpu_bytes / gib:.1f} GiB "
                   f"{plan.gpu} = {plan.budget_bytes / gib:.1f} GiB - "
                   f"{plan.weight_bytes_per_gpu / gib:.1f} GiB weights - "
                   f"{plan.activation_bytes / gib:.1f} GiB activations - "
                   f"{plan.overhead_bytes / gib:.1f} GiB overhead per GPU; "
                   f"{plan.kv_bytes_per_token_per_gpu:,.0f} B/token per GPU, "
                   f"TP{plan.tp} PP{plan.pp}"
                   f"{f' DP{plan.dp}: {plan.dp} ranks, each its own requests' if plan.dp > 1 else ''})")
        return f"KV cache per replica: {src}; {_kv_tail(kv)}"
