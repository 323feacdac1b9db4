"""Hardware and model catalogues for the physics cost model and the capacity planner.

Lookup API:

* :func:`gpu` / :func:`gpu_names`: datasheet rates of an accelerator (:class:`GpuSpec`);
  :func:`gpu_in_text`: the catalogued GPU a free-text hardware description names.
* :func:`model` / :func:`model_names`: a transformer's shape (:class:`ModelArch`), by
  catalogue name, Hugging Face id, or the path of a ``config.json`` (or of the folder
  holding one).
* :func:`plan_memory`: weights, reserve and KV capacity per GPU of a TP x PP replica.

Names are case-insensitive; ``_`` and spaces count as ``-``. An unknown name raises a
one-line :class:`~simulator.errors.LatsimError` naming the closest known names.
"""
from __future__ import annotations

from simulator.cost.catalog.gpus import GPUS, GpuSpec
from simulator.cost.catalog.hf import arch_from_config, load_config
from simulator.cost.catalog.memory import (MemoryPlan, activation_bytes_per_gpu, check_context,
                                           check_parallelism,
                                           kv_bytes_per_token_per_gpu, kv_heads_per_gpu,
                                           kv_replication, plan_memory, weight_bytes_per_gpu,
                                           weight_bytes_per_stage)
from simulator.cost.catalog.models import (DTYPE_BYTES, WEIGHT_FORMATS, ModelArch,
                                           WeightFormat, dtype_bytes, weight_format)
from simulator.cost.catalog.modeltable import MODELS
from simulator.cost.catalog.lookup import gpu, gpu_in_text, gpu_names, model, model_names

__all__ = [
    "GpuSpec", "ModelArch", "WeightFormat", "MemoryPlan", "GPUS", "MODELS", "WEIGHT_FORMATS",
    "DTYPE_BYTES", "gpu", "gpu_in_text", "model", "gpu_names", "model_names", "dtype_bytes", "weight_format",
    "load_config", "arch_from_config", "plan_memory", "check_context", "check_parallelism", "kv_heads_per_gpu",
    "kv_replication", "weight_bytes_per_gpu", "weight_bytes_per_stage",
    "kv_bytes_per_token_per_gpu", "activation_bytes_per_gpu",
]
