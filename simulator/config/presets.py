"""``engine: {preset: vllm}``: a serving engine's defaults, as that engine sets them.

The ``vllm`` preset follows vLLM's **v0.15** series (``vllm serve``, the v1 engine), as
its source states them (vllm-project/vllm, files read at commits 01230b40 and 00080ee1;
the constants below did not change across the v0.1x series):

- token budget and batch limit, ``EngineArgs.get_batch_defaults``
  (``vllm/engine/arg_utils.py``) for the OpenAI API server: a GPU with at least 70 GiB
  that is not an A100 (H100, H200, MI300X, B200) gets ``max_num_batched_tokens`` 8192
  and ``max_num_seqs`` 1024, any other (A100, L40S, ...) 2048 and 256;
- chunked prefill on (``SchedulerConfig.enable_chunked_prefill = True``,
  ``vllm/config/scheduler.py``), running requests first, then waiting ones in arrival
  order (``policy: fcfs``) chunked to the budget left (``long_prefill_token_threshold``
  0: no cap below the budget): latsim's ``chunked`` policy;
- prefix caching on (``CacheConfig.enable_prefix_caching``, default on in v1), block
  size 16, ``gpu_memory_utilization`` 0.9, preemption by recompute;
- async scheduling on (``async_scheduling: None`` resolves to True in
  ``vllm/config/vllm.py`` unless pipeline parallelism, pooling or an unsupported
  speculative method): ``model.scheduling.asyncsched``;
- the API server in front of the engine core (``wire.frontend``);
- CUDA graphs for decode steps (``-O2``'s ``FULL_AND_PIECEWISE``), captured at
  ``[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)`` with
  ``max = min(2 x max_num_seqs, 512)`` (``vllm/config/vllm.py``,
  ``_set_cudagraph_sizes``); a decode batch runs at the next captured size. The
  roofline prices decode graphs at its own buckets
  (``cost.roofline.constants.VLLM_GRAPH_BUCKETS``: up to 256, the constants vector holds
  at most 40), so a decode batch of 257..512 is priced eagerly there: not yet this list.
  Other steps (prefill, mixed) replay *piecewise* graphs (``cudagraph_mode``
  ``FULL_AND_PIECEWISE``, the default ``CompilationConfig`` of ``-O2``; docs.vllm.ai
  design/cuda_graphs): the preset sets the roofline's ``model.cost.piecewise_graphs``
  (``cost.roofline.constants.piecewise_host_ms``) unless the scenario states it.

The GPU is the roofline's ``model.cost.gpu`` (its catalogue memory); with another cost
model, ``engine.kv.gpu_memory_gb`` (80 if not given) decides, and no name (so not an A100).
A preset fills defaults only: any key the scenario states itself wins (``--set`` too).
For SGLang, state what differs: ``async_scheduling: false`` is closest to its
overlap scheduler being off (SGLang's ``--enable-overlap-schedule`` is on by default,
which behaves like async scheduling here: keep it true), ``max_num_batched_tokens``
to its ``--chunked-prefill-size`` (8192 on H100-class GPUs, 2048 below), ``max_num_seqs``
to its ``--max-running-requests``, ``kv.block_size: 1`` (its radix cache pages by token)
and ``kv.gpu_memory_utilization`` to its ``--mem-fraction-static``.
"""
from __future__ import annotations

from typing import Any

VLLM_VERSION = "0.15"
GIB = 2**30


def vllm_batch_defaults(gpu_name: str, gpu_memory_bytes: float) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` vLLM's API server picks on this GPU
    (``EngineArgs.get_batch_defaults``: >= 70 GiB and not an A100: 8192 and 1024)."""
    if gpu_memory_bytes >= 70 * GIB and "a100" not in gpu_name.lower():
        return 8192, 1024
    return 2048, 256


def _gpu_of(data: dict) -> tuple[str, float]:
    """The GPU the scenario runs on: the roofline's ``model.cost.gpu`` (its catalogue
    memory), else ``engine.kv.gpu_memory_gb`` (80 if not given) with no name."""
    cost = (data.get("model") or {}).get("cost") if isinstance(data.get("model"), dict) else None
    if isinstance(cost, dict) and cost.get("kind") == "roofline" and isinstance(cost.get("gpu"), str):
        from simulator.cost import catalog
        from simulator.errors import LatsimError
        try:
            spec = catalog.gpu(cost["gpu"])
        except LatsimError:
            return cost["gpu"], 80e9   # the model section's own check names the bad GPU
        return spec.name, float(spec.memory_bytes)
    kv = (data.get("engine") or {}).get("kv") or {}
    gb = kv.get("gpu_memory_gb", 80.0) if isinstance(kv, dict) else 80.0
    return "", float(gb) * 1e9 if isinstance(gb, (int, float)) else 80e9


def vllm_defaults(gpu_name: str, gpu_memory_bytes: float) -> dict:
    """The ``engine`` keys the ``vllm`` preset fills (module doc)."""
    budget, seqs = vllm_batch_defaults(gpu_name, gpu_memory_bytes)
    return {
        "policy": "chunked",
        "max_num_batched_tokens": budget,
        "max_num_seqs": seqs,
        "async_scheduling": True,
        "frontend": {},
        "kv": {"block_size": 16, "gpu_memory_utilization": 0.9, "allocation": "paged",
               "preemption": "recompute", "prefix_caching": True},
    }


def _under(defaults: dict, given: dict) -> dict:
    """``given`` over ``defaults``, mappings merged key by key (``given`` wins)."""
    out = dict(defaults)
    for k, v in given.items():
        out[k] = _under(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_presets(data: Any) -> Any:
    """The scenario mapping with ``engine.preset``'s defaults filled in under the keys
    it states (unchanged if it names no preset, or is not a mapping)."""
    if not isinstance(data, dict) or not isinstance(data.get("engine"), dict):
        return data
    eng = data["engine"]
    if eng.get("preset") != "vllm":
        return data   # None, or a bad name the engine section's own check refuses
    name, mem = _gpu_of(data)
    out = {**data, "engine": _under(vllm_defaults(name, mem), eng)}
    model = data.get("model")
    cost = model.get("cost") if isinstance(model, dict) else None
    if isinstance(cost, dict) and cost.get("kind") == "roofline":
        # The roofline prices vLLM v1's CUDA graphs: FULL_AND_PIECEWISE (module doc).
        out["model"] = {**model, "cost": {"piecewise_graphs": True, **cost}}
    return out
