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
# # Simulator fidelity: simulated vs real engine
#
# `latsim validate` replays one trace through the real PyTorch engine
# (`real_engine`, in wall-clock time) and through the simulator with the same
# scheduling policy, limits and the step costs the engine itself measured
# (`latsim profile`). It writes per-request tables `real-<policy>.csv` and
# `sim-<policy>.csv` (the columns of `requests.csv`) and `validation.json`.
#
# This notebook plots those tables with `simulator.report.plots.plot_fidelity`: the CDFs of
# TTFT, TPOT and E2E overlaid, and the relative error of P50 and P99.
#
# Where the tables come from, in order:
# 1. `LATSIM_VALIDATE_DIR` (an existing `latsim validate --out` folder, e.g. an H200 run);
# 2. a fresh validation run here, when the engine extra (torch) is installed: the
#    `tiny` model on the CPU, profiled quickly, replaying the first requests of the
#    Azure conversation trace at half the engine's saturation throughput (seconds of
#    work; on a busy machine the real side slows down and the errors grow);
# 3. `results/validate` in the checkout (`latsim validate`'s default output folder).
#
# Otherwise the plotting section is skipped with a message.

# %%
import os
from pathlib import Path

from simulator.report.notebook import out_dir, repo_root, show

REPO = repo_root()
OUT = out_dir("fidelity")


def has_tables(d: Path) -> bool:
    """True if ``d`` holds at least one real-/sim-<policy>.csv pair."""
    return any((d / f"sim-{p.name[5:]}").exists() for p in d.glob("real-*.csv"))


# %% [markdown]
# ## Parameters of the fresh run (step 2)

# %%
POLICIES = ["fifo", "chunked", "priority_aging"]
N_REQUESTS = 30  # requests replayed per policy
LOAD = 0.5  # fraction of the simulated engine's saturation throughput
MAX_PROMPT, MAX_OUTPUT = 256, 32  # tokens (clipped)
ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=256)
TRACE = REPO / "data" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"

# %% [markdown]
# ## Find or make the validation tables

# %%
VALIDATE_DIR = None
if os.environ.get("LATSIM_VALIDATE_DIR"):
    VALIDATE_DIR = Path(os.environ["LATSIM_VALIDATE_DIR"])
    print(f"using validation tables from LATSIM_VALIDATE_DIR={VALIDATE_DIR}")
else:
    try:
        import real_engine.validate as rv
        from real_engine.profile import run_profile
    except ImportError as e:  # torch (the engine extra) missing, or no validate module
        rv = None
        print(f"real engine not available ({e}); not running a fresh validation")
    if rv is not None:
        import numpy as np

        from simulator.cost import load_profile
        from simulator.workload.traces import TraceWorkload, build_trace

        OUT.mkdir(parents=True, exist_ok=True)
        prof_path = OUT / "tiny-cpu-profile.json"
        run_profile("tiny", "cpu", prof_path, quick=True, time_budget_s=20, log=lambda s: None)
        prof = load_profile(prof_path)
        cfg = TraceWorkload(path=str(TRACE), format="azure", limit=N_REQUESTS,
                            max_prompt_tokens=MAX_PROMPT, max_output_tokens=MAX_OUTPUT)
        wl = build_trace(cfg, np.random.default_rng(0), REPO)
        # realtime=False: idle gaps are skipped (busy periods still run in real time).
        res, meta = rv.run_validation(prof, wl, POLICIES, model="tiny", device="cpu",
                                      settings=rv.engine_settings(**ENGINE, aging_s=2.0),
                                      load=LOAD, realtime=False, log=print)
        meta.update(profile=str(prof_path), trace=str(TRACE))
        rv.write_validation(OUT, res, meta)
        VALIDATE_DIR = OUT
if VALIDATE_DIR is None and has_tables(REPO / "results" / "validate"):
    VALIDATE_DIR = REPO / "results" / "validate"
    print(f"using the validation tables in {VALIDATE_DIR}")

# %% [markdown]
# ## Simulated vs real, per policy

# %%
import json

from simulator.report import plots

if VALIDATE_DIR is None or not has_tables(VALIDATE_DIR):
    print("SKIPPED: no validation tables. Install the engine extra (torch) to run a fresh "
          "validation here, or point LATSIM_VALIDATE_DIR at a `latsim validate --out` folder.")
else:
    meta = VALIDATE_DIR / "validation.json"
    if meta.exists():
        print("run:", json.loads(meta.read_text()).get("meta"))
    for real_csv in sorted(VALIDATE_DIR.glob("real-*.csv")):
        policy = real_csv.stem[len("real-"):]
        sim_csv = VALIDATE_DIR / f"sim-{policy}.csv"
        if not sim_csv.exists():
            continue
        real, sim = plots.read_requests(real_csv), plots.read_requests(sim_csv)
        err = plots.fidelity_errors(real, sim)
        print(f"\n{policy}: sim vs real (ms, error in %)")
        print(err.to_string(index=False, float_format=lambda v: f"{v:,.2f}"))
        png = OUT / f"fidelity-{policy}.png"
        fig = plots.plot_fidelity(real, sim, png, title=f"Simulator fidelity, policy {policy}")
        show(png)
