"""Calibrating the roofline to a measured profile: from two rows (one timed request's
prefill and decode) to a whole profile (``calibrate``).

The rows are modelled on the profile's own configuration (``profile_configuration``:
its model, GPU, TP x PP and formats, the target's where it does not say) and engine
(``profile_engine``). A few engine-specific terms (``TERMS``: an overhead added to
every step, or scales of the compute and memory efficiencies, of the host's launches,
of decode or prefill attention) are chosen by what the rows can identify
(``choose_terms``), fitted to the rows' log errors (``fit_scales``, the shared
``solve``), and carried to the target by ``apply_scales``, the physics doing the rest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from simulator.cost import catalog
from simulator.cost import physics as ph
from simulator.cost.catalog import GpuSpec, ModelArch
from simulator.cost.roofline.constants import Engine, build_constants
from simulator.cost.roofline.defaults import SOLVE
from simulator.cost.solve import solve
from simulator.errors import LatsimError

# The engine-specific terms a calibration can fit. ``overhead`` is milliseconds every
# step pays in series with its device work (``dev_step_ms``: preparing inputs,
# sampling, scheduling, broadcasting to TP workers); the others multiply these constants.
ADDITIVE = {"overhead": ph.C_DEV_STEP_MS}
TERMS = {
    "overhead": (ph.C_DEV_STEP_MS,),
    # tensor-core efficiency: GEMMs and prefill attention
    "compute": (ph.C_E_GEMM, ph.C_E_FLASH, ph.C_E_MASKED),
    # memory-bandwidth efficiency: weights, decode attention, elementwise passes
    "memory": (ph.C_E_WEIGHTS, ph.C_E_DECODE, ph.C_E_DECODE_EAGER, ph.C_E_ACT),
    "decode_attention": (ph.C_E_DECODE, ph.C_E_DECODE_EAGER),
    "prefill_attention": (ph.C_E_FLASH, ph.C_E_MASKED),
    # the host's kernel launches (eager steps) and graph replays
    "host": (ph.C_H_STEP, ph.C_H_DECODE, ph.C_H_CHUNK, ph.C_H_PREFIX, ph.C_H_GRAPH),
}
# The efficiencies a scale may not push past the datasheet peak.
_CAPPED = {ph.C_E_GEMM, ph.C_E_FLASH, ph.C_E_MASKED, ph.C_E_WEIGHTS, ph.C_E_DECODE,
           ph.C_E_DECODE_EAGER}
SCALE_BOUNDS = (0.02, 50.0)
PRIOR = 0.002           # pull of every scale towards 1 (decides only what rows leave open)
HUBER = 0.05            # relative error beyond which a row pulls less (a row the physics misses)


def term_indices(term: str, terms) -> tuple:
    """The constants ``term`` multiplies when ``terms`` are fitted together: ``compute``
    leaves prefill attention to ``prefill_attention`` when that is fitted too."""
    if term == "compute" and "prefill_attention" in terms:
        return (ph.C_E_GEMM,)
    return TERMS[term]


def apply_scales(c: np.ndarray, scales: dict) -> np.ndarray:
    """A copy of ``c`` with every term of ``scales`` applied: ``overhead`` (ms) added
    to every step, the others multiplying their constants (``term_indices``)."""
    out = c.copy()
    for term, k in scales.items():
        if term in ADDITIVE:
            out[ADDITIVE[term]] += k
            continue
        for idx in term_indices(term, scales):
            out[idx] *= k
    return out


@dataclass
class Step:
    """One measured step of a calibration profile."""

    kind: str
    n_decode: int
    ctx_max: int
    ctx_sum: int
    chunks: list
    eager: bool
    ms: float

    def text(self) -> str:
        """``prefill 1x512``, ``decode 16@1024``, ``mixed 8@1024 + 1x512``."""
        pre = f"{len(self.chunks)}x{self.chunks[0][0]}" if self.chunks else ""
        if self.chunks and self.chunks[0][1]:
            pre += f" after {self.chunks[0][1]}"
        dec = f"{self.n_decode}@{self.ctx_max}" if self.n_decode else ""
        return f"{self.kind} " + " + ".join(x for x in (dec, pre) if x)


def profile_steps(profile: dict) -> list[Step]:
    """Every row of a profile as a ``Step``; a prefill row may carry ``batch`` (that
    many prompts of ``chunk`` tokens prefilled in one step, default 1)."""
    out = []
    for r in profile.get("prefill") or []:
        n = int(r.get("batch", 1) or 1)
        out.append(Step("prefill", 0, 0, 0, [(int(r["chunk"]), int(r.get("prior", 0)), True)] * n,
                        False, float(r["ms"])))
    for r in profile.get("prefill_partial") or []:
        out.append(Step("prefill_partial", 0, 0, 0,
                        [(int(r["chunk"]), int(r.get("prior", 0)), False)], False, float(r["ms"])))
    for kind, eager in (("decode", False), ("decode_eager", True)):
        for r in profile.get(kind) or []:
            b, x = int(r["batch"]), int(r["context"])
            out.append(Step(kind, b, x, b * x, [], eager, float(r["ms"])))
    for r in profile.get("mixed") or []:
        b, x = int(r["batch"]), int(r["context"])
        out.append(Step("mixed", b, x, b * x, [(int(r["chunk"]), int(r.get("prior", 0)), True)],
                        False, float(r["ms"])))
    return out


def step_core(c: np.ndarray, s: Step) -> float:
    """The physics' time of a measured step as a profile times it (no bookkeeping)."""
    k = len(s.chunks)
    n = np.array([x[0] for x in s.chunks] + [0], np.int64)
    p = np.array([x[1] for x in s.chunks] + [0], np.int64)
    f = np.array([x[2] for x in s.chunks] + [False], np.bool_)
    return float(ph.step_core_ms(c, s.n_decode, s.ctx_max, s.ctx_sum, n, p, f, k, s.eager))


_OVERHEAD_WHY = ("a per-step overhead in ms from the decode rows (a small decode is its weight "
                 "reads plus what every step pays in series)")


def choose_terms(steps: list[Step], c: np.ndarray) -> tuple[list, str]:
    """The terms a profile's rows identify, in order, and why (``calibrate`` doc); never
    more than there are rows, and beyond the first two only with a row to spare."""
    pre = [s for s in steps if s.chunks and not s.n_decode]
    dec = [s for s in steps if s.n_decode and not s.chunks]
    terms, why = [], []
    if any(s.chunks for s in steps):
        terms.append("compute")
        why.append("compute efficiency from the prefill rows (a prefill is compute-bound)")
    if dec:
        terms.append("overhead")
        why.append(_OVERHEAD_WHY)

    def spare() -> bool:
        return len(steps) > len(terms) + 1

    host_bound = [s for s in steps if _host_bound(c, s)]
    if spare() and len(host_bound) >= 2:
        terms.append("host")
        why.append(f"the host's launch cost from {len(host_bound)} rows where the default "
                   "host time exceeds the device's")
    kv = sorted({s.ctx_sum for s in dec})
    if spare() and len(kv) >= 2 and kv[-1] >= 8 * kv[0]:
        terms.append("decode_attention")
        why.append("decode-attention efficiency from decode rows whose KV reads differ 8x or more")
    sizes = sorted({s.chunks[0][0] for s in pre})
    if spare() and len(sizes) >= 3 and sizes[-1] >= max(4 * sizes[0], 1024):
        terms.append("prefill_attention")
        why.append("prefill-attention efficiency from prefill rows 4x apart in size, up to "
                   f"{sizes[-1]} tokens")
    return terms[:len(steps)], "; ".join(why)


def _host_bound(c: np.ndarray, s: Step) -> bool:
    """Whether the default model's host time exceeds its device time for a step."""
    b = ph.step_breakdown(c, s.n_decode, s.ctx_max, s.ctx_sum, s.chunks)
    return b["host"] > b["device"]


def _caps(c: np.ndarray, term: str, terms) -> float:
    """The largest scale of ``term`` that keeps its efficiencies at or below 1."""
    caps = [1.0 / c[i] for i in term_indices(term, terms) if i in _CAPPED and c[i] > 0]
    return min([SCALE_BOUNDS[1]] + caps)


OVERHEAD_BOUNDS_MS = (1e-4, 1e4)


def fit_scales(c: np.ndarray, steps: list[Step], terms: list) -> tuple[dict, np.ndarray]:
    """Values of ``terms`` minimising the log errors of ``steps`` (plus a weak pull of
    the scales towards 1); returns them and the fitted steps' relative errors."""
    if not terms:
        return {}, np.array([step_core(c, s) / s.ms - 1.0 for s in steps])
    meas = np.log([s.ms for s in steps])
    add = np.array([t in ADDITIVE for t in terms])
    lo = np.where(add, math.log(OVERHEAD_BOUNDS_MS[0]), math.log(SCALE_BOUNDS[0]))
    hi = np.array([math.log(OVERHEAD_BOUNDS_MS[1]) if a else math.log(_caps(c, t, terms))
                   for t, a in zip(terms, add)])
    pull = np.where(add, 0.0, PRIOR)

    def resid(x):
        cc = apply_scales(c, dict(zip(terms, np.exp(x))))
        pred = np.log([max(step_core(cc, s), 1e-12) for s in steps])
        return np.concatenate([pred - meas, pull * x])

    x = solve(resid, np.where(add, math.log(0.5), 0.0), lo, hi, huber=HUBER, **SOLVE).x
    scales = {t: float(v) for t, v in zip(terms, np.exp(x))}
    cc = apply_scales(c, scales)
    return scales, np.array([step_core(cc, s) / s.ms - 1.0 for s in steps])


@dataclass
class Calibration:
    """What a calibration profile changed (``calibrate``)."""

    source: str
    scales: dict
    why: str
    steps: list
    before: np.ndarray              # default model's relative error per row
    after: np.ndarray               # calibrated model's relative error per row
    configuration: dict
    engine: dict = field(default_factory=dict)

    def describe(self) -> dict:
        """For ``describe()`` and ``latsim cost --json``."""
        return {"source": self.source, "configuration": self.configuration,
                "scales": {k: round(v, 4) for k, v in self.scales.items()},
                "units": {k: ("ms added to every step" if k in ADDITIVE else "scale")
                          for k in self.scales},
                "why": self.why, "engine": self.engine,
                "rows": [{"step": s.text(), "measured_ms": s.ms,
                          "default_error": round(float(b), 4), "calibrated_error": round(float(a), 4)}
                         for s, b, a in zip(self.steps, self.before, self.after)]}


def _meta_model(meta: dict, fallback: ModelArch) -> tuple[ModelArch, bool]:
    """The model a profile was measured on: its ``meta.model`` (catalogue name, else
    the dimensions it lists, Llama-shaped), else ``fallback``. Second: whether the
    profile said."""
    m = meta.get("model")
    if isinstance(m, str):
        return catalog.model(m), True
    if not isinstance(m, dict) or not m:
        return fallback, False
    name = m.get("name")
    arch = None
    if isinstance(name, str):
        try:
            arch = catalog.model(name)
        except LatsimError:
            arch = None
    dims = {"layers": m.get("n_layers"), "hidden": m.get("d_model"), "heads": m.get("n_heads"),
            "kv_heads": m.get("n_kv_heads"), "head_dim": m.get("head_dim"), "ffn": m.get("ffn"),
            "vocab": m.get("vocab")}
    given = {k: int(v) for k, v in dims.items() if isinstance(v, (int, float)) and v > 0}
    if arch is not None and all(getattr(arch, k) == v for k, v in given.items()):
        return arch, True
    need = ("layers", "hidden", "heads")
    if not all(k in given for k in need):
        if arch is not None:
            return arch, True
        raise LatsimError("the profile's meta.model names no catalogued model and lacks "
                          "n_layers / d_model / n_heads", field="meta.model", value=name,
                          has_value=True)
    heads = given["heads"]
    hd = given.get("head_dim", given["hidden"] // heads)
    return ModelArch(name=str(name or "profile-model"), hf_id="", family="llama", gated_mlp=True,
                     activation="silu", layers=given["layers"], hidden=given["hidden"],
                     heads=heads, kv_heads=given.get("kv_heads", heads), head_dim=hd,
                     ffn=given.get("ffn", 4 * given["hidden"]), vocab=given.get("vocab", 32000),
                     tied_embeddings=False, max_context=None,
                     source="the profile's meta.model"), True


def _meta_gpu(meta: dict, fallback: GpuSpec) -> tuple[GpuSpec, bool]:
    """The GPU a profile was measured on: ``meta.gpu`` (a catalogue name), else a
    catalogue name found in ``meta.hardware``, else ``fallback``."""
    if meta.get("gpu"):
        return catalog.gpu(str(meta["gpu"])), True
    found = catalog.gpu_in_text(str(meta.get("hardware") or ""))
    return (found, True) if found is not None else (fallback, False)


def profile_configuration(profile: dict, arch: ModelArch, spec: GpuSpec, tp: int, pp: int,
                          weight_dtype: str, kv_dtype: str) -> dict:
    """The configuration a calibration profile was measured on (``meta``: ``model``,
    ``gpu`` or ``hardware``, ``tp``, ``pp``, ``weight_dtype`` or ``dtype``,
    ``kv_dtype``); where it does not say, the target's when the profile names neither
    another model nor another GPU ("one request timed on the target machine"), else
    one GPU and 16-bit weights."""
    meta = profile.get("meta") or {}
    m, said_m = _meta_model(meta, arch)
    g, said_g = _meta_gpu(meta, spec)
    same = m.name == arch.name and g.name == spec.name
    dflt = (tp, pp, weight_dtype, kv_dtype) if same else (1, 1, "bf16", "bf16")

    def pick(keys, default, cast):
        for k in keys:
            if meta.get(k) is not None:
                return cast(meta[k])
        return default

    wd = pick(("weight_dtype", "dtype"), dflt[2], str)
    wd = catalog.weight_format(wd).name if wd.lower() not in ("fp32", "float32") else "bf16"
    return {"model": m, "gpu": g, "tp": pick(("tp", "tensor_parallel"), dflt[0], int),
            "pp": pick(("pp", "pipeline_parallel"), dflt[1], int), "weight_dtype": wd,
            "kv_dtype": pick(("kv_dtype",), dflt[3], str),
            "said": {"model": said_m, "gpu": said_g}}


def profile_engine(profile: dict, base: Engine) -> tuple[Engine, dict]:
    """The engine facts a profile states (``engine.decode_attention``, ``cuda_graphs``,
    ``graph_batch_buckets``, ``bookkeeping_ms``) over ``base``'s; and which it stated."""
    eng = profile.get("engine") or {}
    said = {}
    kw = {}
    if eng.get("decode_attention") in ("paged", "padded"):
        kw["decode_attention"] = said["decode_attention"] = eng["decode_attention"]
    if isinstance(eng.get("cuda_graphs"), bool):
        kw["cuda_graphs"] = said["cuda_graphs"] = eng["cuda_graphs"]
        if not eng["cuda_graphs"]:
            kw["graph_buckets"] = ()
    b = eng.get("graph_batch_buckets")
    if isinstance(b, list) and b and all(isinstance(x, int) for x in b):
        kw["graph_buckets"] = tuple(b)
        said["graph_batch_buckets"] = list(b)
    for k in ("bookkeeping_ms", "bookkeeping_seq_ms"):
        if isinstance(eng.get(k), (int, float)):
            kw[k] = said[k] = float(eng[k])
    return Engine(**{**base.__dict__, **kw}), said


def calibrate(profile: dict, source: str, arch: ModelArch, spec: GpuSpec, tp: int, pp: int,
              weight_dtype: str, kv_dtype: str, engine: Engine,
              eff: Optional[dict] = None) -> Calibration:
    """Fit the engine-specific terms to a measured profile's rows and return them.

    The rows are modelled on the profile's own configuration (``profile_configuration``)
    and engine (``profile_engine``); the terms fitted are chosen by what the rows can
    identify (``choose_terms``), never more than there are rows:

    - ``compute`` (the GEMM and prefill-attention efficiencies together, a scale) from
      prefill rows; ``overhead`` (milliseconds every step pays in series with its
      device work: input preparation, sampling, scheduling, broadcasts to TP workers)
      from decode rows. With two rows, one prefill and one decode, exactly these two;
    - with more rows, ``host`` (a scale of the host's launches and graph replays, from
      rows the default model finds host-bound), ``decode_attention`` (decode rows whose
      KV reads differ 8x) and ``prefill_attention`` (prefill rows 4x apart in size, up
      to 1,024 tokens or more);
    - when the default model is already slower than the decode rows, an added overhead
      cannot explain them: ``host`` (the launches' scale) replaces ``overhead`` where
      the default finds those rows host-bound, ``memory`` (the bandwidth efficiencies)
      elsewhere.

    Efficiencies are never scaled past the datasheet peak."""
    conf = profile_configuration(profile, arch, spec, tp, pp, weight_dtype, kv_dtype)
    eng, said = profile_engine(profile, engine)
    c = build_constants(conf["model"], conf["gpu"], conf["tp"], conf["pp"], conf["weight_dtype"],
                        conf["kv_dtype"], eng, eff)
    steps = profile_steps(profile)
    terms, why = choose_terms(steps, c)
    before = np.array([step_core(c, s) / s.ms - 1.0 for s in steps])
    dec = [i for i, s in enumerate(steps) if s.n_decode and not s.chunks]
    if "overhead" in terms and dec and np.median(before[dec]) > 0.02:
        # The default is already slower than the decode rows: an added overhead cannot
        # explain them. Either the host's launches bind there (their scale), or the
        # weight reads are faster than the default's (the bandwidth efficiency).
        host = [i for i in dec if _host_bound(c, steps[i])]
        new = "host" if len(host) * 2 > len(dec) else "memory"
        if new not in terms:
            terms = [new if t == "overhead" else t for t in terms]
            what = ("the host's launch cost from the decode rows (the default is host-bound "
                    "there and slower than they are)" if new == "host" else
                    "memory-bandwidth efficiency from the decode rows (faster than the "
                    "default's weight reads allow with no overhead at all)")
            why = why.replace(_OVERHEAD_WHY, what)
    scales, after = fit_scales(c, steps, terms)
    cfg = {"model": conf["model"].name, "gpu": conf["gpu"].name, "tp": conf["tp"],
           "pp": conf["pp"], "weight_dtype": conf["weight_dtype"], "kv_dtype": conf["kv_dtype"],
           "stated_by_profile": conf["said"]}
    return Calibration(source=source, scales=scales, why=why, steps=steps, before=before,
                       after=after, configuration=cfg, engine=said)
