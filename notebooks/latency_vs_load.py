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
# # Latency against offered load, and where the knee is
#
# Capacity planning asks: *how much traffic can this deployment take before the tail
# blows up?* This notebook sweeps the arrival rate of the synthetic
# `policies-compare` scenario (Llama-3-8B on one H200, ShareGPT-like lengths, three
# priority classes) under each scheduling policy with `simulator.planning.sweep.run_sweep`
# (what `latsim sweep` runs), then plots P50/P99 TTFT and TPOT against load with
# `simulator.report.plots.plot_load_curve`.
#
# **The knee** is the lowest swept load at which P99 TTFT exceeds `KNEE_FACTOR` (3x)
# its value at the lowest load swept: past it, queueing rather than compute sets the
# tail. Each run has a fixed number of requests, so beyond saturation the queue grows
# for the whole run and the latencies there depend on the run's length; the knee does not.

# %%
import os

from simulator.report.notebook import out_dir, repo_root, show

REPO = repo_root()
OUT = out_dir("latency_vs_load")


# %% [markdown]
# ## Parameters

# %%
SCENARIO = REPO / "scenarios" / "policies-compare.yaml"
OVERRIDES = ["workload.num_requests=300"]  # small runs keep the sweep to seconds
RATES = "rate=1:12:1"  # req/s; `rate` is the synthetic workload's workload.arrival.rate
SEEDS = 2  # the seeds' min-max is shaded around the mean
KNEE_FACTOR = 3.0
WORKERS = min(2, os.cpu_count() or 1)

# %% [markdown]
# ## Run the sweep
#
# The scenario lists three policies, so the sweep adds an `engine.policy` axis: every
# (rate, policy, seed) is one simulation, one row of `results.csv`.

# %%
import time

from simulator.config.scenario import read_yaml
from simulator.config.yamlfile import apply_overrides
from simulator.planning.sweep import parse_axis, run_sweep

base = apply_overrides(read_yaml(SCENARIO), OVERRIDES)
t0 = time.perf_counter()
sweep = run_sweep(base, SCENARIO.parent, [parse_axis(RATES)], OUT, seeds=SEEDS,
                  workers=WORKERS, force=True, progress=False)
df = sweep.table
print(f"{len(df)} runs in {time.perf_counter() - t0:.1f} s -> {sweep.path}")
print(df[["rate", "engine.policy", "seed", "offered_rate", "median_ttft_ms", "p99_ttft_ms",
          "p99_tpot_ms"]].head(8).to_string(index=False, float_format=lambda v: f"{v:,.1f}"))

# %% [markdown]
# ## Latency vs load, knee marked

# %%
from simulator.report import plots

x, group, _ = plots.sweep_axes(df)
fig = plots.plot_load_curve(df, x, group, OUT / "load_curve.png", knee_factor=KNEE_FACTOR)
show(OUT / "load_curve.png")

knees = plots.load_knees(df, x, group, KNEE_FACTOR)
for policy, knee in knees.items():
    print(f"{policy:>15}: knee at " + (f"{knee:g} req/s" if knee is not None
                                        else "no knee within the swept loads"))

# %% [markdown]
# ## The same picture from the result folder
#
# `latsim report` (and `simulator.report.plots.plot_run`) finds the sweep table in the folder
# and writes the same plot; this is what a CI job or a script would call.

# %%
for png in plots.plot_run(OUT):
    print(png)
