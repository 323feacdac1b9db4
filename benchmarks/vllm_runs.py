"""Recorded vLLM runs replayed through latsim from datasheets only.

Every run in ``data/vllm-h100-runs/`` (16 runs of a real vLLM v0.15 server on H100-SXM,
driven by inference-perf; provenance in that folder's README) is simulated with:

- the model and launch arguments of its ``exp-config.yaml`` (model name -> the
  catalogue's entry, tensor parallel, ``max_model_len``, ``max_num_batched_tokens``,
  ``max_num_seqs``), GPU ``h100-sxm``, ``model.cost: {kind: roofline}`` (datasheets,
  nothing fitted; prefill and mixed steps as vLLM v1's piecewise CUDA graphs), prefix
  caching on, chunked prefill;
- vLLM's other settings from ``engine: {preset: vllm}`` when this checkout has it
  (``ENGINE_PRESET``: one line to switch), else stated explicitly (``explicit_engine``);
- its traffic from ``results/config.yaml`` as ``workload: {kind: inference_perf}``
  (``simulator/workload/inference_perf.py``: the same prompts, repeats, arrival
  spacing and stages), prompt lengths scaled by the run's recorded mean ``prompt_len``
  (re-tokenised random text);
- the client beside the server (one Kubernetes cluster: no distance, no TLS), opening a
  connection per request as inference-perf did (``NETWORK``).

It prints per run and per stage (where the run has stage files) real vs simulated
mean, P90 and P99 of TTFT and E2E and the mean ITL, each on inference-perf's clock
(``simulator/cost/calibration/aggregates.py``: its ITL counts the SSE blank lines, so
about half the time per token), and the Showdown's three errors (the mean over runs
of |error| of the run's mean E2E, mean TTFT and mean ITL) over the runs that did not
saturate. A run whose recording shows saturation (timed-out requests, or a mean TTFT
over 100 mean TPOTs) is reported by verdict, not by its latencies: latsim
must say ``saturated`` too. Exit 1 when a verdict disagrees.

    python benchmarks/vllm_runs.py [--runs NAME_SUBSTRING ...] [--out results/vllm-runs.json] [--explicit]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulator.config.engine import EngineConfig  # noqa: E402
from simulator.cost.calibration.aggregates import (judge, read_summary_run,  # noqa: E402
                                                   run_workload, sim_aggregates)
from simulator.errors import LatsimError  # noqa: E402

RUNS_DIR = ROOT / "data" / "vllm-h100-runs"
GPU = "h100-sxm"
#: Use helper-built vLLM defaults when the engine config has them (the one-line switch).
ENGINE_PRESET = "preset" in EngineConfig.model_fields
SHOWDOWN = ("mean_e2el_ms", "mean_ttft_ms", "mean_itl_ms")
TAILS = ("p90_ttft_ms", "p99_ttft_ms", "p90_e2el_ms", "p99_e2el_ms")
#: The client sits in the server's cluster (inference-perf's service URL, plain HTTP).
#: inference-perf at 3b6f82a opens a new aiohttp ClientSession, with its own connector and
#: resolver, for every request (``openai_client.py``; its PR #282 later shared sessions):
#: so every request opens a connection (``connection_reuse: false``: the TCP handshake,
#: one RTT), pays the software's set-up of it (``connect_ms``: 0.59-0.75 ms measured by
#: ``benchmarks/frontend_floor.py`` with the same client and server stacks) and looks the
#: service name up again (``dns_ms``: one round trip to the cluster's DNS service, taken
#: as the cluster's base RTT).
NETWORK = {"distance_km": 0.0, "base_rtt_ms": 0.2, "tls": "none", "gateway_ms": 0.0,
           "clients": 224, "pool_size": 100, "connection_reuse": False,
           "connect_ms": 0.7, "dns_ms": 0.2}


def explicit_engine(exp: dict) -> dict:
    """vLLM v0.15's settings the recordings ran with, stated one by one."""
    return {"policy": "chunked", "max_num_seqs": int(exp["max_num_seqs"]),
            "max_num_batched_tokens": int(exp["max_num_batched_tokens"]),
            "chunk_size": int(exp["max_num_batched_tokens"]),
            "kv": {"block_size": 16, "prefix_caching": True, "gpu_memory_utilization": 0.9,
                   "max_model_len": int(exp["max_model_len"]), "preemption": "recompute"}}


def preset_engine(exp: dict) -> dict:
    """``engine: {preset: vllm}`` with the launch arguments the run set."""
    return {"preset": "vllm", "max_num_seqs": int(exp["max_num_seqs"]),
            "max_num_batched_tokens": int(exp["max_num_batched_tokens"]),
            "kv": {"max_model_len": int(exp["max_model_len"])}}


def catalogue_model(hf_id: str):
    """The catalogue's entry for a Hugging Face model id; an instruction-tuned variant
    (``-Instruct``, ``-chat``) has its base model's architecture and weights' shape."""
    from simulator.cost import catalog
    try:
        return catalog.model(hf_id)
    except LatsimError as first:
        base = re.sub(r"-(instruct|chat)(?=-hf$|$)", "", hf_id, flags=re.IGNORECASE)
        try:
            return catalog.model(base)
        except LatsimError:
            raise first from None


def scenario_for(run_dir: Path, rec) -> tuple[dict, str]:
    """The scenario that replays ``run_dir`` and the catalogue name of its model (a
    ``LatsimError`` when the catalogue lacks it)."""
    exp = yaml.safe_load((run_dir / "exp-config.yaml").read_text())
    arch = catalogue_model(exp["model"])
    wl = run_workload(rec)
    eng = preset_engine(exp) if ENGINE_PRESET else explicit_engine(exp)
    cost = {"kind": "roofline", "gpu": GPU, "tp": int(exp["tensor_parallelism"])}
    if not ENGINE_PRESET:
        cost["piecewise_graphs"] = True   # vLLM v1's FULL_AND_PIECEWISE (the preset's)
    sc = {"name": run_dir.name, "seed": 0, "workload": wl, "network": NETWORK,
          "engine": eng, "model": {"name": arch.name, "cost": cost}}
    return sc, arch.name


def replay(run_dir: Path) -> dict:
    """One run: real and simulated aggregates per stage and overall, verdicts."""
    from simulator.config.scenario import validate_scenario
    from simulator.loops.simulate import simulate
    from simulator.report.metrics import requests_table
    rec = read_summary_run(run_dir)
    try:
        data, model = scenario_for(run_dir, rec)
    except LatsimError as e:
        return {"run": run_dir.name, "skipped": str(e)}
    sc = validate_scenario(data, source=run_dir.name, base_dir=run_dir)
    t0 = time.perf_counter()
    res = simulate(sc, base_dir=run_dir)
    wall = time.perf_counter() - t0
    df = requests_table(res)
    stage = np.asarray(res.workload.meta["stage"])
    out = {"run": run_dir.name, "model": model, "wall_s": wall, "stages": [],
           "engine": "preset: vllm" if ENGINE_PRESET else "explicit"}
    for k, real in enumerate(rec.stages):
        sim = sim_aggregates(df, rec.clock, stage == k)
        out["stages"].append(judge(real, sim, rec.clock))
    out["overall"] = judge(rec.overall, sim_aggregates(df, rec.clock), rec.clock)
    return out


def _err(j: dict, k: str):
    e = j["errors"].get(k) or {}
    return e.get("rel_err")


def _fmt(v) -> str:
    return "    -" if v is None else f"{100 * v:+6.1f}%"


def report(results: list) -> int:
    """Print the per-run table and the aggregate; the exit status (1: a verdict differs)."""
    cols = SHOWDOWN + TAILS
    print(f"engine: {results[0].get('engine', '?') if results else '?'}; GPU {GPU}; "
          "roofline (datasheets); errors = (latsim - real) / real on inference-perf's clock")
    print(f"{'run / stage':58s} " + " ".join(f"{c.replace('_ms', ''):>10s}" for c in cols)
          + "  verdict")
    bad = 0
    good = []
    for r in results:
        if "skipped" in r:
            print(f"{r['run']:58s} skipped: {r['skipped']}")
            continue
        rows = [("  all", r["overall"])] + [(f"  stage {i}", s) for i, s in
                                             enumerate(r["stages"])]
        print(f"{r['run']}  ({r['model']}, {r['wall_s']:.0f} s)")
        for label, j in rows:
            rs, ss = j["real_saturated"], j["sim_saturated"]
            if rs or ss:
                verdict = ("saturated: real and latsim" if rs and ss else
                           "SATURATED in the recording, latsim says healthy" if rs else
                           "latsim says saturated, the recording did not")
                bad += rs != ss
                vals = "".join(f" {'(sat)':>10s}" for _ in cols)
            else:
                verdict = "ok"
                vals = " ".join(f"{_fmt(_err(j, c)):>10s}" for c in cols)
            print(f"{label:58s}{vals}  {verdict}")
        o = r["overall"]
        if not (o["real_saturated"] or o["sim_saturated"]):
            good.append(r)
    print()
    if good:
        print(f"Showdown errors over {len(good)} runs that did not saturate "
              "(mean |error| of the run's mean):")
        for c in cols:
            v = [abs(_err(r["overall"], c)) for r in good if _err(r["overall"], c) is not None]
            med = [abs(x) for x in v]
            print(f"  {c.replace('_ms', ''):10s} mean {100 * np.mean(v):5.1f}%  median "
                  f"{100 * np.median(med):5.1f}%  max {100 * np.max(med):5.1f}%  (n={len(v)})")
    sat = [r["run"] for r in results if "overall" in r and r["overall"]["real_saturated"]]
    print(f"saturated in the recording: {len(sat)} ({', '.join(sat) or 'none'}); verdicts "
          f"that disagree: {bad}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="*", default=None, help="only runs whose name has one "
                    "of these substrings")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--explicit", action="store_true", help="state vLLM's settings one by "
                    "one (explicit_engine) even where engine: {preset: vllm} exists")
    a = ap.parse_args(argv)
    global ENGINE_PRESET
    ENGINE_PRESET = ENGINE_PRESET and not a.explicit
    dirs = sorted(p for p in RUNS_DIR.iterdir() if (p / "exp-config.yaml").is_file())
    if a.runs:
        dirs = [d for d in dirs if any(s in d.name for s in a.runs)]
    results = []
    for d in dirs:
        print(f"... {d.name}", file=sys.stderr, flush=True)
        results.append(replay(d))
    code = report(results)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1, default=float) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
