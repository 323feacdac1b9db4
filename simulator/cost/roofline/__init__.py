"""The roofline step-cost model: any GPU, any model, TP x PP, without a profile of your own.

It is the physics model of ``simulator.cost.physics`` (the same ``step_ms`` kernel a
fitted profile uses) whose constants come from the catalogues instead of a fit:

- the model's shape from ``catalog.model`` (a catalogue name or a Hugging Face
  ``config.json``): layers, widths, heads, FFN, vocabulary, linear weights per token
  (a mixture of experts: the routed experts for FLOPs; for the bytes a step reads,
  the experts its tokens are routed to, ``physics.routed_experts``: about top-k at
  batch 1, nearly every expert at a few dozen tokens);
- the GPU's datasheet peaks from ``catalog.gpu``: dense TFLOP/s of the compute type
  (fp8 weights run fp8 GEMMs where the GPU has fp8, int8 weights int8 GEMMs; int4 and
  fp8-on-Ampere are weight-only: 16-bit GEMMs on narrower weights), HBM GB/s, SMs and
  the GPU-to-GPU link (one direction);
- TP x PP from the configuration (``physics``' parallelism terms: each GPU's share
  of FLOPs, weights, heads and KV, two ring all-reduces per layer, sends between
  pipeline stages, no micro-batching);
- default efficiencies (fractions of those datasheet peaks) and engine overheads,
  calibrated once on measured data shipped in ``data/`` and two published kernel
  benchmarks.

The engine it describes by default is one like vLLM: paged decode attention (cost
follows the sum of the contexts), pure-decode steps replayed from CUDA graphs
captured at batch 1, 2, 4, 8, 16, ..., 256, every step holding a prefill chunk run
eagerly (its host launches can bind when the step is small), one batch in flight.

Every number it prints is labelled an estimate from datasheets (``model.ESTIMATE``).
``calibrate: PROFILE`` turns it into a transfer from a measurement: the
engine-specific terms (an overhead scale, a compute-efficiency scale, and with more
rows a memory or attention scale) are fitted to the profile's rows on the profile's
own configuration (``meta.model``, ``meta.gpu`` or ``meta.hardware``, ``meta.tp``;
the target's where the profile does not say) and carried to the target, the physics
doing the rest (``transfer.calibrate``).

The modules:

- ``defaults``: the default efficiencies and overheads (``DEFAULTS``) and where each
  comes from;
- ``constants``: the physics constants vector of a model on a GPU type, TP x PP and
  an engine (``build_constants``);
- ``derive``: recomputing ``DEFAULTS`` from the data (``calibrate_defaults``), and
  how they predict the tables they were and were not fitted to;
- ``transfer``: calibration to a measured profile, from two rows up;
- ``model``: ``RooflineCostModel`` (``FittedCostModel`` with another constants
  vector, so every event loop treats the two alike), ``RooflineCostConfig``
  (``model.cost`` of ``kind: roofline``) and ``build_roofline``, its registry factory;
- ``expert``: expert parallelism's named step terms (all-to-all, replaced all-reduce,
  imbalance); ``dataparallel``: data-parallel attention ranks (the slowest rank's share
  and constants); ``epsteps``: ``ExpertSteps``, the step times they give;
- ``checks``: every prediction against measurements, as tables
  (``benchmarks/hardware_whatif.py``, ``notebooks/hardware_whatif.py``).

``model_arch`` is re-exported here for callers that import it from the package.
"""
from __future__ import annotations

from simulator.cost.roofline.model import model_arch

__all__ = ["model_arch"]
