"""The roofline's predictions against measurements, as the tests, ``benchmarks/hardware_whatif.py``
and ``notebooks/hardware_whatif.py`` print them (``check_tables``).

- ``h200_check``: the two H200 profiles predicted from the A100/H100 calibration,
  uncalibrated, calibrated to two of their rows (``two_row_profile``) and to the
  whole profile;
- ``reverse_check``: the other way, the H200 refbench fit's efficiencies predicting
  every Vidur table;
- ``published_check``: every published step time (``data/published-step-times.csv``)
  against the uncalibrated roofline, with the row's use.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from simulator.cost import REPO_ROOT, catalog
from simulator.cost import physics as ph
from simulator.cost.fit import error_stats
from simulator.cost.roofline.constants import Engine
from simulator.cost.roofline.defaults import DEFAULTS
from simulator.cost.roofline.derive import (DECODE_CALIBRATION_ROWS, H200_MEASURED_GBS,
                                            H200_MEASURED_TFLOPS, REAL_ENGINE, REFBENCH,
                                            VIDUR_HELD_OUT, VIDUR_TRAIN, allreduce_check,
                                            profile_fit, published_rows, published_step_ms,
                                            vidur_check)
from simulator.cost.roofline.model import RooflineCostModel
from simulator.cost.roofline.transfer import profile_engine, profile_steps, step_core
from simulator.errors import LatsimError

H200_PROFILES = (REFBENCH, REAL_ENGINE)


def two_row_profile(profile: dict, chunk: int = 512) -> dict:
    """A profile of two of ``profile``'s rows, as one timed request gives them: the
    prefill of ``chunk`` tokens without a prefix and the batch-1 decode at the
    shortest context (meta and engine facts kept)."""
    pre = [r for r in profile["prefill"] if r["chunk"] == chunk and not r.get("prior", 0)]
    dec = sorted((r for r in profile["decode"] if r["batch"] == 1), key=lambda r: r["context"])
    if not pre or not dec:
        raise LatsimError(f"the profile has no {chunk}-token prefill or no batch-1 decode row")
    return {"format": profile["format"], "meta": profile.get("meta", {}),
            "engine": profile.get("engine", {}), "prefill": [pre[0]], "decode": [dec[0]]}


def h200_check(eff: Optional[dict] = None) -> list[dict]:
    """The H200 profiles predicted by the roofline on ``h200`` with each profile's engine
    facts: uncalibrated (efficiencies from the A100/H100 data), calibrated to two rows
    of the profile (prefill 512, batch-1 decode), and to the whole profile (in-sample).
    One entry per (profile, way, row kind) with ``_stats`` of the relative errors."""
    from simulator.cost.profile import load_profile
    out = []
    for path in H200_PROFILES:
        prof = load_profile(REPO_ROOT / path)
        eng, _ = profile_engine(prof, Engine())
        steps = profile_steps(prof)
        ways = {"datasheet": None, "two rows": two_row_profile(prof), "whole profile": prof}
        for way, cal in ways.items():
            m = RooflineCostModel("llama-3-8b", "h200", engine=eng, profile=cal,
                                  profile_source=path, eff=eff)
            err = np.array([step_core(m.c, s) / s.ms - 1.0 for s in steps])
            kinds = np.array([s.kind for s in steps])
            gemm = np.array([bool(s.chunks) and not s.n_decode and s.chunks[0][1] == 0
                             and s.chunks[0][0] >= 512 for s in steps])
            groups = {k: kinds == k for k in dict.fromkeys(kinds)}
            groups["prefill >= 512, no prefix"] = gemm
            for k, sel in groups.items():
                out.append({"profile": path, "way": way, "rows": k, "scales":
                            (m.calibration.scales if m.calibration else {}), **error_stats(err[sel])})
    return out


def reverse_check() -> list[dict]:
    """The other direction: the GEMM and weight-read efficiencies fitted to the H200
    reference profile (as fractions of the H200's datasheet peaks; its flat efficiency,
    no per-GEMM floor) predicting every Vidur A100 and H100 table (``vidur_check``)."""
    ref = profile_fit(REFBENCH)
    h200 = catalog.gpu("h200")
    eff = dict(DEFAULTS)
    eff.update(e_gemm=float(ref.c[ph.C_E_GEMM] * H200_MEASURED_TFLOPS / h200.bf16_tflops),
               e_weights=float(ref.c[ph.C_E_WEIGHTS] * H200_MEASURED_GBS / h200.memory_bw_gbs),
               p_gemm=float(ref.c[ph.C_P_GEMM]), gemm_half_gflop=0.0, gemm_floor_us=0.0,
               gemm_tile_small=0.0, gemm_tile=0.0)      # a fitted profile has no tiles
    return vidur_check(eff, VIDUR_TRAIN + VIDUR_HELD_OUT)


def published_check(eff: Optional[dict] = None) -> list[dict]:
    """Every published step time against the uncalibrated roofline, with the row's use:
    ``check`` (batch-1 decode and single-prompt prefill of 16-bit or fp8 weights: the
    cleanest, one step each), ``calibration`` (the decode rows ``e_decode`` is fitted
    to), ``other`` (large-batch throughput-derived rows, weight-only int8/int4 kernels,
    and vLLM's batch-8 latency runs with their prefill averaged in)."""
    out = []
    for r in published_rows():
        ms = published_step_ms(r, eff)
        key = (r["model"], r["gpu"], r["batch"])
        if r["kind"] == "decode" and key in DECODE_CALIBRATION_ROWS:
            use = "calibration"
        elif r["batch"] == 1 and r["weight_dtype"] in ("bf16", "fp8"):
            use = "check"
        else:
            use = "other"
        out.append({**{k: r[k] for k in ("model", "gpu", "tp", "kind", "batch",
                                          "prompt_or_context", "weight_dtype", "kv_dtype")},
                    "source": r["source"].split(" ")[0], "measured_ms": r["ms"],
                    "predicted_ms": ms, "error": ms / r["ms"] - 1.0, "use": use})
    return out


def check_tables() -> dict:
    """Every predicted-against-measured comparison above as tables (pandas), for
    ``benchmarks/hardware_whatif.py`` and ``notebooks/hardware_whatif.py``:
    ``defaults``, ``vidur`` (held-out and fitted tables), ``allreduce``, ``published``
    (per row, with its use), ``published_summary``, ``h200`` and ``reverse``."""
    import pandas as pd

    def pct(d: dict) -> dict:
        return {k: (round(100 * v, 1) if k in ("median", "p90", "max") else v)
                for k, v in d.items()}

    held = {(d, m) for d, m in VIDUR_HELD_OUT}
    vid = [{"device": r["device"], "model": r["model"], "tp": r["tp"],
            "set": "held out" if (r["device"], r["model"]) in held else "fitted",
            "points": r["points"],
            **{f"gemm {k} %": v for k, v in pct(r["gemm"]).items() if k != "n"},
            **{f"layer {k} %": v for k, v in pct(r["layer"]).items() if k != "n"}}
           for r in vidur_check(pairs=VIDUR_TRAIN + VIDUR_HELD_OUT)]
    ar = [{"node": r["node"], "gpus": r["n"], "points": r["points"],
           **{f"all {k} %": v for k, v in pct(r["default"]).items() if k != "n"},
           **{f">=8MiB {k} %": v for k, v in pct(r["large"]).items() if k != "n"},
           "other node's terms, median %": pct(r["other_node"])["median"]}
          for r in allreduce_check()]
    pub = pd.DataFrame(published_check())
    pub["error %"] = (100 * pub["error"]).round(1)
    summ = (pub.assign(abs_err=pub["error"].abs() * 100).groupby("use")["abs_err"]
            .agg(rows="count", median="median", max="max").round(1).reset_index())
    h2 = [{"profile": Path(r["profile"]).name, "calibration": r["way"], "rows": r["rows"],
           "n": r["n"], **{f"{k} %": v for k, v in pct(r).items() if k in ("median", "p90", "max")},
           "fitted": ", ".join(f"{k} {v:.3g}" for k, v in r["scales"].items())}
          for r in h200_check()]
    rev = [{"device": r["device"], "model": r["model"], "tp": r["tp"],
            **{f"gemm {k} %": v for k, v in pct(r["gemm"]).items() if k != "n"}}
           for r in reverse_check()]
    dflt = pd.DataFrame([{"term": k, "value": v} for k, v in DEFAULTS.items()])
    return {"defaults": dflt, "vidur": pd.DataFrame(vid), "allreduce": pd.DataFrame(ar),
            "published": pub[["use", "model", "gpu", "tp", "kind", "batch", "prompt_or_context",
                              "weight_dtype", "source", "measured_ms", "predicted_ms", "error %"]],
            "published_summary": summ, "h200": pd.DataFrame(h2), "reverse": pd.DataFrame(rev)}
