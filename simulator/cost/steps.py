"""Pricing engine steps outside a simulation: ``latsim cost`` (one step, or a batch with
``--steps``) and the Python API ``simulator.cost.step_ms``.

A step is N prompts of L tokens prefilled whole (``NxL``) and/or B sequences decoding one
token each at context C (``B@C``). The cost model (catalogue lookups, the constants
vector, a calibration) is set up once per configuration (``cost_model``, cached); each
step is then one call of the model's ``step_time``, the very function every event loop
calls, so a batch prices each step exactly as a single ``latsim cost`` call does. Every
check a single call makes (the step's syntax, the model's longest context, whether the
step fits the GPUs) is made for each step, before any is priced. Errors are
``LatsimError`` lines naming the ``latsim cost`` option, or the file, line and column of a
batch row."""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Optional

from simulator.errors import LatsimError

TERMS = ("compute", "memory", "communication", "overhead")


def parse_prefill(text, source: str = "--prefill") -> tuple[int, int]:
    """``NxL`` -> (N prompts, L tokens each); ``L`` alone is one prompt."""
    m = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?(\d+)\s*", text if isinstance(text, str) else "")
    if not m or int(m.group(2)) < 1 or (m.group(1) is not None and int(m.group(1)) < 1):
        raise LatsimError("must look like NxL (N prompts of L tokens, e.g. 4x512)",
                          source=source, value=text, has_value=True)
    return int(m.group(1) or 1), int(m.group(2))


def parse_decode(text, source: str = "--decode") -> tuple[int, int]:
    """``B@C`` -> (B sequences, context C)."""
    m = re.fullmatch(r"\s*(\d+)\s*@\s*(\d+)\s*", text if isinstance(text, str) else "")
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise LatsimError("must look like B@C (B sequences at context C, e.g. 16@1024)",
                          source=source, value=text, has_value=True)
    return int(m.group(1)), int(m.group(2))


def named(flag: str, lookup):
    """A catalogue lookup whose error names the flag instead of the catalogue field."""
    try:
        return lookup()
    except LatsimError as e:
        raise LatsimError(re.sub(r"^field '[^']*': ", "", str(e)), source=flag) from None


def roofline_model(model: str, gpu: str, tp: int, pp: int, weight_dtype: str, kv_dtype: str,
                   calibrate: Optional[Path], ep: int = 1, dp: int = 1):
    """The roofline cost model of ``model`` on ``gpu`` (TP x PP, expert parallelism over
    ``ep`` GPUs, ``dp`` data-parallel attention ranks), checked as ``latsim cost`` checks
    its options."""
    from simulator.cost import catalog
    from simulator.cost.roofline.constants import KV_DTYPES, WEIGHT_DTYPES
    from simulator.cost.roofline.model import (RooflineCostModel, load_calibration_profile,
                                               model_arch)
    if weight_dtype not in WEIGHT_DTYPES:
        raise LatsimError(f"must be one of {', '.join(WEIGHT_DTYPES)}", source="--weight-dtype",
                          value=weight_dtype, has_value=True)
    if kv_dtype not in KV_DTYPES:
        raise LatsimError(f"must be one of {', '.join(KV_DTYPES)}", source="--kv-dtype",
                          value=kv_dtype, has_value=True)
    spec = named("--gpu", lambda: catalog.gpu(gpu))
    arch = named("--model", lambda: model_arch(model, [Path.cwd()]))
    for flag, v in (("--tp", tp), ("--pp", pp), ("--ep", ep), ("--dp", dp)):
        if v < 1:
            raise LatsimError("must be a positive integer", source=flag, value=v, has_value=True)
    try:
        catalog.check_parallelism(arch, tp, pp)
    except LatsimError as e:
        flag = "--pp" if "'pp'" in str(e) else "--tp"
        raise LatsimError(re.sub(r"^field '[^']*': ", "", str(e)), source=flag) from None
    profile, src = None, ""
    if calibrate is not None:
        profile, src = load_calibration_profile(str(calibrate), [Path.cwd()])
    try:
        return RooflineCostModel(arch, spec, tp, pp, weight_dtype=weight_dtype,
                                 kv_dtype=kv_dtype, profile=profile, profile_source=src,
                                 ep=ep, dp=dp)
    except LatsimError as e:
        # The config's field names (model.cost.ep / dp) as the options they came from.
        m = re.match(r"^field 'model\.cost\.(ep|dp)': (.*)$", str(e))
        if m is None:
            raise
        raise LatsimError(m.group(2), source=f"--{m.group(1)}") from None


def measured_model(profile: Path, kind: str, model: Optional[str]):
    """A measured profile's ``fitted`` or ``profile`` cost model (and the profile)."""
    from simulator.cost.profile import load_profile
    from simulator.cost.fitted import FittedCostModel
    from simulator.cost.profile import ProfileCostModel
    if not profile.exists():
        raise LatsimError("file not found", source=str(profile), field="--profile")
    prof = load_profile(profile)
    if model is not None:
        check_profile_model(prof, model, profile)
    if kind == "fitted":
        return FittedCostModel(prof), prof
    if kind == "profile":
        return ProfileCostModel(prof), prof
    raise LatsimError("must be fitted or profile (roofline: leave --profile out)",
                      source="--kind", value=kind, has_value=True)


def check_profile_model(prof: dict, model: str, path: Path) -> None:
    """``--model`` with ``--profile``: the profile must be of that model."""
    from simulator.config.model import ModelShape, _profile_model_check
    from simulator.cost.roofline.model import model_arch
    arch = named("--model", lambda: model_arch(model, [Path.cwd()]))
    shape = ModelShape(name=arch.name, n_layers=arch.layers, d_model=arch.hidden,
                       n_heads=arch.heads, n_kv_heads=arch.kv_heads, head_dim=arch.head_dim,
                       params_b=arch.param_count() / 1e9)
    try:
        _profile_model_check(model, shape, str(path.resolve()), [])
    except Exception as e:  # noqa: BLE001 - a pydantic error carrying our message
        ctx = getattr(e, "context", None) or {}
        raise LatsimError(str(ctx.get("msg", e)).replace("model.name", "--model")
                          .replace("model.cost: {kind: roofline, gpu: ..., calibrate:",
                                   "latsim cost --gpu ... --calibrate").rstrip("}"),
                          source=str(path)) from None


def cost_model(model: Optional[str] = None, gpu: Optional[str] = None, *, tp: int = 1,
               pp: int = 1, weight_dtype: str = "bf16", kv_dtype: str = "bf16",
               calibrate=None, profile=None, kind: str = "fitted", ep: int = 1, dp: int = 1):
    """The cost model ``latsim cost`` prices with for these options (roofline: ``model``
    and ``gpu``; measured: ``profile`` and ``kind``), built once per configuration."""
    return _cost_model(model, gpu, int(tp), int(pp), weight_dtype, kv_dtype,
                       None if calibrate is None else str(calibrate),
                       None if profile is None else str(profile), kind, int(ep), int(dp))


@functools.lru_cache(maxsize=16)
def _cost_model(model, gpu, tp, pp, weight_dtype, kv_dtype, calibrate, profile, kind, ep, dp):
    if profile is not None:
        if gpu is not None or calibrate is not None or ep != 1 or dp != 1:
            raise LatsimError("--profile times the step with the profile's own model; --gpu, "
                              "--calibrate, --ep and --dp belong to the roofline (leave "
                              "--profile out)", source="--profile")
        return measured_model(Path(profile), kind, model)[0]
    if kind != "fitted":
        raise LatsimError("chooses the model of a --profile: give --profile", source="--kind",
                          value=kind, has_value=True)
    if model is None or gpu is None:
        raise LatsimError("the roofline needs --model and --gpu (or give --profile)",
                          source="latsim cost")
    return roofline_model(model, gpu, tp, pp, weight_dtype, kv_dtype,
                          None if calibrate is None else Path(calibrate), ep, dp)


def step_args(pre: Optional[tuple], dec: Optional[tuple]) -> tuple:
    """A step as a cost model's ``step_time`` takes it: (decodes, context max, context
    sum, prefill chunks)."""
    chunks = [(pre[1], 0, True)] * pre[0] if pre else []
    nd, ctx = dec if dec else (0, 0)
    return nd, ctx, nd * ctx, chunks


def check_step(cm, pre: Optional[tuple], dec: Optional[tuple], *, source: Optional[str] = None,
               plans: Optional[dict] = None, cover=None):
    """Every check of a step before it is priced: the model's longest context (roofline)
    and whether the step fits the GPUs at all (a step of a hundred million tokens is
    refused here, not after minutes of arithmetic). Returns the memory plan (None for a
    measured model); ``plans`` caches plans by the step's size. ``source`` names a batch
    row in the error (else the ``--prefill``/``--decode`` option). ``cover``: the fitting
    plan of a step at least as large (``check_steps``)."""
    from simulator.cost import catalog
    if pre is None and dec is None:
        raise LatsimError("give the step: --prefill NxL and/or --decode B@C" if source is None
                          else "no step: give prefill and/or decode",
                          source=source or "latsim cost")
    if hasattr(cm, "arch"):
        for opt, tokens, what in (("prefill", pre[1] if pre else 0, "a prompt of"),
                                  ("decode", dec[1] if dec else 0, "a context of")):
            catalog.check_context(cm.arch, tokens, what, source=f"--{opt}" if source is None
                                  else f"{source}: column '{opt}'")
    if not hasattr(cm, "memory_plan"):
        return None
    if cover is not None and kv_need(pre, dec) <= cover.kv_tokens:
        return cover
    key = plan_key(pre, dec)
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        plan = cm.memory_plan(max_num_batched_tokens=key[0], max_num_seqs=key[1])
        if plans is not None:
            plans[key] = plan
    if not plan.fits:
        raise LatsimError(plan.reason, source=source)
    return plan


def plan_key(pre: Optional[tuple], dec: Optional[tuple]) -> tuple[int, int]:
    """The memory plan's size for a step: (batched tokens, sequences), at least 1 each."""
    nd, _, _, chunks = step_args(pre, dec)
    return max(nd + sum(c[0] for c in chunks), 1), max(nd + len(chunks), 1)


def kv_need(pre: Optional[tuple], dec: Optional[tuple]) -> int:
    """Tokens of KV the step holds (its decodes' contexts and its prompts)."""
    return (dec[0] * dec[1] if dec else 0) + (pre[0] * pre[1] if pre else 0)


def check_steps(cm, steps: list, sources: list) -> list:
    """``check_step`` of every step (``sources`` name them in errors), with one memory plan
    for most: memory grows with a step's batched tokens and sequences, so when a plan at
    the largest of both fits, every step fits, and a step whose KV fits that plan's
    capacity fits its own (which is larger); only the others get their own plan."""
    cover = None
    real = [s for s in steps if s != (None, None)]
    if hasattr(cm, "memory_plan") and real:
        keys = [plan_key(*s) for s in real]
        cover = cm.memory_plan(max_num_batched_tokens=max(k[0] for k in keys),
                               max_num_seqs=max(k[1] for k in keys))
        cover = cover if cover.fits else None
    plans: dict = {}
    return [check_step(cm, pre, dec, source=src, plans=plans, cover=cover)
            for (pre, dec), src in zip(steps, sources)]


def price(cm, pre: Optional[tuple], dec: Optional[tuple]) -> float:
    """The step's milliseconds (after ``check_step``)."""
    return cm.step_time(*step_args(pre, dec)) * 1000.0


def price_row(cm, pre: Optional[tuple], dec: Optional[tuple], plan, terms: bool = False
              ) -> dict:
    """One batch row's figures: ``ms``, whether the step's KV fits (roofline) and, with
    ``terms``, the roofline's four terms and what bounds the step (as ``latsim cost``
    reports them)."""
    row = {"ms": price(cm, pre, dec)}
    if plan is not None:
        row["step_fits"] = kv_need(pre, dec) <= plan.kv_tokens
    if terms and hasattr(cm, "breakdown"):
        b = cm.breakdown(*step_args(pre, dec))
        row.update({k: b[k] for k in TERMS})
        row["bound"] = b["bound"]
    return row


def _as_steps(prefill, decode):
    """``step_ms``'s arguments as a list of (prefill, decode) pairs and whether they were
    arrays (a scalar call returns a float)."""
    import numpy as np

    def side(v, parse, name):
        if v is None:
            return None, False
        if isinstance(v, str):
            return [parse(v, source=name)], False
        a, b = v
        aa, bb = np.broadcast_arrays(np.asarray(a), np.asarray(b))
        for x, what in ((aa, "counts"), (bb, "lengths")):
            if x.size and (not np.issubdtype(x.dtype, np.integer) or (x < 0).any()):
                raise LatsimError(f"{what} must be integers >= 0 (0: none in that step)",
                                  source=name)
        pairs = [(int(i), int(j)) if i > 0 and j > 0 else None
                 for i, j in zip(aa.ravel(), bb.ravel())]
        return pairs, aa.ndim > 0

    pre, pa = side(prefill, parse_prefill, "prefill")
    dec, da = side(decode, parse_decode, "decode")
    if pre is not None and dec is not None and 1 not in (len(pre), len(dec)) \
            and len(pre) != len(dec):
        raise LatsimError(f"prefill has {len(pre)} steps and decode {len(dec)}", source="decode")
    n = max(len(pre or [None]), len(dec or [None]))
    pre = (pre or [None]) * (n if len(pre or [None]) == 1 else 1)
    dec = (dec or [None]) * (n if len(dec or [None]) == 1 else 1)
    return list(zip(pre, dec)), pa or da


def step_ms(prefill=None, decode=None, **config):
    """Milliseconds of engine steps, priced as ``latsim cost`` prices them.

    ``prefill``: ``"NxL"`` or ``(N, L)`` (N prompts of L tokens prefilled whole);
    ``decode``: ``"B@C"`` or ``(B, C)`` (B sequences decoding one token at context C).
    Either may hold arrays instead, ``(N_array, L_array)``: one step per element (a 0
    count or length: no prefill, or no decode, in that step), and the answer is a numpy
    array of that shape; scalars give a float. ``config``: ``latsim cost``'s options
    (``model``, ``gpu``, ``tp``, ``pp``, ``weight_dtype``, ``kv_dtype``, ``calibrate``;
    or ``profile`` and ``kind``); the model is set up once per configuration.
    Bad input raises ``LatsimError`` (the step's index in an array)."""
    import numpy as np
    cm = cost_model(**config)
    steps, arrays = _as_steps(prefill, decode)
    check_steps(cm, steps, [f"step {i}" if arrays else None for i in range(len(steps))])
    ms = np.array([price(cm, pre, dec) for pre, dec in steps])
    if not arrays:
        return float(ms[0])
    shape = np.broadcast_shapes(*(np.shape(v[0]) for v in (prefill, decode)
                                  if v is not None and not isinstance(v, str)))
    return ms.reshape(shape)
