"""Where the roofline's default efficiencies come from: recomputing ``DEFAULTS`` from the
data (``calibrate_defaults``), and how well they predict the tables.

- The GEMM terms (efficiency, the half-efficiency work, weight streaming, the
  weight-read/FLOP sharpness, a per-GEMM floor) are a robust fit (``solve``) of log
  errors over Vidur's per-operator MLP tables of four (device, model) pairs
  (``VIDUR_TRAIN``), the elementwise passes and floor a linear least-squares fit of
  relative errors over the same tables (``fit_vidur``); two pairs are held out
  (``vidur_check``).
- The all-reduce latency and link efficiency of each family: a linear fit to Vidur's
  NCCL tables of one node (``fit_allreduce``, ``allreduce_check``).
- Flash attention: the H200 reference profile's fit (Hopper) and a published A100
  benchmark (Ampere); host launch costs from the two H200 profiles' fits.
- ``e_decode``: where the roofline meets the published KV-bound decode rows
  (``DECODE_CALIBRATION_ROWS``, ``data/published-step-times.csv``).
- vLLM's custom all-reduce: a line through a published benchmark (``fit_custom_allreduce``).
- vLLM's piecewise CUDA graphs: the cost of one more graph piece, from a published
  piecewise / full comparison (``piecewise_piece_us``).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np

from simulator.cost import REPO_ROOT, catalog
from simulator.cost import physics as ph
from simulator.cost.catalog import GpuSpec, ModelArch
from simulator.cost.fit import HARDWARE, error_stats
from simulator.cost.roofline.constants import Engine, build_constants, has_rotary
from simulator.cost.roofline.defaults import DEFAULTS, SOLVE
from simulator.cost.solve import solve

# Vidur tables (device, catalogue model): the ones the GEMM and elementwise terms are
# fitted to, and the ones held out to measure how they predict a table never seen.
VIDUR_TRAIN = (("a100", "llama-2-7b"), ("a100", "llama-2-70b"), ("a100", "llama-3-8b"),
               ("h100", "llama-2-7b"))
VIDUR_HELD_OUT = (("a100", "llama-3-70b"), ("h100", "llama-2-70b"))
VIDUR_MAX_TOKENS = 8192
# Published decode steps whose KV reads are most of the step (batch 60-112 at a mean
# context of 1,152 on Llama-2-7B, 32 KV heads): what ``e_decode`` is fitted to.
DECODE_CALIBRATION_ROWS = (("llama-2-7b", "a100-80gb", 60), ("llama-2-7b", "h100-80gb", 112))
# A100 FlashAttention-2 forward, causal, head_dim 128, one 4,096-token sequence, 32
# heads: 156.27 TFLOP/s (liangan1/GPU_travel, performance/flash-attn/README.md), of the
# A100's 312 dense.
FA2_A100_CAUSAL_TFLOPS = 156.27
REFBENCH = "profiles/h200-llama3-8b-refbench.json"
REAL_ENGINE = "profiles/h200-llama3-8b.json"
# The refbench machine's measured bf16 matmul and device-to-device copy (data/h200-refbench).
H200_MEASURED_TFLOPS = HARDWARE["H200"]["peak_tflops"]
H200_MEASURED_GBS = HARDWARE["H200"]["hbm_gbs"]


def vidur_points(pairs=VIDUR_TRAIN, root=None) -> list[dict]:
    """Vidur's per-layer GEMM and elementwise times (ms) for each (device, model, TP):
    ``{device, model, gpu, arch, tp, tokens, gemm_ms, elem_ms}``."""
    from simulator.cost.catalog import vidur
    out = []
    for dev, name in pairs:
        for tp, t in sorted(vidur.read_mlp(dev, name, root=root).items()):
            keep = t.tokens <= VIDUR_MAX_TOKENS
            elem = np.sum([t.ops[o] for o in ("input_layernorm", "post_attention_layernorm",
                                              "attn_rope", "mlp_act", "add")], axis=0)
            out.append({"device": dev, "model": name, "gpu": catalog.gpu(vidur.DEVICES[dev]),
                        "arch": catalog.model(name), "tp": tp,
                        "tokens": t.tokens[keep].astype(float),
                        "gemm_ms": t.gemm_ms()[keep], "elem_ms": elem[keep]})
    return out


def vidur_gemm_ms(eff: dict, arch: ModelArch, spec: GpuSpec, tp: int,
                  tokens: np.ndarray) -> np.ndarray:
    """The physics' time (ms) of one layer's four GEMMs on one GPU of a TP group, as
    Vidur times them: ``linear_times`` without the LM head, plus their floor."""
    c = build_constants(arch, spec, tp, eff=eff)
    L = c[ph.C_LAYERS]
    out = np.empty(len(tokens))
    for i, T in enumerate(tokens):
        t_w, t_f = ph.linear_times(c, float(T), 0.0)
        out[i] = ph.pnorm(t_w, t_f, c[ph.C_P_GEMM]) / L
    return out + eff["gemm_floor_us"] * 1e-3


def _elem_features(arch: ModelArch, spec: GpuSpec, tp: int, tokens: np.ndarray) -> np.ndarray:
    """Per-token-pass milliseconds of the three elementwise groups of one layer (norms
    and residual add over ``d_model``, rotary over q and k, SiLU-and-mul over the FFN
    width) at the datasheet bandwidth, and a column of ones for the floor."""
    per_pass = tokens * 2.0 / (spec.memory_bw_gbs * 1e6)     # 2-byte elements, ms per element
    rope = (arch.heads + arch.kv_heads) * arch.head_dim / tp if has_rotary(arch) else 0.0
    return np.column_stack([per_pass * arch.hidden, per_pass * rope,
                            per_pass * arch.ffn / tp, np.ones_like(tokens)])


def vidur_elem_ms(eff: dict, arch: ModelArch, spec: GpuSpec, tp: int,
                  tokens: np.ndarray) -> np.ndarray:
    """The physics' elementwise time (ms) of one layer on one GPU (``act_ms`` without
    the K/V writes, which Vidur times with attention), plus its floor."""
    X = _elem_features(arch, spec, tp, tokens)
    return X @ np.array([eff["act_passes_repl"], eff["act_passes_rope"], eff["act_passes_ffn"],
                         eff["elem_floor_us"] * 1e-3])


GEMM_HUBER = 0.05       # log error beyond which a Vidur point pulls less
# Fitted: the compute efficiency, the weight reads of the two memory technologies the
# tables were measured on (A100 HBM2e, H100 HBM3) and the per-layer floor; ``p_gemm``
# and the tiles are held at DEFAULTS' (defaults module doc).
GEMM_PARAMS = (("e_gemm", 0.7, 0.2, 1.0), ("e_weights_hbm2e", 0.8, 0.2, 1.0),
               ("e_weights_hbm3", 0.8, 0.2, 1.0), ("gemm_floor_us", 5.0, 0.01, 200.0))


def fit_vidur(points: list[dict]) -> dict:
    """The GEMM terms (a robust fit of log errors over every point) and the elementwise
    passes and floor (a linear least-squares fit of relative errors) to Vidur tables."""
    base = dict(DEFAULTS)
    names = [p[0] for p in GEMM_PARAMS]
    lo = np.log([p[2] for p in GEMM_PARAMS])
    hi = np.log([p[3] for p in GEMM_PARAMS])

    def resid(x):
        eff = {**base, **dict(zip(names, np.exp(x)))}
        return np.concatenate([np.log(vidur_gemm_ms(eff, p["arch"], p["gpu"], p["tp"], p["tokens"])
                                      / p["gemm_ms"]) for p in points])

    x = solve(resid, np.log([p[1] for p in GEMM_PARAMS]), lo, hi, huber=GEMM_HUBER,
              **SOLVE).x
    out = dict(zip(names, (float(v) for v in np.exp(x))))
    X = np.vstack([_elem_features(p["arch"], p["gpu"], p["tp"], p["tokens"]) / p["elem_ms"][:, None]
                   for p in points])
    y = np.ones(len(X))
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    coef = np.maximum(coef, 0.0)
    out.update(act_passes_repl=float(coef[0]), act_passes_rope=float(coef[1]),
               act_passes_ffn=float(coef[2]), elem_floor_us=float(coef[3] * 1e3))
    return out


def vidur_check(eff: Optional[dict] = None, pairs=VIDUR_HELD_OUT, root=None) -> list[dict]:
    """Predicted against measured per-layer GEMM and GEMM + elementwise times of Vidur
    tables, per (device, model, TP): error statistics of ``predicted / measured - 1``."""
    eff = DEFAULTS if eff is None else eff
    rows = []
    for p in vidur_points(pairs, root):
        g = vidur_gemm_ms(eff, p["arch"], p["gpu"], p["tp"], p["tokens"])
        e = vidur_elem_ms(eff, p["arch"], p["gpu"], p["tp"], p["tokens"])
        rows.append({"device": p["device"], "model": p["model"], "tp": p["tp"],
                     "points": len(p["tokens"]),
                     "gemm": error_stats(g / p["gemm_ms"] - 1.0),
                     "layer": error_stats((g + e) / (p["gemm_ms"] + p["elem_ms"]) - 1.0)})
    return rows


AR_NODES = {"a100_dgx": "a100-80gb", "h100_dgx": "h100-80gb"}
AR_NODE_ARCH = {"a100_dgx": "ampere", "h100_dgx": "hopper"}


def allreduce_points(root=None) -> list[dict]:
    """Vidur's NCCL all-reduce times inside one node: ``{node, gpu, n, bytes, ms}``."""
    from simulator.cost.catalog import vidur
    out = []
    for node, g in AR_NODES.items():
        for (n, per_node), t in sorted(vidur.read_collective(node, root=root).items()):
            if n == per_node and n > 1:
                out.append({"node": node, "gpu": catalog.gpu(g), "n": n,
                            "bytes": t.size_bytes.astype(float), "ms": t.ms})
    return out


def allreduce_ms(lat_us: float, e_link: float, spec: GpuSpec, n: int,
                 nbytes: np.ndarray) -> np.ndarray:
    """The physics' all-reduce (``comm_times``): latency plus a ring's ``2 (n - 1) / n``
    of the message over the link at ``e_link`` of its one-way datasheet rate."""
    return lat_us * 1e-3 + 2.0 * (n - 1) / n * nbytes / (spec.link_gbs_unidir * e_link) * 1e-6


def fit_allreduce(points: list[dict]) -> tuple[float, float]:
    """``(latency µs, link efficiency)`` fitted to all-reduce points (relative errors)."""
    X = np.vstack([np.column_stack([np.ones_like(p["bytes"]),
                                    2.0 * (p["n"] - 1) / p["n"] * p["bytes"]
                                    / p["gpu"].link_gbs_unidir * 1e-6]) / p["ms"][:, None]
                   for p in points])
    a, b = np.linalg.lstsq(X, np.ones(len(X)), rcond=None)[0]
    return float(a * 1e3), float(1.0 / b)


def allreduce_check(eff: Optional[dict] = None, root=None) -> list[dict]:
    """Predicted against measured all-reduce times per node and GPU count: with the
    terms ``eff`` holds for that node's family (default ``DEFAULTS``), and with terms
    fitted to the *other* node only (how far one family's terms carry to another);
    ``large``: messages of 8 MiB and more (a long prefill's)."""
    eff = DEFAULTS if eff is None else eff
    pts = allreduce_points(root)
    rows = []
    for p in pts:
        fam = AR_NODE_ARCH[p["node"]]
        own = (eff[f"ar_lat_us_{fam}"], eff[f"e_link_{fam}"])
        other = fit_allreduce([q for q in pts if q["node"] != p["node"]])
        err = allreduce_ms(*own, p["gpu"], p["n"], p["bytes"]) / p["ms"] - 1.0
        rows.append({"node": p["node"], "n": p["n"], "points": len(p["ms"]),
                     "default": error_stats(err), "large": error_stats(err[p["bytes"] >= 8 * 2**20]),
                     "other_node": error_stats(allreduce_ms(*other, p["gpu"], p["n"], p["bytes"])
                                          / p["ms"] - 1.0)})
    return rows


def profile_fit(path: str):
    """The fit of a shipped profile's rows (``fitted_constants``), by its path in the
    repository. The rows' own fit, not a calibration stored beside it: a calibration on
    serving runs adds the engine's host work around a step (building its inputs), while
    the datasheet defaults describe the kernels as a profile times them."""
    from simulator.cost.fitted import fitted_constants
    from simulator.cost.profile import load_profile
    prof = load_profile(REPO_ROOT / path)
    if "calibrated" in str(((prof.get("meta") or {}).get("fit") or {}).get("source", "")):
        prof["meta"].pop("fit")
    return fitted_constants(prof)


def published_rows(path=None) -> list[dict]:
    """``data/published-step-times.csv`` as dicts (numbers parsed)."""
    import csv
    p = Path(path) if path else REPO_ROOT / "data" / "published-step-times.csv"
    with open(p, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in ("tp", "pp", "batch", "prompt_or_context"):
            r[k] = int(r[k])
        r["ms"] = float(r["ms"])
        r["weight_dtype"], r["kv_dtype"] = _published_dtypes(r["notes"])
    return rows


def _published_dtypes(notes: str) -> tuple[str, str]:
    """The weight and KV formats a published row's notes state (``fp8 weights, fp8
    KV``, ``fp8;`` (both), ``fp8 (NIM ...)`` (weights), ``int8``/``int4`` weight-only,
    else 16 bits)."""
    n = notes.lower()
    for head, fmts in (("fp8 weights, fp8 kv", ("fp8", "fp8")), ("fp8;", ("fp8", "fp8")),
                       ("fp8 (", ("fp8", "bf16")), ("int8", ("int8", "bf16")),
                       ("int4", ("int4", "bf16"))):
        if n.startswith(head):
            return fmts
    return "bf16", "bf16"


# Published rows measured on vLLM, whose small all-reduces run vLLM's custom kernel
# (``custom_allreduce_terms``). The other engines' rows keep the NCCL tables' terms:
# gpt-fast (torch.distributed) and lmdeploy's TurboMind v0.1.0a1 use NCCL; TensorRT-LLM
# (v0.5 / v0.6.1 pages, and NIM) has a custom all-reduce of its own whose default and
# cost over those versions are not modelled here (priced as vLLM's, NIM's two batch-1
# decode rows go from -0.2% / -3.0% to -13.8% / -16.5%).
CUSTOM_ALLREDUCE_SOURCES = ("vLLM",)


def published_step_ms(row: dict, eff: Optional[dict] = None) -> float:
    """The roofline's step time (ms) for a published row, uncalibrated: a decode row is
    ``batch`` decodes at its context; a prefill row one prompt of that many tokens, with
    the row's engine's all-reduce (``CUSTOM_ALLREDUCE_SOURCES``)."""
    engine = Engine(custom_allreduce=row["source"].startswith(CUSTOM_ALLREDUCE_SOURCES))
    c = build_constants(catalog.model(row["model"]), catalog.gpu(row["gpu"]), row["tp"],
                        row["pp"], row["weight_dtype"], row["kv_dtype"], engine=engine,
                        eff=eff)
    return step_of(c, row["kind"], row["batch"], row["prompt_or_context"])


def step_of(c: np.ndarray, kind: str, batch: int, tokens: int) -> float:
    """``step_ms`` of ``batch`` prompts of ``tokens`` prefilled whole (``prefill``) or of
    ``batch`` decodes at context ``tokens`` (``decode``)."""
    if kind == "prefill":
        chunks = [(tokens, 0, True)] * batch
        return float(ph.step_breakdown(c, 0, 0, 0, chunks)["ms"])
    return float(ph.step_breakdown(c, batch, tokens, batch * tokens, [])["ms"])


def calibrate_defaults(root=None) -> dict:
    """Recompute ``DEFAULTS`` from the data (module doc): returns the efficiencies and
    overheads, rounded as ``DEFAULTS`` stores them."""
    eff = dict(DEFAULTS)
    eff.update(fit_vidur(vidur_points(VIDUR_TRAIN, root)))
    ar = allreduce_points(root)
    for node, fam in AR_NODE_ARCH.items():
        eff[f"ar_lat_us_{fam}"], eff[f"e_link_{fam}"] = fit_allreduce(
            [p for p in ar if p["node"] == node])
    ref = profile_fit(REFBENCH)
    real = profile_fit(REAL_ENGINE)
    eff["e_flash_hopper"] = float(ref.c[ph.C_E_FLASH] * H200_MEASURED_TFLOPS
                                  / catalog.gpu("h200").bf16_tflops)
    eff["e_flash_ampere"] = FA2_A100_CAUSAL_TFLOPS / catalog.gpu("a100-80gb").bf16_tflops
    eff["e_weights_hbm3e"] = H200_MEASURED_GBS / catalog.gpu("h200").memory_bw_gbs
    layers = 32     # both H200 engines run the Llama-3-8B shape
    eff["h_layer_ms"] = float(ref.c[ph.C_H_STEP] + ref.c[ph.C_H_CHUNK]) / layers
    eff["h_decode_layer_ms"] = float(ref.c[ph.C_H_DECODE]) / layers
    eff["h_graph_ms"] = float(real.c[ph.C_H_GRAPH])
    eff["p_step"] = float(real.c[ph.C_P_STEP])
    eff["p_attn"] = float(ref.c[ph.C_P_ATTN])
    eff = {k: _round(v) for k, v in eff.items()}
    eff["ca_lat_us"], eff["e_link_ca"] = (_round(v) for v in fit_custom_allreduce())
    eff["e_decode"] = _round(_fit_decode_efficiency(eff))
    eff["h_piece_us"] = _round(piecewise_piece_us())
    return eff


def _fit_decode_efficiency(eff: dict) -> float:
    """``e_decode`` at which the roofline meets the published KV-bound decode rows
    (``DECODE_CALIBRATION_ROWS``; geometric mean of the per-row solutions)."""
    rows = [r for r in published_rows() if r["kind"] == "decode"
            and (r["model"], r["gpu"], r["batch"]) in DECODE_CALIBRATION_ROWS]
    sols = []
    for r in rows:
        lo, hi = math.log(0.05), math.log(1.0)
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            ms = published_step_ms(r, {**eff, "e_decode": math.exp(mid)})
            lo, hi = (mid, hi) if ms > r["ms"] else (lo, mid)
        sols.append(0.5 * (lo + hi))
    return float(math.exp(sum(sols) / len(sols)))


# vLLM's custom all-reduce on 4 H100 SXM (bf16, hidden 8192, ``ca_1stage``, times per
# all-reduce in a CUDA graph): vLLM PR #24111's benchmark_device_communicators table,
# (MiB, µs).
CUSTOM_AR_H100_TP4 = ((0.5, 10.0), (1.0, 15.0), (1.5, 19.0), (2.0, 22.0), (3.0, 30.0),
                      (4.0, 38.0))


def fit_custom_allreduce(points=CUSTOM_AR_H100_TP4, gpu: str = "h100-80gb",
                         n: int = 4) -> tuple[float, float]:
    """``(ca_lat_us, e_link_ca)``: the least-squares line through the published custom
    all-reduce times, its slope read as the ring volume ``2 (n - 1) / n x bytes`` moved
    at that fraction of the GPU's one-way link bandwidth."""
    x = np.array([p[0] for p in points]) * 2**20
    y = np.array([p[1] for p in points])
    slope, lat = np.polyfit(x, y, 1)                      # µs per byte, µs
    gbs = 2.0 * (n - 1) / n / (slope * 1e-6) / 1e9        # the ring volume's rate
    return float(lat), float(gbs / catalog.gpu(gpu).link_gbs_unidir)


# vLLM PR #51167 (NickLucche, "Voxtral Realtime: add support for FULL_DECODE_ONLY";
# single H200, Voxtral-Mini-4B-Realtime-2602, max_num_seqs=4, 209 output tokens, 3
# iterations averaged; read in the PR's description): the same run under piecewise CUDA
# graphs and under full graphs, (seconds per run, cudaGraphLaunch calls per run). One
# request at a time: the table's 181.7 and 191.1 tok/s are 209 tokens over each latency.
# The quotient is host time per extra piece only while the GPU waits on the host in both
# runs: at batch 1 a step takes 5.2 ms, a 4B model's bf16 weights (~8 GB) read in ~1.7 ms
# at 4.8 TB/s; where device time hid part of the pieces' host work, it is a lower bound.
PIECEWISE_RUN = (1.150, 12_272)
FULL_GRAPH_RUN = (1.093, 208)


def piecewise_piece_us(piecewise=PIECEWISE_RUN, full=FULL_GRAPH_RUN) -> float:
    """What one more graph piece costs a step (µs): the run's extra time over its extra
    graph launches (each piece's launch plus the eager attention call before it)."""
    return (piecewise[0] - full[0]) / (piecewise[1] - full[1]) * 1e6


def _round(v: float) -> float:
    """Four significant digits: what ``DEFAULTS`` stores."""
    return float(f"{v:.4g}")
