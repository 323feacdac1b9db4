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
# # Scheduling policies on a real trace: FIFO vs chunked prefill vs priority with aging
#
# The same ten-minute-scale stretch of the **Azure LLM inference conversation trace**
# (Splitwise, 2023) replayed against one H200 running Llama-3-8B (measured step costs),
# under three scheduling policies:
#
# - `fifo`: vLLM-v0 style; a whole prompt is prefilled in one step, pausing every decode;
# - `chunked`: Sarathi-style chunked prefill; decodes first, then prompts in chunks up to
#   the token budget;
# - `priority_aging`: chunked, admitting by class priority that improves with waiting time.
#
# Every policy sees identical traffic (arrival times and token counts from the trace,
# priority classes drawn by share). The notebook uses the project's Python API
# (`load_scenario`, `simulate`, `run_outputs`, `write_run`) and plots with
# `simulator.report.plots`, reading back the result files a `latsim run --out` would write.

# %%
from simulator.report.notebook import out_dir, repo_root, show

REPO = repo_root()
OUT = out_dir("policy_comparison")


# %% [markdown]
# ## Parameters
#
# `WINDOW` selects seconds of the trace's own clock (the scenario replays the first
# 600 s; the first 300 s keep the notebook quick). The trace is shipped in the
# repository's `data/` folder (`data/azure_llm_2023/`).

# %%
WINDOW = (0, 300)
SEED = None  # None: the scenario's own seed

scenario_file = REPO / "scenarios" / "azure-conv.yaml"
overrides = [f"workload.window=[{WINDOW[0]}, {WINDOW[1]}]"]

from simulator.config.scenario import load_scenario

sc, base = load_scenario(scenario_file, overrides)
policies = sc.policies or ["fifo", "chunked", "priority_aging"]
print(f"{sc.name}: policies {', '.join(policies)}")

# %% [markdown]
# ## Simulate each policy on the same traffic and write the result files

# %%
import time

from simulator.report.files import write_run
from simulator.report.output import run_outputs, series_table
from simulator.loops.simulate import simulate

t0 = time.perf_counter()
outs, tables, series = {}, {}, {}
for p in policies:
    # The workload is drawn from the seed alone, so every policy gets the same requests.
    res = simulate(sc, SEED, base_dir=base, policy=p)
    tables[p], outs[p] = run_outputs(res)
    series[p] = series_table(res)
print(f"{len(res.workload)} requests x {len(policies)} policies simulated in "
      f"{time.perf_counter() - t0:.1f} s")
write_run(OUT, sc, outs, tables, series)
print(f"results in {OUT}")

# %% [markdown]
# ## P50 / P99 at a glance
#
# Read back from the result folder with `simulator.report.plots.load_results`.

# %%
import pandas as pd

from simulator.report.plots import load_results

results = load_results(OUT)
rows = {}
for p, run in results.items():
    s = run.summary["overall"]
    rows[p] = {f"{m.upper()} {q}": s[f"{k}_{m}_ms"] for m in ("ttft", "tpot", "e2el")
               for q, k in (("P50", "median"), ("P99", "p99"))}
    rows[p]["goodput (req/s)"] = s.get("request_goodput")
    rows[p]["diagnosis"] = s["diagnosis"]
table = pd.DataFrame(rows).T
print("latency in ms")
print(table.to_string(float_format=lambda v: f"{v:,.1f}"))

best = table["TTFT P99"].astype(float).idxmin()
print(f"\nlowest P99 TTFT: {best}; lowest P99 TPOT: {table['TPOT P99'].astype(float).idxmin()}")
p0 = {p: run.summary["per_class"].get("P0", {}).get("p99_ttft_ms") for p, run in results.items()}
if all(v is not None for v in p0.values()):
    print("P99 TTFT of the most urgent class P0 (ms): "
          + ", ".join(f"{p} {v:,.0f}" for p, v in p0.items()))

# %% [markdown]
# ## Latency CDFs, overall and per priority class
#
# Logit y axis: the P99 tail is as legible as the median. Circles mark P50, triangles P99.

# %%
from simulator.report import plots

fig = plots.plot_latency_cdfs(results, OUT / "latency_cdfs.png")
show(OUT / "latency_cdfs.png")

# %% [markdown]
# ## Where the time goes: the E2E breakdown at P50 and P99
#
# Each bar is the mean of every stage over the requests ranked within half a
# percentile of P50 (or P99) by end-to-end latency; the bottom row zooms into the
# stages other than decoding. `fifo` prefills a prompt in one step (short T_prefill)
# but each such step pauses every running decode (longer T_decode, higher TPOT) and
# a long prompt holds up the queue; chunked prefill spreads a prompt over several
# steps interleaved with decodes (longer T_prefill, steadier TPOT).

# %%
fig = plots.plot_breakdown(results, OUT / "breakdown.png")
show(OUT / "breakdown.png")

# %% [markdown]
# ## Queue, running batch and KV cache over time

# %%
fig = plots.plot_timeseries(results, OUT / "timeseries.png")
show(OUT / "timeseries.png")

# %% [markdown]
# ## The weighted fair scheduler vs priority with aging, under overload
#
# `fair_score` admits by a design article's score (`data/README.md`), `min(wait / 5 s, 3) x 0.5 +
# VIP + progress x 0.5`; `priority_aging` by `priority - floor(wait / aging_s)`. Both
# keep low classes from starving, differently: aging lets any class catch up with any
# other given time (one class per `aging_s`), the fair score's starvation bonus is
# capped at 1.5 classes. `scenarios/fairness-overload.yaml`: one replica with 16 slots
# takes three classes at 13.5 req/s, past the ~12.7 it serves, so queues build. The table
# gives each class's median and longest wait for a slot (s), and strict priority (aging
# off) for reference.

# %%
import numpy as np

fair, fair_base = load_scenario(REPO / "scenarios" / "fairness-overload.yaml")
waits = {}
for label, run in fair.policy_runs():
    r = simulate(run, base_dir=fair_base)
    w = r.rec.scheduled - r.rec.enqueued
    waits[label] = {f"P{c} {q}": f(w[r.workload.priority == c])
                    for c in range(3) for q, f in (("median", np.nanmedian), ("max", np.nanmax))}
print(pd.DataFrame(waits).T.to_string(float_format=lambda v: f"{v:,.1f}"))
