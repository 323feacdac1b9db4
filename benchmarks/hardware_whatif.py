"""How well the roofline cost model (``simulator.cost.roofline``) predicts step times it
was never fitted to: the physics of ``simulator.cost.physics`` with datasheet peaks and
default efficiencies calibrated once on Vidur's A100/H100 tables, Vidur's all-reduce
tables, the H200 profiles and two published kernel figures.

Prints, in order:

1. the default efficiencies and overheads (``roofline.defaults.DEFAULTS``; that
   module's doc says where each comes from);
2. Vidur's per-layer GEMM and whole-layer (GEMM + elementwise) times, predicted
   against measured per (GPU, model, TP): the tables held out of the calibration (A100
   Llama-3-70B, H100 Llama-2-70B) and the fitted ones;
3. NCCL all-reduce times of Vidur's A100 and H100 nodes (all sizes, and 8 MiB and
   more), with each family's terms and with the other node's;
4. every published step time (``data/published-step-times.csv``) against the
   uncalibrated roofline, with the row's use: ``check`` (batch-1 decode and
   single-prompt prefill of 16-bit or fp8 weights, one step each: the cleanest),
   ``calibration`` (the two decode rows ``e_decode`` is fitted to), ``other``
   (throughput-derived large batches, weight-only int8/int4 kernels, vLLM's batch-8
   runs with their prefill averaged in), and the median and worst error per use;
5. the H200 profiles predicted from the A100/H100 calibration: uncalibrated, after two
   rows of the profile (prefill 512, decode 1@128) and after the whole profile, by row
   kind and for the GEMM-bound prefills;
6. the reverse: the H200 refbench fit's GEMM efficiency predicting Vidur's tables.

Run: ``python benchmarks/hardware_whatif.py`` (about ten seconds).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pandas as pd  # noqa: E402

from simulator.cost.roofline.checks import check_tables  # noqa: E402
from simulator.cost.roofline.model import ESTIMATE  # noqa: E402


def show(title: str, df: pd.DataFrame) -> None:
    print(f"\n== {title}")
    with pd.option_context("display.width", 200, "display.max_columns", 30,
                           "display.max_rows", 200, "display.max_colwidth", 28):
        print(df.to_string(index=False))


def main() -> None:
    t0 = time.perf_counter()
    tabs = check_tables()
    print(ESTIMATE)
    show("1. default efficiencies and overheads (roofline.DEFAULTS)", tabs["defaults"])
    v = tabs["vidur"]
    show("2. Vidur mlp.csv, per-layer GEMM and layer time: relative error |pred/meas - 1|",
         v.sort_values(["set", "device", "model", "tp"], ascending=[False, True, True, True]))
    held = v[v["set"] == "held out"]
    print(f"held out: GEMM median of medians {held['gemm median %'].median():.1f}%, worst p90 "
          f"{held['gemm p90 %'].max():.1f}%; layer median of medians "
          f"{held['layer median %'].median():.1f}%")
    show("3. Vidur all_reduce.csv (NCCL, GPUs in one node)", tabs["allreduce"])
    show("4. published step times (ms), uncalibrated", tabs["published"])
    show("4b. |error| % by use", tabs["published_summary"])
    show("5. H200 profiles predicted from the A100/H100 calibration (|error| %)", tabs["h200"])
    show("6. reverse: the H200 refbench fit's efficiencies predicting Vidur's GEMMs",
         tabs["reverse"])
    print(f"\n{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
