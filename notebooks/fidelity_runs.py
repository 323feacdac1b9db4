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
# # Fidelity on recorded H200 runs: old table model vs fitted vs calibrated
#
# `data/h200-refbench/runs/` holds two recorded serving runs of the H200 reference
# engine (Llama-3-8B shape): `load50-fifo` (whole-prompt prefill, ~50% load) and
# `load90-chunked` (chunked prefill with a 512-token budget, ~90% load). Each run's
# trace is replayed by the simulator with that engine's serving settings
# (`scenarios/refbench-<run>.yaml`) under three step-cost models:
#
# - **old table**: interpolation in the profile's measured rows (`kind: profile`),
#   fed the plain conversion of `data/h200-refbench/profile.csv`;
# - **fitted**: the physics model fitted to the same rows (`kind: fitted`), nothing
#   else;
# - **calibrated**: the shipped `profiles/h200-llama3-8b-refbench.json`: the same rows
#   calibrated by `latsim calibrate` on these two runs (the engine facts: host
#   bookkeeping between steps, decode-attention waves, the mean slow-step tail; and the
#   host times and achieved efficiencies refitted to the runs' step times);
# - **other run only**: the same calibration from the other run alone, a check on a
#   run the calibration did not see.
#
# The calibration takes step times from the runs, never a latency: no coefficient was
# tuned to a P50 or P99. The "calibrated" column is in-sample for the step times; the
# "other run only" column is out of sample (and shows that a run calibrates the step
# kinds it holds: load50-fifo has no mixed step). Printed: real vs simulated P50/P99 of
# TTFT, TPOT, ITL and E2E with the error of each model; plotted: TTFT/TPOT/E2E CDFs and
# the ITL CDF, real against each model. Uses the SimPy event loop (seconds per run).

# %%
import numpy as np
import pandas as pd

from simulator.config.scenario import load_scenario
from simulator.cost.calibration import (METRICS, RunCase, calibrate, compare, match_policy,
                                        read_recorded_run)
from simulator.cost.convert import refbench_to_profile
from simulator.cost.fitted import FittedCostModel
from simulator.cost.profile import ProfileCostModel, load_profile
from simulator.loops.simulate import simulate
from simulator.report import plotkit, plots
from simulator.report.metrics import requests_table, summarize
from simulator.report.notebook import out_dir, repo_root, show

REPO = repo_root()
OUT = out_dir("fidelity_runs")
RUNS = ["load50-fifo", "load90-chunked"]

# %% [markdown]
# ## The three cost models

# %%
converted = refbench_to_profile(REPO / "data" / "h200-refbench" / "profile.csv")
shipped = load_profile(REPO / "profiles" / "h200-llama3-8b-refbench.json")
print("engine facts of the calibrated profile:",
      {k: shipped["engine"][k] for k in ("bookkeeping_ms", "bookkeeping_seq_ms",
                                         "decode_blocks_per_sm", "decode_wave_cost",
                                         "step_tail")})
MODELS = {
    "old table": lambda: ProfileCostModel(converted),
    "fitted": lambda: FittedCostModel(converted),
    "calibrated": lambda: FittedCostModel(shipped),
}
# Each run's held-out model: the conversion calibrated on the other run alone.
refbench, _ = load_scenario(REPO / "scenarios" / "refbench-h200.yaml",
                            ["model.cost.kind=fitted"])
alone = {}
for name in RUNS:
    run = read_recorded_run(REPO / "data" / "h200-refbench" / "runs" / name)
    label, psc = match_policy(refbench, run, "refbench-h200.yaml")
    alone[name] = calibrate([RunCase(run, label, psc)], converted, cv=False).profile
OTHER = {RUNS[0]: RUNS[1], RUNS[1]: RUNS[0]}
LABELS = [*MODELS, "other run only"]

# %% [markdown]
# ## Replay each run under each model

# %%
tables, itls, errors = {}, {}, []
for name in RUNS:
    run = read_recorded_run(REPO / "data" / "h200-refbench" / "runs" / name)
    scenario, _ = load_scenario(REPO / "scenarios" / f"refbench-{name}.yaml")
    tables[name] = {"real": run.requests_table()}
    itls[name] = {"real": pd.Series(run.itl_values())}
    builds = dict(MODELS)
    builds["other run only"] = lambda: FittedCostModel(alone[OTHER[name]])
    for label, build in builds.items():
        res = simulate(scenario, workload=run.workload(), cost_model=build(), loop="simpy")
        df = requests_table(res)
        tables[name][label] = df
        # The simulator pools inter-token gaps in a histogram: its quantiles stand in
        # for the gaps themselves on the CDF.
        itls[name][label] = pd.Series([res.rec.itl.quantile(q)
                                       for q in np.linspace(0.0005, 0.9995, 2000)])
        for key, e in compare(run.real, summarize(df, res.rec.itl)).items():
            errors.append({"run": name, "model": label, "metric": key,
                           "real_ms": e["real"], "sim_ms": e["sim"],
                           "error_pct": 100 * e["rel_err"]})

# %% [markdown]
# ## Real vs simulated P50/P99 (error in %)

# %%
err = pd.DataFrame(errors)
order = [f"{q}_{m}_ms" for m in METRICS for q in ("median", "p99")]
for name in RUNS:
    e = err[err["run"] == name]
    wide = e.pivot(index="metric", columns="model", values="error_pct").reindex(order)
    wide.insert(0, "real_ms", e.groupby("metric")["real_ms"].first().reindex(order))
    print(f"\n{name}: real (ms) and error of each model (%)")
    print(wide[["real_ms", *LABELS]].to_string(
        formatters={"real_ms": "{:,.1f}".format,
                    **{m: "{:+.1f}%".format for m in LABELS}}))
    worst = e.groupby("model")["error_pct"].apply(lambda v: np.nanmax(np.abs(v)))
    print("worst |error| per model:", {k: round(float(v), 1) for k, v in worst.items()})

# %% [markdown]
# ## CDFs: TTFT, TPOT, E2E and ITL, real vs each model

# %%
for name in RUNS:
    png = OUT / f"latency-cdfs-{name}.png"
    fig = plots.plot_latency_cdfs(tables[name], png, by_class=False)
    fig.suptitle(f"{name}: real vs simulated (circle: P50, triangle: P99)", fontsize=13)
    fig.savefig(png, dpi=110)
    show(png)
    png = OUT / f"itl-cdf-{name}.png"
    fig = plotkit.blank_figure((6.5, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    # ITL is in ms, like TPOT: the panel takes its unit from the metric it is given.
    plotkit.cdf_panel(ax, itls[name], "TPOT", f"{name}: inter-token latency, real vs sim")
    ax.set_xlabel("ITL (ms)")
    ax.set_ylabel("gaps <= x (%, logit scale)")
    plotkit.save(fig, png)
    show(png)
