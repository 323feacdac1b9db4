"""The roofline cost model: ``RooflineCostModel``, its ``model.cost`` config
(``kind: roofline``) and registry factory (``build_roofline``).

``RooflineCostModel`` is ``FittedCostModel`` with another constants vector (the
catalogues' and ``DEFAULTS``', ``constants.build_constants``), optionally calibrated
to a profile (``transfer.calibrate``), so every event loop treats the two alike. Every
number it prints is labelled an estimate from datasheets (``ESTIMATE``).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Literal, Optional, Sequence

from pydantic import Field, ValidationInfo, field_validator

from simulator.config.strict import StrictModel

from simulator.cost import catalog
from simulator.cost import physics as ph
from simulator.cost.catalog import GpuSpec, ModelArch
from simulator.cost.chunks import ChunkArrays
from simulator.cost.counts import new_counts
from simulator.cost.fitted import FittedCostModel
from simulator.cost.replica import CatalogSized
from simulator.cost.roofline.constants import (VLLM_GRAPH_BUCKETS, Engine, build_constants,
                                               compute_peak)
from simulator.cost.roofline.dataparallel import rank_constants, rank_share
from simulator.cost.roofline.epsteps import ExpertSteps
from simulator.cost.roofline.expert import ExpertParallel
from simulator.cost.roofline.transfer import (Calibration, apply_scales, calibrate,
                                              profile_engine)
from simulator.errors import LatsimError

ESTIMATE = ("estimate from datasheets: roofline physics with default efficiencies, "
            "not measured on this hardware")
ESTIMATE_CALIBRATED = ("estimate from datasheets, calibrated to {n} measured row(s) of "
                       "{src}: {terms} fitted, the physics carries the rest")


class RooflineCostConfig(CatalogSized, StrictModel):
    """``model.cost`` of ``kind: roofline``: the physics model from datasheets for a GPU
    type, TP x PP and weight/KV formats; the model is the scenario's ``model.name``
    (copied here when the scenario is read). ``calibrate``: a profile whose rows fit the
    engine-specific terms (``roofline.calibrate``)."""

    kind: Literal["roofline"] = "roofline"
    gpu: str = Field(..., description="a catalogued GPU (latsim cost --help lists them)")
    tp: int = Field(1, ge=1, description="tensor-parallel GPUs per replica")
    pp: int = Field(1, ge=1, description="pipeline stages per replica (no micro-batching)")
    weight_dtype: Literal["bf16", "fp16", "fp8", "int8", "int4"] = "bf16"
    kv_dtype: Literal["bf16", "fp16", "fp8"] = "bf16"
    calibrate: Optional[str] = Field(None, description="profile to calibrate to (a full one "
                                     "or as few as one prefill and one decode row)")
    model: Optional[str] = Field(None, description="catalogue name or config.json path "
                                 "(default: the scenario's model.name)")
    cuda_graphs: bool = Field(True, description="pure-decode steps replay CUDA graphs")
    piecewise_graphs: bool = Field(False, description="prefill and mixed steps replay "
                                   "piecewise graphs (vLLM v1's FULL_AND_PIECEWISE)")
    decode_attention: Literal["paged", "padded"] = "paged"
    scale: float = Field(1.0, gt=0, description="multiply every step time (what-if)")
    dp: int = Field(1, ge=1, description="data-parallel attention ranks of a mixture "
                    "(vLLM's --data-parallel-size): each rank runs attention on its own "
                    "requests and caches their KV, the experts spread over ep = tp x dp GPUs; "
                    "the replica takes tp x pp x dp GPUs (roofline.dataparallel)")
    ep: int = Field(1, ge=1, description="expert-parallel GPUs of a mixture's MoE layers: 1 "
                    "(experts TP-sharded) or tp x dp (vLLM's --enable-expert-parallel, "
                    "EP = TP x DP; roofline.expert)")
    expert_imbalance: Optional[float] = Field(None, ge=1.0, description="with ep > 1: the "
                                              "busiest GPU's routed tokens over the mean "
                                              "(default: uniform routing's expectation)")

    @field_validator("ep")
    @classmethod
    def _ep(cls, v: int, info: ValidationInfo) -> int:
        why = ep_group_error(info.data.get("tp", 1), info.data.get("dp", 1), v)
        if why:
            raise ValueError(why)
        return v

    def model_formats(self, arch) -> Optional[tuple]:
        """``CatalogSized.model_formats``, after refusing ``ep > 1`` / ``dp > 1`` where
        they cannot run (``check_expert_parallel``)."""
        check_expert_parallel(arch, self.tp, self.pp, self.dp, self.ep)
        return super().model_formats(arch)

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: str) -> str:
        try:
            return catalog.gpu(v).name
        except LatsimError as e:
            # The field and the value are named again by the validation error.
            msg = re.sub(r" \(got .*\)$", "", re.sub(r"^field '[^']*': ", "", str(e)))
            raise ValueError(msg) from None

    def engine(self) -> Engine:
        """The engine facts this config states."""
        return Engine(decode_attention=self.decode_attention, cuda_graphs=self.cuda_graphs,
                      graph_buckets=VLLM_GRAPH_BUCKETS if self.cuda_graphs else (),
                      piecewise_graphs=self.piecewise_graphs and self.cuda_graphs)


_CALIBRATIONS: dict = {}


def _calibration(profile: dict, source: str, key: tuple, **kw) -> Calibration:
    """``calibrate`` cached by the profile's content and the target (a sweep builds many
    cost models from one config)."""
    h = hashlib.sha256(json.dumps(profile, sort_keys=True, default=str).encode()).hexdigest()
    k = (h, source, key)
    if k not in _CALIBRATIONS:
        _CALIBRATIONS[k] = calibrate(profile, source, **kw)
    return _CALIBRATIONS[k]


def ep_group_error(tp: int, dp: int, ep: int) -> Optional[str]:
    """Why ``ep`` cannot be the expert-parallel group of ``tp`` GPUs x ``dp`` ranks, or
    None: vLLM's --enable-expert-parallel runs EP = TP x DP over the same GPUs, and DP
    attention is modelled with it only (TP-sharded experts over tp x dp GPUs are not)."""
    if dp > 1 and ep != tp * dp:
        return f"must be tp x dp = {tp * dp} with dp {dp} (vLLM: EP = TP x DP)"
    if ep > 1 and ep != tp * dp:
        return f"must be 1 or tp x dp = {tp * dp} (vLLM: EP = TP x DP)"
    return None


def check_expert_parallel(arch: ModelArch, tp: int, pp: int, dp: int, ep: int,
                          prefix: str = "") -> None:
    """Refuse EP / DP attention where it cannot run or is not modelled, one line naming
    ``{prefix}ep`` or ``{prefix}dp``: a dense model (its DP ranks would be independent
    replicas: ``cluster.replicas``), more GPUs than experts or experts that do not split
    evenly, an EP group wider than one server (its all-to-all would cross the network,
    not priced), DP with pipeline stages (not modelled)."""
    if dp > 1 and not arch.is_moe:
        raise LatsimError(f"{arch.name} is dense: its data-parallel ranks are independent "
                          "replicas (set cluster.replicas)", field=f"{prefix}dp", value=dp,
                          has_value=True)
    if ep > 1 and not arch.is_moe:
        raise LatsimError(f"{arch.name} is dense: expert parallelism needs a mixture of "
                          "experts", field=f"{prefix}ep", value=ep, has_value=True)
    if ep > 1 and arch.experts % ep:
        raise LatsimError(f"{arch.name}'s {arch.experts} experts do not split evenly over "
                          f"{ep} GPUs", field=f"{prefix}ep", value=ep, has_value=True)
    if dp > 1 and ep > catalog.memory.GPUS_PER_SERVER:
        raise LatsimError(f"an EP group spans at most one server's "
                          f"{catalog.memory.GPUS_PER_SERVER} GPUs here (tp x dp = {ep}; beyond, "
                          "its all-to-all crosses the network, which latsim does not price)",
                          field=f"{prefix}dp", value=dp, has_value=True)
    if dp > 1 and pp > 1:
        raise LatsimError("data-parallel attention with pipeline stages is not modelled "
                          "(set pp 1)", field=f"{prefix}dp", value=dp, has_value=True)


class RooflineCostModel(ExpertSteps, FittedCostModel):
    """``FittedCostModel`` whose constants come from the catalogues and ``DEFAULTS``
    (``build_constants``), optionally calibrated to a profile: every event loop calls
    it exactly as a fitted model. ``profile`` is the calibration profile (or None)."""

    def __init__(self, model: str | ModelArch, gpu: str | GpuSpec, tp: int = 1, pp: int = 1, *,
                 weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                 engine: Optional[Engine] = None, profile: Optional[dict] = None,
                 profile_source: str = "", scale: float = 1.0,
                 eff: Optional[dict] = None, ep: int = 1,
                 expert_imbalance: Optional[float] = None, dp: int = 1) -> None:
        self.arch = model if isinstance(model, ModelArch) else catalog.model(model)
        self.spec = gpu if isinstance(gpu, GpuSpec) else catalog.gpu(gpu)
        self.tp, self.pp = int(tp), int(pp)
        self.weight_dtype = catalog.weight_format(weight_dtype).name
        self.kv_dtype = kv_dtype
        engine = engine or Engine()
        self.calibration: Optional[Calibration] = None
        if profile is not None:
            engine, _ = profile_engine(profile, engine)
            self.calibration = _calibration(
                profile, profile_source,
                (self.arch.name, self.arch.layers, self.spec.name, self.tp, self.pp,
                 self.weight_dtype, kv_dtype, engine, json.dumps(eff, sort_keys=True)),
                arch=self.arch, spec=self.spec, tp=self.tp, pp=self.pp,
                weight_dtype=self.weight_dtype, kv_dtype=kv_dtype, engine=engine, eff=eff)
        self.engine = engine
        c = build_constants(self.arch, self.spec, self.tp, self.pp, self.weight_dtype, kv_dtype,
                            engine, eff)
        if self.calibration is not None:
            c = apply_scales(c, self.calibration.scales)
        c[ph.C_SCALE] = float(scale)
        self.c = c
        self.scale = float(scale)
        self.padded = c[ph.C_PADDED] > 0.0
        self.profile = profile
        self.fit = None
        self.noise = None
        self._rng = None
        self.CL = new_counts()
        self._chunks = ChunkArrays()
        self.ep, self.dp = int(ep), int(dp)
        self.expert = None
        check_expert_parallel(self.arch, self.tp, self.pp, self.dp, self.ep, "model.cost.")
        why = ep_group_error(self.tp, self.dp, self.ep)
        if why:
            raise LatsimError(why, field="model.cost.ep", value=ep, has_value=True)
        if self.ep > 1:
            self.expert = ExpertParallel.of(self.arch, self.spec, c, self.ep, expert_imbalance)
        if self.dp > 1:
            # The slowest rank's constants: experts 1 / dp per GPU, the EP group's routing.
            self.c = rank_constants(c, self.dp)

    @property
    def label(self) -> str:
        """The estimate label every output carries."""
        if self.calibration is None:
            return ESTIMATE
        return ESTIMATE_CALIBRATED.format(n=len(self.calibration.steps),
                                          src=self.calibration.source or "a profile",
                                          terms=", ".join(self.calibration.scales) or "nothing")

    def breakdown(self, n_decode: int, ctx_max: int, ctx_sum: int, chunks) -> dict:
        """The terms of one step (``physics.step_breakdown``), grouped as well into
        ``compute`` (GEMM FLOPs and prefill attention), ``memory`` (weights, elementwise
        passes, decode attention's KV reads), ``communication`` (all-reduces, pipeline
        sends) and ``overhead`` (kernel floors, and the host time when it binds)."""
        s = rank_share(n_decode, ctx_max, ctx_sum, chunks, self.dp)
        b = ph.step_breakdown(self.c, s.n_decode, s.ctx_max, s.ctx_sum, s.chunks)
        b["compute"] = b["gemm_compute"] + b["prefill_attention"]
        b["memory"] = b["weights"] + b["elementwise"] + b["decode_attention"]
        b["communication"] = b["allreduce"] + b["pipeline_send"]
        if self.expert is not None:
            e = self.step_terms_ms(n_decode, 1, chunks)
            add = e.pop("added")
            b.update(e)
            b["communication"] += (e["ep_dispatch"] + e["ep_combine"] + e["ep_allreduce_replaced"]
                                   + e.get("dp_sync", 0.0))
            b["compute"] += e["ep_imbalance"] + e.get("dp_attention_share", 0.0)
            b["device"] += add
            b["ms"] += add * self.scale
            if self.dp > 1:
                b["dp_rank_tokens"] = s.tokens
                b["dp_padded_tokens"] = s.padded(self.dp) - s.total
        b["overhead"] = b["floor"] + b["bookkeeping"] + max(0.0, b["host"] - b["device"])
        b["bound"] = ("host" if b["host"] > b["device"] else
                      max(("compute", "memory", "communication", "overhead"), key=b.__getitem__))
        b["stage_ms"] = b["device"] / self.pp
        return b

    def memory_plan(self, **kw):
        """``catalog.plan_memory`` of this configuration (never raises: ``fits``)."""
        return catalog.plan_memory(self.arch, self.spec, self.tp, self.pp,
                                   weight_dtype=self.weight_dtype, kv_dtype=self.kv_dtype,
                                   require_fit=False, dp=self.dp, **kw)

    def describe(self) -> dict:
        """What the estimate rests on, for the run's summary and ``latsim cost``."""
        peak, why = compute_peak(self.spec, self.weight_dtype)
        eff = {ph.NAMES[i]: round(float(self.c[i]), 5) for i in (
            ph.C_E_GEMM, ph.C_GEMM_HALF, ph.C_E_WEIGHTS, ph.C_E_FLASH, ph.C_E_DECODE,
            ph.C_P_GEMM, ph.C_P_STEP)}
        over = {ph.NAMES[i]: round(float(self.c[i]), 5) for i in (
            ph.C_H_STEP, ph.C_H_DECODE, ph.C_H_GRAPH, ph.C_DEV_LAYER_US, ph.C_AR_LAT_US,
            ph.C_AR_GBS)}
        return {
            "kind": "roofline",
            "estimate": self.label,
            "model": self.arch.name, "gpu": self.spec.name, "tp": self.tp, "pp": self.pp,
            "gpus": self.tp * self.pp * self.dp, "ep": self.ep, "dp": self.dp,
            "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype,
            "peaks": {"linear_tflops": peak, "linear_on": why,
                      "attention_tflops": self.spec.bf16_tflops,
                      "hbm_gbs": self.spec.memory_bw_gbs,
                      "link_gbs_one_way": self.spec.link_gbs_unidir, "gpu_source": self.spec.source},
            "efficiencies": eff, "overheads": over,
            "decode_attention": "padded" if self.padded else "paged",
            "cuda_graphs": bool(self.c[ph.C_GRAPHS] > 0.0),
            "pipeline": ("no micro-batching: one batch in flight, the stages run one after "
                         "the other; stage time = step / pp, each GPU idle (pp - 1) / pp")
            if self.pp > 1 else "none",
            "calibration": self.calibration.describe() if self.calibration else None,
            "bookkeeping_ms": float(self.c[ph.C_BOOK_MS]),
        }


def load_calibration_profile(path: str, base_dirs: Sequence[Path]) -> tuple[dict, str]:
    """Read a calibration profile (``resolve_profile_path`` rules; one-line errors)."""
    from simulator.cost.profile import load_profile, resolve_profile_path
    try:
        p = resolve_profile_path(path, base_dirs)
    except LatsimError:
        raise LatsimError("calibration profile not found", source=str(path),
                          field="model.cost.calibrate") from None
    return load_profile(p), str(path)


def build_roofline(cfg: RooflineCostConfig, rng, base_dirs: Sequence[Path],
                   profile: Optional[dict] = None) -> RooflineCostModel:
    """The model a ``kind: roofline`` config describes (registry factory). ``profile``,
    when given, is the calibration profile already read."""
    if cfg.model is None:
        raise LatsimError("a roofline cost model needs the model: set model.name",
                          field="model.name")
    src = cfg.calibrate or ""
    if profile is None and cfg.calibrate:
        profile, src = load_calibration_profile(cfg.calibrate, base_dirs)
    return RooflineCostModel(model_arch(cfg.model, base_dirs), cfg.gpu, cfg.tp, cfg.pp,
                             weight_dtype=cfg.weight_dtype, kv_dtype=cfg.kv_dtype,
                             engine=cfg.engine(), profile=profile, profile_source=src,
                             scale=cfg.scale, ep=cfg.ep, expert_imbalance=cfg.expert_imbalance,
                             dp=cfg.dp)


def model_arch(name: str, base_dirs: Sequence[Path] = ()) -> ModelArch:
    """A model by catalogue name, or a config.json path (tried relative to each of
    ``base_dirs`` first)."""
    p = Path(name)
    if not p.is_absolute() and (name.endswith(".json") or "/" in name):
        for d in base_dirs:
            if (Path(d) / p).exists():
                return catalog.model(Path(d) / p)
    return catalog.model(name)
