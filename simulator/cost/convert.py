"""Convert the H200 reference-bench step costs (``data/h200-refbench/profile.csv``) to
a latsim profile. The CSV's columns and the engine it measured are described in
that folder's README; the facts that matter for cost are carried over: decode
attention padded to the longest context, and no CUDA graphs (host-bound floor).

The shipped ``profiles/h200-llama3-8b-refbench.json`` is this conversion plus one
calibration step, the engine facts measured on the engine's two recorded runs
(``simulator.cost.calibration``; the command is in ``profiles/README.md``): the
profile equals ``calibrate.apply_calibration(refbench_to_profile(csv),
profile["meta"]["calibration"])``.
"""
from __future__ import annotations

from pathlib import Path


from simulator.cost.profile import check_profile
from simulator.cost.runs import numeric_column, read_table
from simulator.errors import LatsimError

REFBENCH_ENGINE = {
    "decode_attention": "padded",
    "kv_block_size": None,
    "kv_layout": "contiguous slots, 64 x 4096 tokens",
    "cuda_graphs": False,
    "host_overhead_ms": None,
}

REFBENCH_MODEL = {"name": "llama3-8b", "n_layers": 32, "d_model": 4096, "n_heads": 32,
                  "n_kv_heads": 8, "head_dim": 128, "ffn": 14336, "vocab": 128256,
                  "params": 8.03e9}

_STATS = ("ms_median", "ms_p10", "ms_p90", "ms_mean", "ms_min", "n")


def refbench_to_profile(csv_path: str | Path) -> dict:
    """Read the refbench CSV and return the profile dict (``latsim-profile/1``)."""
    path = Path(csv_path)
    need = sorted({"kind", "batch", "chunk", "context", "prior", *_STATS})
    df = read_table(path, need, "the profile table")
    if df.empty:
        raise LatsimError("no rows", source=str(path))
    for c in need:
        if c != "kind":
            # Step times positive; counts (batch, chunk, context, prior, n) whole, >= 0.
            ms = c.startswith("ms_")
            numeric_column(path, df, c, integer=not ms, minimum=None if ms else 0,
                           positive=ms)

    def stats(r) -> dict:
        return {"ms": float(r.ms_median), "p10": float(r.ms_p10), "p90": float(r.ms_p90),
                "mean": float(r.ms_mean), "min": float(r.ms_min), "n": int(r.n)}

    prefill, decode, mixed = [], [], []
    for r in df.itertuples(index=False):
        if r.kind == "prefill":
            prefill.append({"chunk": int(r.chunk), "prior": int(r.prior), **stats(r)})
        elif r.kind == "decode":
            decode.append({"batch": int(r.batch), "context": int(r.context), **stats(r)})
        elif r.kind == "mixed":
            mixed.append({"batch": int(r.batch), "context": int(r.context), "chunk": int(r.chunk),
                          "prior": int(r.prior), **stats(r)})
        else:
            raise LatsimError(f"unknown kind {r.kind!r}", source=str(path), field="kind")
    return check_profile({
        "format": "latsim-profile/1",
        "meta": {
            "hardware": "NVIDIA H200 141GB (132 SMs), 16 host cores",
            "source": "data/h200-refbench/profile.csv (reference eager engine, "
                      "measured 2026-11-30; see that folder's README)",
            "model": REFBENCH_MODEL,
            "dtype": "bf16",
            "torch": "2.11.0+cu130",
            "date": "2026-11-30",
            "notes": "CUDA events around forward+argmax+copy to host; 3 warm-up, 10 repeats. "
                     "Serving configs: fifo (whole prompts <= 4096 tokens/step), chunked "
                     "(budget 512), priority (chunked + priority - floor(wait/2s)); 64 slots.",
        },
        "engine": dict(REFBENCH_ENGINE),
        "prefill": prefill,
        "decode": decode,
        "mixed": mixed,
    }, str(path))
