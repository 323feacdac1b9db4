"""``latsim cost``: the time of one engine step on any GPU and model, from the roofline
cost model (datasheets and default efficiencies, optionally calibrated to a measured
profile), or from a measured profile's ``fitted`` or ``profile`` cost model.

A step is given as ``--prefill NxL`` (N prompts of L tokens prefilled whole in one
step) and/or ``--decode B@C`` (B sequences decoding one token each at context C);
both make a mixed step. The answer is the step's milliseconds and its terms
(compute, memory, communication, overhead and the finer ones), as text or one JSON
object (``--json``). ``--steps FILE`` prices many steps with the model set up once
(``simulator.cli.costbatch``; the Python API: ``simulator.cost.step_ms``). User errors
(unknown GPU or model, a TP or PP the model cannot be split into, a model that does not
fit, a malformed step) are one line, exit 2.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from simulator.errors import LatsimError
# simulator.cost.steps (the cost models, numba) is imported where a step is priced:
# ``latsim cost --help`` needs none of it.

console = Console()


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
    from simulator.cost.steps import named
    from simulator.model.speculative import (Speculative, draft_cost_model, expected_tokens,
                                             speculative_cost_error)
    if not hasattr(cm, "verify_time"):
        raise LatsimError(speculative_cost_error("profile"), source="--spec")
    draft = None
    if spec["method"] == "draft":
        draft = named("--spec", lambda: draft_cost_model(spec["draft_model"], model_cost, cm,
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


def step_report(cm, prefill: Optional[tuple], decode: Optional[tuple]) -> dict:
    """One step's milliseconds and terms from a cost model (the JSON ``latsim cost``
    prints); the roofline model adds its breakdown and memory plan."""
    from simulator.cost.steps import check_step, price, step_args
    nd, ctx, _, chunks = step_args(prefill, decode)
    out: dict = {"step": {"prefill": {"prompts": prefill[0], "tokens": prefill[1]} if prefill
                          else None,
                          "decode": {"batch": nd, "context": ctx} if decode else None}}
    plan = check_step(cm, prefill, decode)
    ms = price(cm, prefill, decode)
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
    ep: int = typer.Option(1, "--ep", help="a mixture's expert-parallel GPUs: 1 or tp x dp "
                           "(vLLM --enable-expert-parallel)"),
    dp: int = typer.Option(1, "--dp", help="data-parallel attention ranks (vLLM "
                           "--data-parallel-size, with --ep tp x dp)"),
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
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (with --steps: "
                                 "one per line)"),
    steps: Optional[str] = typer.Option(None, "--steps", help="price many steps: a CSV with "
                                        "prefill and/or decode columns (NxL, B@C), or JSON "
                                        "lines (.jsonl, or - for stdin); one CSV row per "
                                        "step out"),
    out: Optional[Path] = typer.Option(None, "--out", help="with --steps: write the rows to "
                                       "this file instead of stdout"),
    force: bool = typer.Option(False, "--force", help="--out may name an existing file: it is "
                               "replaced"),
    terms: bool = typer.Option(False, "--terms", help="with --steps: add the roofline's terms "
                               "(compute, memory, communication, overhead, bound) to each row"),
) -> None:
    """Time one engine step (roofline estimate from datasheets, or a profile's model)."""
    from simulator.cost.steps import cost_model, parse_decode, parse_prefill
    config = dict(model=model, gpu=gpu, tp=tp, pp=pp, weight_dtype=weight_dtype,
                  kv_dtype=kv_dtype, calibrate=calibrate, profile=profile, kind=kind,
                  ep=ep, dp=dp)
    if steps is not None or out is not None or force or terms:
        from simulator.cli.costbatch import cost_batch
        return cost_batch(steps, out, force, as_json, terms, config,
                          {"--prefill": prefill, "--decode": decode, "--spec": spec})
    pre = parse_prefill(prefill) if prefill is not None else None
    dec = parse_decode(decode) if decode is not None else None
    if pre is None and dec is None:
        raise LatsimError("give the step: --prefill NxL and/or --decode B@C", source="latsim cost")
    sp = parse_spec(spec) if spec is not None else None
    if sp is not None and dec is None:
        raise LatsimError("speculative decoding is a what-if on a decode step: give --decode "
                          "B@C", source="--spec")
    cm = cost_model(**config)
    from simulator.cost.model import cost_class
    # The ``model.cost`` this model is of (unvalidated: the options were checked already),
    # which the draft model asks for its hardware (``CostModel.hardware``).
    mcost = (cost_class(kind).model_construct(kind=kind, path=profile) if profile is not None
             else cost_class("roofline").model_construct(gpu=cm.spec.name, tp=tp))
    rep = step_report(cm, pre, dec)
    if sp is not None:
        rep["speculative"] = spec_report(cm, sp, mcost, pre, dec)
    if as_json:
        print(json.dumps(rep, default=_jsonable, allow_nan=False))
        return
    print_report(rep)


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
        par = f"TP{d['tp']} PP{d['pp']}" + "".join(
            f" {k.upper()}{d[k]}" for k in ("dp", "ep") if d.get(k, 1) > 1)
        console.print(f"[bold]{d['model']}[/] on {d['gpus']} x {d['gpu']} ({par}), "
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
