"""``latsim cost``: the time of one engine step on any GPU and model, from the roofline
cost model (datasheets and default efficiencies, optionally calibrated to a measured
profile), or from a measured profile's ``fitted`` or ``profile`` cost model.

A step is given as ``--prefill NxL`` (N prompts of L tokens prefilled whole in one
step) and/or ``--decode B@C`` (B sequences decoding one token each at context C);
both make a mixed step. The answer is the step's milliseconds and its terms
(compute, memory, communication, overhead and the finer ones), as text or one JSON
object (``--json``). User errors (unknown GPU or model, a TP or PP the model cannot
be split into, a model that does not fit, a malformed step) are one line, exit 2.
"""
from __future__ import annotations

import json
import re
from types import SimpleNamespace
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from simulator.errors import LatsimError

console = Console()


def parse_prefill(text: str) -> tuple[int, int]:
    """``NxL`` -> (N prompts, L tokens each); ``L`` alone is one prompt."""
    m = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?(\d+)\s*", text or "")
    if not m or int(m.group(2)) < 1 or (m.group(1) is not None and int(m.group(1)) < 1):
        raise LatsimError("must look like NxL (N prompts of L tokens, e.g. 4x512)",
                          source="--prefill", value=text, has_value=True)
    return int(m.group(1) or 1), int(m.group(2))


def parse_decode(text: str) -> tuple[int, int]:
    """``B@C`` -> (B sequences, context C)."""
    m = re.fullmatch(r"\s*(\d+)\s*@\s*(\d+)\s*", text or "")
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise LatsimError("must look like B@C (B sequences at context C, e.g. 16@1024)",
                          source="--decode", value=text, has_value=True)
    return int(m.group(1)), int(m.group(2))


def parse_spec(text: str) -> dict:
    """``k=4,acceptance=0.7[,draft=MODEL]`` -> the ``engine.speculative`` mapping
    (``ngram`` without a draft)."""
    from pydantic import ValidationError
    from simulator.config.engine import SpeculativeConfig
    out: dict = {}
    for part in (text or "").split(","):
        key, eq, val = part.partition("=")
        key = key.strip()
        if not eq or key not in ("k", "acceptance", "draft") or key in out:
            raise LatsimError("must look like k=4,acceptance=0.7[,draft=llama-3.2-1b]",
                              source="--spec", value=text, has_value=True)
        out[key] = val.strip()
    if "k" not in out or "acceptance" not in out:
        raise LatsimError("needs k and acceptance (k=4,acceptance=0.7[,draft=MODEL])",
                          source="--spec", value=text, has_value=True)
    try:
        k = int(out["k"])
        a = float(out["acceptance"])
    except ValueError:
        raise LatsimError("k must be an integer and acceptance a number", source="--spec",
                          value=text, has_value=True) from None
    cfg = {"method": "draft" if "draft" in out else "ngram", "k": k, "acceptance": a}
    if "draft" in out:
        cfg["draft_model"] = out["draft"]
    try:
        return SpeculativeConfig.model_validate(cfg).model_dump()
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "speculative"
        raise LatsimError(f"{where}: {err['msg'].removeprefix('Value error, ')}",
                          source="--spec") from None


def spec_report(cm, spec: dict, model_cost, prefill: Optional[tuple],
                decode: tuple) -> dict:
    """The decode step with and without speculative decoding: step ms, and ms per
    output token (the step over the tokens a sequence gets from it: 1, or the i.i.d.
    expectation ``(1 - a^(k+1)) / (1 - a)``)."""
    from simulator.model.speculative import (Speculative, draft_cost_model, expected_tokens,
                                             speculative_cost_error)
    if not hasattr(cm, "verify_time"):
        raise LatsimError(speculative_cost_error("profile"), source="--spec")
    draft = None
    if spec["method"] == "draft":
        draft = _named("--spec", lambda: draft_cost_model(spec["draft_model"], model_cost, cm,
                                                          [Path.cwd()]))
    sp = Speculative(spec["method"], spec["k"], spec["acceptance"], draft, spec["draft_model"])
    chunks = [(prefill[1], 0, True)] * prefill[0] if prefill else []
    nd, ctx = decode
    base = cm.step_time(nd, ctx, nd * ctx, chunks) * 1000.0
    verify = cm.verify_time(nd, sp.k + 1, ctx, nd * ctx, chunks) * 1000.0
    dms = sp.draft_time(nd, ctx, nd * ctx, chunks) * 1000.0
    tokens = expected_tokens(sp.acceptance, sp.k)
    return {**{k: v for k, v in sp.describe().items() if k in (
                "method", "k", "acceptance", "draft_model", "draft_cost")},
            "tokens_per_step": tokens, "verify_ms": verify, "draft_ms": dms,
            "step_ms": verify + dms, "ms_per_token": (verify + dms) / tokens,
            "baseline_step_ms": base, "baseline_ms_per_token": base,
            "speedup": base / ((verify + dms) / tokens)}


def _roofline(model: str, gpu: str, tp: int, pp: int, weight_dtype: str, kv_dtype: str,
              calibrate: Optional[Path]):
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
    spec = _named("--gpu", lambda: catalog.gpu(gpu))
    arch = _named("--model", lambda: model_arch(model, [Path.cwd()]))
    for flag, v in (("--tp", tp), ("--pp", pp)):
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
    return RooflineCostModel(arch, spec, tp, pp, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                             profile=profile, profile_source=src)


def _named(flag: str, lookup):
    """A catalogue lookup whose error names the flag instead of the catalogue field."""
    try:
        return lookup()
    except LatsimError as e:
        raise LatsimError(re.sub(r"^field '[^']*': ", "", str(e)), source=flag) from None


def _measured(profile: Path, kind: str, model: Optional[str]):
    from simulator.cost import load_profile
    from simulator.cost.fitted import FittedCostModel
    from simulator.cost.profile import ProfileCostModel
    if not profile.exists():
        raise LatsimError("file not found", source=str(profile), field="--profile")
    prof = load_profile(profile)
    if model is not None:
        _check_profile_model(prof, model, profile)
    if kind == "fitted":
        return FittedCostModel(prof), prof
    if kind == "profile":
        return ProfileCostModel(prof), prof
    raise LatsimError("must be fitted or profile (roofline: leave --profile out)",
                      source="--kind", value=kind, has_value=True)


def _check_profile_model(prof: dict, model: str, path: Path) -> None:
    """``--model`` with ``--profile``: the profile must be of that model."""
    from simulator.config.model import ModelShape, _profile_model_check
    from simulator.cost.roofline.model import model_arch
    arch = _named("--model", lambda: model_arch(model, [Path.cwd()]))
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


def step_report(cm, prefill: Optional[tuple], decode: Optional[tuple]) -> dict:
    """One step's milliseconds and terms from a cost model (the JSON ``latsim cost``
    prints); the roofline model adds its breakdown and memory plan."""
    chunks = [(prefill[1], 0, True)] * prefill[0] if prefill else []
    nd, ctx = decode if decode else (0, 0)
    out: dict = {"step": {"prefill": {"prompts": prefill[0], "tokens": prefill[1]} if prefill
                          else None,
                          "decode": {"batch": nd, "context": ctx} if decode else None}}
    plan = None
    if hasattr(cm, "memory_plan"):
        # Whether the step fits the GPUs at all, before timing it (a step of a hundred
        # million tokens is refused here, not after minutes of arithmetic).
        plan = cm.memory_plan(max_num_batched_tokens=max(nd + sum(c[0] for c in chunks), 1),
                              max_num_seqs=max(nd + len(chunks), 1))
        if not plan.fits:
            raise LatsimError(plan.reason)
    ms = cm.step_time(nd, ctx, nd * ctx, chunks) * 1000.0
    out["ms"] = ms
    desc = cm.describe()
    if hasattr(cm, "breakdown"):
        b = cm.breakdown(nd, ctx, nd * ctx, chunks)
        out["terms"] = {k: b[k] for k in ("compute", "memory", "communication", "overhead")}
        out["detail"] = {k: v for k, v in b.items()
                         if k not in ("compute", "memory", "communication", "overhead", "ms")}
        out["estimate"] = desc["estimate"]
    if plan is not None:
        need = nd * ctx + sum(c[0] for c in chunks)
        out["memory"] = {"weights_gib_per_gpu": plan.weight_bytes_per_gpu / 2**30,
                         "kv_capacity_tokens": plan.kv_tokens, "step_kv_tokens": need,
                         "fits": plan.fits, "step_fits": plan.fits and need <= plan.kv_tokens,
                         "reason": plan.reason or (
                             "" if need <= plan.kv_tokens else
                             f"this step holds {need:,} tokens of KV, more than the "
                             f"{plan.kv_tokens:,} that fit")}
    if not hasattr(cm, "breakdown"):
        out["estimate"] = f"measured: {desc.get('kind')} model of the profile"
    out["cost_model"] = desc
    return out


def cost(
    model: Optional[str] = typer.Option(None, "--model", help="catalogued model (e.g. "
                                        "llama-2-70b) or a config.json path"),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="catalogued GPU (e.g. a100-80gb)"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel GPUs"),
    pp: int = typer.Option(1, "--pp", help="pipeline stages (no micro-batching)"),
    weight_dtype: str = typer.Option("bf16", "--weight-dtype", help="bf16 | fp16 | fp8 | "
                                     "int8 | int4"),
    kv_dtype: str = typer.Option("bf16", "--kv-dtype", help="bf16 | fp16 | fp8"),
    calibrate: Optional[Path] = typer.Option(None, "--calibrate", help="profile whose rows "
                                             "calibrate the roofline (e.g. one prefill and "
                                             "one decode row)"),
    profile: Optional[Path] = typer.Option(None, "--profile", help="a measured profile: its "
                                           "fitted (or --kind profile) model instead"),
    kind: str = typer.Option("fitted", "--kind", help="with --profile: fitted | profile"),
    prefill: Optional[str] = typer.Option(None, "--prefill", help="NxL: N prompts of L tokens "
                                          "prefilled whole in the step"),
    decode: Optional[str] = typer.Option(None, "--decode", help="B@C: B sequences decoding "
                                         "one token each at context C"),
    spec: Optional[str] = typer.Option(None, "--spec", help="speculative decoding what-if "
                                       "for the --decode step: k=4,acceptance=0.7[,draft="
                                       "llama-3.2-1b] (no draft: n-gram)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Time one engine step (roofline estimate from datasheets, or a profile's model)."""
    pre = parse_prefill(prefill) if prefill is not None else None
    dec = parse_decode(decode) if decode is not None else None
    if pre is None and dec is None:
        raise LatsimError("give the step: --prefill NxL and/or --decode B@C", source="latsim cost")
    sp = parse_spec(spec) if spec is not None else None
    if sp is not None and dec is None:
        raise LatsimError("speculative decoding is a what-if on a decode step: give --decode "
                          "B@C", source="--spec")
    if profile is not None:
        if gpu is not None or calibrate is not None:
            raise LatsimError("--profile times the step with the profile's own model; --gpu "
                              "and --calibrate belong to the roofline (leave --profile out)",
                              source="--profile")
        cm, _ = _measured(profile, kind, model)
        mcost = SimpleNamespace(kind=kind)
    else:
        if kind != "fitted":
            raise LatsimError("chooses the model of a --profile: give --profile", source="--kind",
                              value=kind, has_value=True)
        if model is None or gpu is None:
            raise LatsimError("the roofline needs --model and --gpu (or give --profile)",
                              source="latsim cost")
        cm = _roofline(model, gpu, tp, pp, weight_dtype, kv_dtype, calibrate)
        _check_context(cm.arch, pre, dec)
        mcost = SimpleNamespace(kind="roofline", gpu=cm.spec.name, tp=tp)
    rep = step_report(cm, pre, dec)
    if sp is not None:
        rep["speculative"] = spec_report(cm, sp, mcost, pre, dec)
    if as_json:
        print(json.dumps(rep, default=_jsonable, allow_nan=False))
        return
    print_report(rep)


def _check_context(arch, pre: Optional[tuple], dec: Optional[tuple]) -> None:
    """A step's prompts and decode contexts may not exceed the model's longest context
    (``max_position_embeddings``): no server runs them (one-line error naming the option)."""
    from simulator.cost import catalog
    for opt, tokens, what in (("--prefill", pre[1] if pre else 0, "a prompt of"),
                              ("--decode", dec[1] if dec else 0, "a context of")):
        catalog.check_context(arch, tokens, what, source=opt)


def _jsonable(v):
    if hasattr(v, "item"):
        return v.item()
    if isinstance(v, (set, tuple)):
        return list(v)
    return str(v)


def print_report(rep: dict) -> None:
    """The step as a person reads it."""
    _print_step(rep)
    s = rep.get("speculative")
    if s:
        how = f"draft {s['draft_model']}" if s["method"] == "draft" else "n-gram"
        console.print(f"speculative ({how}, k={s['k']}, acceptance {s['acceptance']:g}): "
                      f"{s['tokens_per_step']:.2f} tokens per step (1 - a^(k+1)) / (1 - a)",
                      highlight=False)
        console.print(f"  step {s['step_ms']:,.2f} ms (verify {s['verify_ms']:,.2f} + draft "
                      f"{s['draft_ms']:,.2f}) vs {s['baseline_step_ms']:,.2f} ms without",
                      highlight=False)
        console.print(f"  per output token [bold]{s['ms_per_token']:,.2f} ms[/] vs "
                      f"{s['baseline_ms_per_token']:,.2f} ms without "
                      f"({s['speedup']:.2f}x)", highlight=False)


def _print_step(rep: dict) -> None:
    d = rep["cost_model"]
    s = rep["step"]
    parts = []
    if s["decode"]:
        parts.append(f"decode {s['decode']['batch']}@{s['decode']['context']}")
    if s["prefill"]:
        parts.append(f"prefill {s['prefill']['prompts']}x{s['prefill']['tokens']}")
    if d.get("kind") == "roofline":
        console.print(f"[bold]{d['model']}[/] on {d['gpus']} x {d['gpu']} (TP{d['tp']} PP{d['pp']}), "
                      f"{d['weight_dtype']} weights, {d['kv_dtype']} KV", highlight=False)
    console.print(f"{rep['estimate']}", style="yellow", highlight=False)
    console.print(f"step {' + '.join(parts)}: [bold]{rep['ms']:,.2f} ms[/]", highlight=False)
    if "terms" not in rep:
        return
    det = rep["detail"]
    console.print(f"  bound by {det['bound']}; device {det['device']:,.2f} ms, host "
                  f"{det['host']:,.2f} ms{' (graph replay)' if det['graph_replay'] else ''}",
                  highlight=False)
    rows = [("compute", rep["terms"]["compute"], f"GEMM FLOPs {det['gemm_compute']:,.2f}, "
             f"prefill attention {det['prefill_attention']:,.2f}"),
            ("memory", rep["terms"]["memory"], f"weights {det['weights']:,.2f}, elementwise "
             f"{det['elementwise']:,.2f}, decode attention {det['decode_attention']:,.2f}"),
            ("communication", rep["terms"]["communication"], f"all-reduce {det['allreduce']:,.2f}"
             f", pipeline sends {det['pipeline_send']:,.2f}"),
            ("overhead", rep["terms"]["overhead"], f"kernel floors and per-step overhead "
             f"{det['floor']:,.2f}, host beyond the device, bookkeeping")]
    for name, v, what in rows:
        console.print(f"  {name:<14}{v:>10,.2f} ms  ({what})", highlight=False)
    console.print("  (each term alone; the linear layers take the soft maximum of their FLOPs "
                  "and weight reads, the step the soft maximum of host and device)", style="dim")
    if d["pp"] > 1:
        console.print(f"  pipeline: {d['pipeline']}; stage {det['stage_ms']:,.2f} ms",
                      highlight=False)
    m = rep["memory"]
    console.print(f"  memory: {m['weights_gib_per_gpu']:,.1f} GiB of weights per GPU, KV for "
                  f"{m['kv_capacity_tokens']:,} tokens", highlight=False)
    if not m["step_fits"]:
        console.print(f"  [yellow]note[/]: {m['reason']}", highlight=False)
    cal = d.get("calibration")
    if cal:
        console.print(f"  calibrated to {cal['source']}: " + ", ".join(
            f"{k} +{v:.3g} ms" if k == "overhead" else f"{k} x{v:.3g}"
            for k, v in cal["scales"].items()) + f" ({cal['why']})", highlight=False)
        for r in cal["rows"]:
            console.print(f"    {r['step']}: measured {r['measured_ms']:,.2f} ms, default "
                          f"{r['default_error']:+.1%}, calibrated {r['calibrated_error']:+.1%}",
                          highlight=False)
