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
# # An edge node in front of the cluster: result cache and a small model
#
# `scenarios/edge.yaml`: Llama-3-8B on one H200, 1000 km from its clients over the WAN,
# and an edge node 4 ms from them. The same arrivals three ways:
#
# - `no-edge`: every request to the cluster;
# - `cache`: an LRU cache of whole results (prompts Zipf-popular over a catalogue);
#   a hit costs the edge RTT and its stream time, no engine work;
# - `cache+draft`: the cache, then Llama-3.2-1B on edge L4 GPUs (priced by the roofline
#   cost model) answers; a share of its answers is escalated to the central model
#   (edge time + WAN + central).
#
# It prints P50/P99 with and without the edge, the cache's hit ratio beside what the
# popularity law says (Che's approximation for LRU), the escalation ratio and the
# GPU-seconds the edge took off the cluster, and plots the latency CDFs.

# %%
from simulator.report.notebook import out_dir, repo_root, show

REPO = repo_root()
OUT = out_dir("edge")
N = 600   # requests (the scenario has 1200; half keeps the notebook quick)

# %%
import pandas as pd

from simulator.config.scenario import load_scenario
from simulator.loops.simulate import simulate
from simulator.report.files import write_run
from simulator.report.output import run_outputs, series_table

sc, base = load_scenario(REPO / "scenarios" / "edge.yaml", [f"workload.num_requests={N}"])
outs, tables, series, busy = {}, {}, {}, {}
for label, run in sc.policy_runs():
    res = simulate(run, base_dir=base)
    tables[label], outs[label] = run_outputs(res)
    series[label] = series_table(res)
    # GPU-seconds the cluster's replicas were busy stepping (the engine's own tally).
    busy[label] = res.rec.step_time_total * run.cluster.gpus_per_replica
write_run(OUT, sc, outs, tables, series)

rows = {}
for label, s in outs.items():
    o, e = s["overall"], s.get("edge") or {}
    rows[label] = {"TTFT P50": o["median_ttft_ms"], "TTFT P99": o["p99_ttft_ms"],
                   "E2EL P50": o["median_e2el_ms"], "E2EL P99": o["p99_e2el_ms"],
                   "hit ratio": (e.get("cache") or {}).get("hit_ratio"),
                   "escalated": (e.get("speculation") or {}).get("escalation_ratio"),
                   "to cluster": e.get("sent_to_cluster", N),
                   "cluster busy GPU-s": busy[label],
                   "saved (alone)": e.get("saved_gpu_s"),
                   "saved (run rate)": e.get("saved_gpu_s_at_run_rate"),
                   "edge GPU-s": (e.get("speculation") or {}).get("edge_gpu_s")}
table = pd.DataFrame(rows).T
print("latency in ms")
print(table.to_string(float_format=lambda v: f"{v:,.2f}"))
# What the edge took off the cluster, measured: the busy GPU-seconds without it less
# with it. Far less than either estimate: a continuously batching replica steps as long
# as any request runs, and its step time is mostly a fixed cost per step (the fitted
# cost model's constant term: ``latsim fit``), so fewer requests make smaller batches,
# hardly fewer steps. What the edge
# frees is batch room (lower TPOT for the rest, headroom for more traffic or fewer
# replicas: ``latsim plan``), not busy time of a fleet this size. "saved (alone)" prices
# each answered request alone on a replica (an upper bound), "saved (run rate)" at the
# run's busy GPU-seconds per request.
for label in busy:
    print(f"{label}: cluster busy {busy[label]:,.0f} GPU-s, "
          f"{busy['no-edge'] - busy[label]:,.0f} fewer than without the edge")

# %% [markdown]
# ## The hit ratio against the popularity law
#
# The TTL (an hour) outlasts the run, so the popularity law applies. A short run from a
# cold cache may never fill it (fewer distinct prompts than its capacity): then it never
# evicts, and the exact expectation of an unbounded cache, 1 - E[distinct] / N, is the
# one to compare with; Che's approximation is the LRU cache's steady state, which a
# long run approaches from below.

# %%
c = outs["cache"]["edge"]["cache"]
law = c["expected_hit_ratio"]
print(f"measured {c['hit_ratio']:.3f} over {N} requests, {c['distinct_prompts']} distinct "
      f"prompts, capacity {c['capacity']}; law: never evicting {law['no_eviction']:.3f}, "
      f"LRU steady state (Che) {law['lru_che']:.3f}")

# %% [markdown]
# ## Latency CDFs with and without the edge

# %%
from simulator.report import plots
from simulator.report.plots import load_results

fig = plots.plot_latency_cdfs(load_results(OUT), OUT / "latency_cdfs.png")
show(OUT / "latency_cdfs.png")
