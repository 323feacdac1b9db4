# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Hardware what-if: step costs on GPUs and models never profiled
#
# The roofline cost model (`simulator.cost.roofline`) is the physics step-cost model
# the fitted profiles use, with its constants taken from the GPU and model catalogues
# (datasheet TFLOP/s, HBM and link bandwidth; layers, heads, widths) and default
# efficiencies calibrated once on measured data: Vidur's per-operator tables for the
# A100 and H100, Vidur's NCCL all-reduce tables, the shipped H200 profiles and two
# published kernel figures. It splits the work of a tensor-parallel replica over its
# GPUs, adds two ring all-reduces per layer, and models pipeline stages without
# micro-batching. Everything it says is an *estimate from datasheets*; two timed rows
# (`calibrate:`) make it a transfer from a measurement.
#
# This notebook shows how far that estimate is from measurements it was never fitted
# to, what a step costs on three GPUs, and latency against load for Llama-2-70B on
# four H100s against four A100s (a `run_sweep` over `model.cost.gpu`).

# %%
from simulator.report.notebook import out_dir, repo_root, show

REPO = repo_root()
OUT = out_dir("hardware_whatif")

# %% [markdown]
# ## Predicted against measured
#
# `roofline.checks.check_tables()` computes every comparison (`benchmarks/hardware_whatif.py`
# prints them all). Vidur's tables held out of the calibration (A100 Llama-3-70B,
# H100 Llama-2-70B) test the GEMM and elementwise terms on models the fit never saw:

# %%
import pandas as pd

from simulator.cost.roofline.checks import check_tables
from simulator.cost.roofline.model import RooflineCostModel

pd.set_option("display.width", 160)
tabs = check_tables()
vid = tabs["vidur"]
print(vid[vid["set"] == "held out"].to_string(index=False))

# %% [markdown]
# Published step times, uncalibrated. The `check` rows are the cleanest (batch-1
# decode and single-prompt prefill, one step each); `calibration` are the two decode
# rows the decode-attention efficiency was fitted to; `other` rows average several
# steps (throughput tables, vLLM's batch-8 runs) or use weight-only int8/int4 kernels
# that do not reach the HBM rate a 16-bit GEMV does.

# %%
print(tabs["published_summary"].to_string(index=False))
pub = tabs["published"]
print(pub[pub["use"] == "check"].drop(columns=["use", "source"]).to_string(index=False))

# %% [markdown]
# The H200 profiles (two eager PyTorch engines, not vLLM-like: one pads decode
# attention, the other pages it in plain PyTorch) from the A100/H100 calibration, then
# after calibrating to two of their rows, then to the whole profile. The GEMM-bound
# prefills carry over; decode attention is each engine's own kernel and needs rows
# that show it.

# %%
h2 = tabs["h200"]
print(h2.drop(columns=["fitted"]).to_string(index=False))

# %% [markdown]
# ## One step on three GPUs
#
# What `latsim cost` prints, as a table: a 2,048-token prefill and a batch of 32
# decodes at context 2,048 for Llama-2-70B at TP4 (TP8 on the L40S, whose 48 GB do
# not hold a quarter of the weights plus a KV cache), with the terms each step is made
# of and which one binds.

# %%
rows = []
for gpu, tp in (("h100-80gb", 4), ("a100-80gb", 4), ("l40s", 8)):
    m = RooflineCostModel("llama-2-70b", gpu, tp)
    for what, (nd, ctx, chunks) in {"prefill 1x2048": (0, 0, [(2048, 0, True)]),
                                    "decode 32@2048": (32, 2048, [])}.items():
        b = m.breakdown(nd, ctx, nd * ctx, chunks)
        rows.append({"gpu": gpu, "tp": tp, "step": what, "ms": b["ms"], "bound": b["bound"],
                     "compute": b["compute"], "memory": b["memory"],
                     "communication": b["communication"], "overhead": b["overhead"]})
print(pd.DataFrame(rows).round(2).to_string(index=False))

# %% [markdown]
# ## Latency against load: four H100s or four A100s?
#
# The same traffic (Poisson arrivals, prompts ~600 tokens, outputs ~120) on one
# replica of Llama-2-70B at TP4, chunked prefill with a 512-token budget; only
# `model.cost.gpu` changes. KV capacity follows each GPU's memory
# (`catalog.plan_memory`). The H100's 1.6x bandwidth and 3x compute move the knee.

# %%
import os
import time

from simulator.planning.sweep import parse_axis, run_sweep
from simulator.report import plots

base = {
    "name": "llama2-70b-tp4", "seed": 5,
    "workload": {"kind": "synthetic", "num_requests": 150,
                 "arrival": {"kind": "poisson", "rate": 1.0},
                 "prompt_tokens": {"kind": "lognormal", "mean": 600, "cv": 0.8, "max": 3000},
                 "output_tokens": {"kind": "lognormal", "mean": 120, "cv": 0.6, "max": 400}},
    "engine": {"policy": "chunked", "max_num_seqs": 64, "max_num_batched_tokens": 512},
    "model": {"name": "llama-2-70b", "cost": {"kind": "roofline", "gpu": "h100-80gb", "tp": 4}},
}
t0 = time.perf_counter()
sweep = run_sweep(base, REPO / "scenarios",
                  [parse_axis("model.cost.gpu=h100-80gb,a100-80gb"), parse_axis("rate=1:7:2")],
                  OUT, seeds=1, workers=min(2, os.cpu_count() or 1), force=True, progress=False)
df = sweep.table
print(f"{len(df)} runs in {time.perf_counter() - t0:.1f} s")
print(df[["model.cost.gpu", "rate", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
          "p99_tpot_ms"]].round(1).to_string(index=False))

# %%
fig = plots.plot_load_curve(df, "rate", "model.cost.gpu", OUT / "load_curve.png")
show(OUT / "load_curve.png")
