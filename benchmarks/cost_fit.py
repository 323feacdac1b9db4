"""How well the fitted physics step-cost model (``simulator.cost.fitted``) predicts the
H200 reference engine, next to the table-interpolating ``ProfileCostModel``.

Prints, in order:

1. the fit of each shipped profile: coefficients with their physical meaning, the
   terms that fell back, and leave-one-out relative errors per row kind (against the
   measured medians and against the medians capped by the monotone envelope);
2. engine facts measured on the recorded runs (``data/h200-refbench/runs``) that the
   profile cannot show: host bookkeeping between steps and where decode attention
   spills into further waves (pooled, and from each run alone);
3. per-step relative error of both models on every recorded step of both runs, by
   step kind (median, p10, p90);
4. the step-time noise measured on the runs (each, and pooled);
5. end to end: each run's trace replayed by the simulator with the old model, the new
   one (profile only; profile plus the measured bookkeeping and waves; the shipped
   profile, ``latsim calibrate`` on both runs: the facts, the step tail and the host
   times and efficiencies refitted to the runs' step times) and
   the new one with seeded noise (median and range over seeds), against the real
   P50/P99 of TTFT, TPOT, ITL and E2E.

The profile fitted here is the plain conversion of ``data/h200-refbench/profile.csv``
(the shipped profile is it calibrated on the runs, ``profiles/README.md``).

Run: ``python benchmarks/cost_fit.py`` (about two minutes on two cores;
``--quick`` skips the noise seeds and the per-run wave measurements).
"""
from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from simulator.config.scenario import validate_scenario  # noqa: E402
from simulator.cost import physics as ph  # noqa: E402
from simulator.cost.convert import refbench_to_profile  # noqa: E402
from simulator.cost.fit import fit  # noqa: E402
from simulator.cost.fitted import FittedCostModel  # noqa: E402
from simulator.cost.noise import NoiseModel  # noqa: E402
from simulator.cost.profile import ProfileCostModel, load_profile  # noqa: E402
from simulator.cost.runs import (completes_mask, measure_bookkeeping,  # noqa: E402
                                 measure_decode_waves, predict_steps, read_run,
                                 real_metrics, step_cells)
from simulator.loops.simulate import simulate  # noqa: E402
from simulator.report.metrics import requests_table, summarize  # noqa: E402

DATA = REPO / "data" / "h200-refbench"
PROFILES = [REPO / "profiles" / "h200-llama3-8b-refbench.json",
            REPO / "profiles" / "h200-llama3-8b.json"]
RUNS = [("load50-fifo", "fifo"), ("load90-chunked", "chunked")]
METRICS = ["median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
           "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms"]
SEEDS = [1, 2, 3, 4, 5]


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 76 - len(title)))


def physical(c: np.ndarray) -> list[str]:
    """The fitted coefficients as achieved rates and host times."""
    pk, bw = c[ph.C_PEAK_TFLOPS], c[ph.C_HBM_GBS]
    out = [
        f"host per eager step {c[ph.C_H_STEP]:.2f} ms, + decode batch {c[ph.C_H_DECODE]:.2f} ms,"
        f" + per chunk {c[ph.C_H_CHUNK]:.2f} ms, + per prefixed chunk {c[ph.C_H_PREFIX]:.2f} ms",
        f"GEMMs {pk * c[ph.C_E_GEMM]:.0f} TFLOP/s ({c[ph.C_E_GEMM]:.2f} of {pk:.0f});"
        f" weights streamed at {bw * c[ph.C_E_WEIGHTS]:.0f} GB/s ({c[ph.C_E_WEIGHTS]:.2f} of"
        f" {bw:.0f}); p_gemm {c[ph.C_P_GEMM]:.2f}",
        f"flash prefill attention {pk * c[ph.C_E_FLASH]:.0f} TFLOP/s; masked (prefix)"
        f" attention {pk * c[ph.C_E_MASKED]:.0f} TFLOP/s, one block {c[ph.C_CTA_PREFIX]:.1f} GB/s",
        f"decode attention K/V read at {bw * c[ph.C_E_DECODE]:.0f} GB/s"
        f" (eager in a graphed engine: {bw * c[ph.C_E_DECODE_EAGER]:.0f}), one block"
        f" {c[ph.C_CTA_DECODE]:.1f} GB/s, p_attn {c[ph.C_P_ATTN]:.2f};"
        f" waves: {c[ph.C_DEC_BLOCKS_PER_SM]:.0f} blocks/SM, wave cost {c[ph.C_WAVE_COST]:.2f}",
        f"kernel floor {c[ph.C_DEV_PER_HOST]:.3f} x host launch time; p_step {c[ph.C_P_STEP]:.1f};"
        f" graph replay floor {c[ph.C_H_GRAPH]:.2f} ms",
        f"bookkeeping {c[ph.C_BOOK_MS]:.4f} ms + {c[ph.C_BOOK_SEQ_MS]:.5f} ms per sequence",
    ]
    return out


def print_fit(profile: dict, name: str) -> None:
    t = time.time()
    r = fit(profile, cv=True)
    print(f"{name}: fitted in {time.time() - t:.1f} s (with leave-one-out); {r.hardware}")
    for line in physical(r.c):
        print("   " + line)
    for k, v in r.fallbacks.items():
        print(f"   fallback {k}: {v}")
    print(f"   {'rows':16s} {'n':>3s}  {'LOO median':>10s} {'p90':>7s} {'max':>7s}"
          f"   {'LOO capped med':>14s} {'p90':>7s} {'max':>7s}   {'in-sample med':>13s}")
    for kind, e in r.errors.items():
        cv, cc, fi = e["cv"], e["cv_capped"], e["fit"]
        print(f"   {kind:16s} {cv['n']:3d}  {cv['median']:10.2%} {cv['p90']:7.2%} {cv['max']:7.2%}"
              f"   {cc['median']:14.2%} {cc['p90']:7.2%} {cc['max']:7.2%}   {fi['median']:13.2%}")


def per_step(runs: dict, old: ProfileCostModel, c_new: np.ndarray) -> None:
    kinds = ["decode", "prefill-small", "prefill-large", "mixed"]
    print(f"   {'run':15s} {'kind':14s} {'n':>5s}   {'old med':>8s} {'p10':>7s} {'p90':>7s}"
          f"   {'new med':>8s} {'p10':>7s} {'p90':>7s}")
    for name, r in runs.items():
        d = r.dur_s * 1e3
        m_old = np.array([old.step_time(nd, cm, cs, [(x[0], x[1], x[2]) for x in ch]) * 1e3
                          for nd, cm, cs, ch in zip(r.nd, r.ctx_max, r.ctx_sum, r.chunks)])
        m_new = predict_steps(c_new, r)
        k = r.kinds()
        for kind in kinds + ["all"]:
            sel = (k == kind) if kind != "all" else np.ones(len(k), bool)
            if sel.sum() < 3:
                continue
            eo, en = m_old[sel] / d[sel] - 1, m_new[sel] / d[sel] - 1
            print(f"   {name:15s} {kind:14s} {sel.sum():5d}   "
                  + " ".join(f"{v:+7.1%}" for v in np.percentile(eo, [50, 10, 90]))
                  + "   " + " ".join(f"{v:+7.1%}" for v in np.percentile(en, [50, 10, 90])))
        print(f"   {name:15s} total busy time: old {m_old.sum() / d.sum() - 1:+.1%},"
              f" new {m_new.sum() / d.sum() - 1:+.1%} (model / measured - 1)")


def scenario(run: str, policy: str, profile_path: Path):
    eng = {"policy": policy, "max_num_seqs": 64,
           "kv": {"num_blocks": 16384, "allocation": "contiguous", "max_model_len": 4096}}
    if policy == "fifo":
        eng["max_num_batched_tokens"] = 4096
    else:
        eng.update(max_num_batched_tokens=512, chunk_size=512)
    return validate_scenario({
        "name": f"refbench-{run}", "seed": 1,
        "workload": {"kind": "trace", "path": str(DATA / "runs" / run / "trace.csv"),
                     "format": "csv"},
        "network": {"distance_km": 0, "base_rtt_ms": 0, "tls": "none", "gateway_ms": 0,
                    "request_overhead_bytes": 0, "bytes_per_prompt_token": 0},
        "stream": {"frame_overhead_bytes": 0, "bytes_per_token": 0},
        "engine": eng,
        "model": {"cost": {"kind": "profile", "path": str(profile_path)}}})


def summary(sc, cost) -> dict:
    res = simulate(sc, cost_model=cost, loop="simpy")
    return summarize(requests_table(res), res.rec.itl, res.scenario)


def main(quick: bool = False) -> None:
    t0 = time.time()
    section("1. fit of each shipped profile (leave-one-out errors per row kind)")
    profiles = {p.name: load_profile(p) for p in PROFILES}
    shipped = profiles[PROFILES[0].name]
    profiles[PROFILES[0].name] = refbench_to_profile(DATA / "profile.csv")
    for name, prof in profiles.items():
        print_fit(prof, name)

    refbench = profiles[PROFILES[0].name]
    runs = {name: read_run(DATA / "runs" / name) for name, _ in RUNS}
    section("2. engine facts measured on the recorded runs")
    for name, r in runs.items():
        print(f"   {name}: replay check {r.check}")
    facts = measure_bookkeeping(list(runs.values()))
    print(f"   bookkeeping (pooled): {facts['bookkeeping_ms']:.4f} ms + "
          f"{facts['bookkeeping_seq_ms']:.5f} ms per sequence in the step")
    for name, r in runs.items():
        b = measure_bookkeeping([r])
        print(f"   bookkeeping ({name}): {b['bookkeeping_ms']:.4f} ms + "
              f"{b['bookkeeping_seq_ms']:.5f} ms per sequence")
    w = measure_decode_waves(list(runs.values()), refbench)
    facts["decode_blocks_per_sm"] = w["decode_blocks_per_sm"]
    facts["decode_wave_cost"] = w["decode_wave_cost"]
    best = sorted(w["scores"].items(), key=lambda kv: kv[1])[:4]
    print(f"   decode waves (pooled): {w['decode_blocks_per_sm']} blocks/SM (a wave is "
          f"{132 * w['decode_blocks_per_sm'] / 32:.1f} sequences), wave cost "
          f"{w['decode_wave_cost']}; best scores {best}; no limit: {w['scores']['0x1.0']}")
    if not quick:
        for name, r in runs.items():
            wr = measure_decode_waves([r], refbench)
            print(f"   decode waves ({name} alone): {wr['decode_blocks_per_sm']} blocks/SM, "
                  f"wave cost {wr['decode_wave_cost']}")
    print("   engine facts to add to the refbench profile's `engine` section: "
          + json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in facts.items()}))
    with_facts = copy.deepcopy(refbench)
    with_facts["engine"].update(facts)
    c_new = fit(with_facts, cv=False).c

    section("3. per-step relative error on every recorded step (model / measured - 1)")
    per_step(runs, ProfileCostModel(refbench), c_new)

    section("4. step-time noise measured on the runs (against the new model)")
    args = [[], [], [], []]
    for name, r in runs.items():
        a = (r.dur_s * 1e3, predict_steps(c_new, r), completes_mask(r), step_cells(r))
        print(f"   {name}: {NoiseModel.from_run(*a).describe()}")
        for i, v in enumerate(a):
            args[i].append(v)
    print(f"   pooled: {NoiseModel.from_run(*args).describe()}")
    print(f"   used by default with noise on: {NoiseModel.from_profile(refbench).describe()}")

    section("5. end to end: real vs simulated (trace replay), error in %")
    fitted_plain = fit(refbench, cv=False)
    fitted_facts = fit(with_facts, cv=False)
    for name, policy in RUNS:
        real = real_metrics(runs[name])
        sc = scenario(name, policy, PROFILES[0])
        cols = {"old": summary(sc, ProfileCostModel(refbench)),
                "new(profile)": summary(sc, FittedCostModel(refbench, fit_result=fitted_plain)),
                "new": summary(sc, FittedCostModel(with_facts, fit_result=fitted_facts)),
                "shipped": summary(sc, FittedCostModel(shipped))}
        noisy = [] if quick else [
            summary(sc, FittedCostModel(with_facts, fit_result=fitted_facts, noise=True,
                                        rng=np.random.default_rng(s))) for s in SEEDS]
        print(f"   {name} ({policy}, {len(runs[name].trace)} requests)")
        head = f"   {'metric':15s} {'real':>9s} " + "".join(f"{k:>14s}" for k in cols)
        if noisy:
            head += f"   {'new+noise med [min, max] over ' + str(len(SEEDS)) + ' seeds':>40s}"
        print(head)
        for m in METRICS:
            line = f"   {m:15s} {real[m]:9.1f} " + "".join(
                f"{100 * (v[m] / real[m] - 1):+13.1f}%" for v in cols.values())
            if noisy:
                e = np.array([v[m] for v in noisy]) / real[m] - 1
                line += f"   {100 * np.median(e):+8.1f}% [{100 * e.min():+6.1f}%, {100 * e.max():+6.1f}%]"
            print(line)
    print(f"\n(total {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
