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
# # A mixture of experts on one 8 x H100 server: TP8 vs expert parallelism vs DP attention
#
# `scenarios/moe-ep.yaml`'s model, Qwen3-30B-A3B (128 experts, top-8, 48 layers, 4 KV
# heads), on H100s with roofline step costs from the datasheets, under long-context
# traffic (prompts ~6,000 tokens, outputs ~500) at 20 requests/s, up to 1,024 requests in
# flight per replica. Five ways to lay the replica out (vLLM's flags):
#
# - **TP8**: `-tp 8`, every expert cut over 8 GPUs. 8 GPUs but only 4 KV heads: each KV
#   head (its cache too) is copied onto 2 GPUs.
# - **TP8 EP8**: `-tp 8 --enable-expert-parallel`: 16 whole experts a GPU, an all-to-all
#   each way per MoE layer instead of the MoE layer's all-reduce; the same KV.
# - **TP4 EP4**: `-tp 4 --enable-expert-parallel` on 4 GPUs (half the server).
# - **TP4 x DP2 EP8**, **TP2 x DP4 EP8**: `-tp 4 -dp 2` / `-tp 2 -dp 4` with
#   `--enable-expert-parallel`: 2 or 4 attention ranks each caching their own requests'
#   KV, no KV head copied, the experts over all 8 GPUs; about twice TP8's KV capacity.
#
# The DP ranks are modelled as balanced (each step split evenly, every rank padded to
# the slowest one's tokens for the MoE layers: README, *Data-parallel attention*).

# %%
import copy
import time

import numpy as np
import yaml

from simulator.config.scenario import validate_scenario
from simulator.loops.simulate import simulate
from simulator.report.notebook import out_dir, repo_root, show
from simulator.report.output import run_outputs
from simulator.workload import build_workload

REPO = repo_root()
OUT = out_dir("moe_ep")
OUT.mkdir(parents=True, exist_ok=True)
BASE_DIR = REPO / "scenarios"

base = yaml.safe_load((BASE_DIR / "moe-ep.yaml").read_text())
base["workload"].update(
    num_requests=1500, arrival={"kind": "poisson", "rate": 20.0},
    prompt_tokens={"kind": "lognormal", "mean": 6000, "cv": 0.6, "max": 16000},
    output_tokens={"kind": "lognormal", "mean": 500, "cv": 0.6, "max": 1500})
base["engine"]["max_num_seqs"] = 1024          # the replica's (4 ranks x 256 at DP4)
CONFIGS = {"TP8": dict(tp=8), "TP8 EP8": dict(tp=8, ep=8), "TP4 EP4": dict(tp=4, ep=4),
           "TP4 x DP2 EP8": dict(tp=4, dp=2, ep=8), "TP2 x DP4 EP8": dict(tp=2, dp=4, ep=8)}

# %% [markdown]
# ## Run the five layouts on the same requests

# %%
scenarios = {}
for label, cfg in CONFIGS.items():
    d = copy.deepcopy(base)
    d["model"]["cost"] = {"kind": "roofline", "gpu": "h100-80gb", **cfg}
    scenarios[label] = validate_scenario(d, source=label, base_dir=BASE_DIR)
first = next(iter(scenarios.values()))
# The same requests for every run: the workload is drawn once from the seed.
wl = build_workload(first.workload,
                    np.random.default_rng(np.random.SeedSequence(first.seed).spawn(4)[0]),
                    BASE_DIR)
t0 = time.perf_counter()
results = {}
for label, sc in scenarios.items():
    # SimPy for all five (EP runs only there), so no run waits for the compiled loop.
    results[label] = simulate(sc, base_dir=BASE_DIR, workload=wl, loop="simpy")
print(f"{len(wl)} requests x {len(results)} layouts simulated in "
      f"{time.perf_counter() - t0:.1f} s")

# %% [markdown]
# ## P50/P99 TTFT and TPOT, KV capacity and throughput

# %%
import pandas as pd

rows, tables = {}, {}
for label, res in results.items():
    tables[label], out = run_outputs(res)
    s = out["overall"]
    gpus = scenarios[label].cluster.gpus_per_replica
    rows[label] = {"GPUs": gpus, "KV capacity (M tokens)": res.kv_capacity_tokens / 1e6,
                   "TTFT P50": s["median_ttft_ms"], "TTFT P99": s["p99_ttft_ms"],
                   "TPOT P50": s["median_tpot_ms"], "TPOT P99": s["p99_tpot_ms"],
                   "output tok/s": s["output_throughput"],
                   "output tok/s per GPU": s["output_throughput"] / gpus}
table = pd.DataFrame(rows).T
print(table.round(2).to_string())
table.to_csv(OUT / "moe_ep.csv")

# %% [markdown]
# What the table says: TP8 and TP8 EP8 hold the same KV (each KV head twice), and at
# this load their caches fill: requests wait for memory, TTFT climbs to seconds. EP8 at
# TP8 is a little slower per step here (48 all-to-alls each way at NCCL's latency,
# against the all-reduce they replace). DP attention doubles the KV the same 8 GPUs
# hold, so the batch grows instead of queueing: TTFT stays in the hundreds of ms and
# throughput is higher; TP2 x DP4 also cuts the attention's all-reduces to 2 GPUs.
# TP4 EP4 on half the server makes the most tokens per GPU but saturates first. The
# balanced split is the DP layouts' best case: a real rank holds a long prompt's chunk
# whole while the others wait for it at the MoE layers, so their prefill is slower.

# %% [markdown]
# ## Latency CDFs of the five layouts

# %%
from simulator.report import plots

fig = plots.plot_latency_cdfs(tables, OUT / "latency_cdfs.png")
show(OUT / "latency_cdfs.png")
