"""A fit as a profile stores it (``meta.fit``) and as reports describe it.

A fit of a profile's rows (``simulator.cost.fit``) takes seconds with its
leave-one-out errors, so ``latsim fit --write`` and ``latsim calibrate`` store it in
the profile: every coefficient at full precision, under a ``digest`` of everything
the fit depends on (the rows, the model shape and hardware, the engine facts it
reads, the fit's own settings). A cost model reuses it only while the digest still
matches (``stored_fit_state``), else fits the rows again. ``MEANINGS`` and
``physical_rates`` put the coefficients into words and achieved rates.
"""
from __future__ import annotations

import numpy as np

from simulator.cost import physics as ph
from simulator.cost.fit import (ACT_PASSES_D, ACT_PASSES_FFN, DROP_ORDER, E_ACT, HARDWARE, HUBER,
                                MODEL_SIGMA, NO_BOUND_GBS, PARAMS, PRIOR, WAVE_BLOCKS_GRID,
                                WAVE_COST_GRID, WAVE_GAIN, FitResult, base_constants)
from simulator.cost.rows import KINDS, monotone_envelope, predict_rows, profile_rows

# Bumped whenever what a fit computes changes in a way the digest below cannot see.
FIT_FORMAT = 1
# The engine facts ``base_constants`` and ``fit`` read: a stored fit is of these too.
_FIT_ENGINE_KEYS = ("decode_attention", "cuda_graphs", "graph_batch_buckets",
                    "decode_blocks_per_sm", "decode_wave_cost", "bookkeeping_ms",
                    "bookkeeping_seq_ms")
_FIT_META_KEYS = ("model", "dtype", "hardware", "peak_tflops", "hbm_gbs", "sms")
_ROW_KEYS = ("batch", "context", "chunk", "prior", "ms", "p10", "p90")
_WAVE_INDEX = {"decode_blocks_per_sm": ph.C_DEC_BLOCKS_PER_SM,
               "decode_wave_cost": ph.C_WAVE_COST}


def fit_digest(profile: dict) -> str:
    """A content hash of everything a fit of ``profile`` depends on: its rows (the
    fields ``profile_rows`` reads), the model shape and hardware in ``meta``, the engine
    facts the fit reads, and the fit's own settings (bounds, defaults, weights). A
    stored fit is reused only while this matches."""
    import hashlib
    import json

    meta = profile.get("meta") or {}
    eng = profile.get("engine") or {}
    doc = {
        "format": FIT_FORMAT,
        "rows": {k: [{f: r.get(f) for f in _ROW_KEYS if f in r}
                     for r in (profile.get(k) or [])] for k in KINDS},
        "meta": {k: meta.get(k) for k in _FIT_META_KEYS},
        "engine": {k: eng.get(k) for k in _FIT_ENGINE_KEYS},
        "settings": [PARAMS, DROP_ORDER, ACT_PASSES_D, ACT_PASSES_FFN, E_ACT, NO_BOUND_GBS,
                     MODEL_SIGMA, PRIOR, HUBER, WAVE_BLOCKS_GRID, WAVE_COST_GRID, WAVE_GAIN,
                     ph.N_CONST, sorted(HARDWARE.items())],
    }
    text = json.dumps(doc, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _finite_or_none(a) -> list | None:
    if a is None:
        return None
    return [float(v) if np.isfinite(v) else None for v in np.asarray(a, float)]


def fit_to_dict(res: FitResult, profile: dict, source: str | None = None) -> dict:
    """``res`` as the JSON ``meta.fit`` stores: every fitted coefficient at full
    precision (so a reload gives the same constants to the bit), the wave facts the fit
    used, what was free, the fallbacks with their reasons, the error statistics and the
    leave-one-out residuals, under the ``digest`` of the profile it fits."""
    coeffs = {ph.NAMES[p[0]]: float(res.c[p[0]]) for p in PARAMS}
    coeffs["decode_blocks_per_sm"] = float(res.c[ph.C_DEC_BLOCKS_PER_SM])
    coeffs["decode_wave_cost"] = float(res.c[ph.C_WAVE_COST])
    return {"format": FIT_FORMAT, "digest": fit_digest(profile),
            "source": source or res.source, "hardware": res.hardware,
            "coefficients": coeffs, "free": list(res.free),
            "fallbacks": dict(res.fallbacks), "errors": res.errors,
            "cv_residuals": _finite_or_none(res.cv_residuals),
            "cv_capped": _finite_or_none(res.cv_capped)}


def stored_fit_state(profile: dict) -> str:
    """``"absent"``, ``"stale"`` (the rows, engine facts or fit settings changed since it
    was stored, or it is malformed) or ``"valid"``: whether ``meta.fit`` may be used."""
    d = (profile.get("meta") or {}).get("fit")
    if d is None:
        return "absent"
    if (not isinstance(d, dict) or d.get("format") != FIT_FORMAT
            or d.get("digest") != fit_digest(profile)
            or not isinstance(d.get("coefficients"), dict)):
        return "stale"
    names = {ph.NAMES[p[0]] for p in PARAMS} | {"decode_blocks_per_sm", "decode_wave_cost"}
    co = d["coefficients"]
    if set(co) != names or not all(isinstance(v, (int, float)) and np.isfinite(v)
                                   for v in co.values()):
        return "stale"
    return "valid"


def fit_from_dict(profile: dict) -> FitResult | None:
    """The fit stored in ``profile["meta"]["fit"]`` when ``stored_fit_state`` says it is
    valid, else None (the caller then fits the rows). Residuals are recomputed from the
    stored constants; the leave-one-out ones are read back (NaN where absent)."""
    if stored_fit_state(profile) != "valid":
        return None
    d = profile["meta"]["fit"]
    c = base_constants(profile)
    for name, v in d["coefficients"].items():
        c[_WAVE_INDEX.get(name) or ph.INDEX[name]] = float(v)
    rows = profile_rows(profile)
    graphs = bool(c[ph.C_GRAPHS] > 0)
    target = monotone_envelope(rows, graphs)

    def arr(key):
        v = d.get(key)
        if not isinstance(v, list) or len(v) != len(rows):
            return np.full(len(rows), np.nan)
        return np.array([np.nan if x is None else float(x) for x in v])

    pred = predict_rows(c, rows)
    return FitResult(c=c, free=list(d.get("free") or []), fallbacks=dict(d.get("fallbacks") or {}),
                     hardware=str(d.get("hardware", "")), rows=rows,
                     residuals=pred / rows.ms - 1.0, cv_residuals=arr("cv_residuals"),
                     targets=target, cv_capped=arr("cv_capped"),
                     errors=dict(d.get("errors") or {}),
                     source=f"stored fit (meta.fit: {d.get('source', 'latsim fit')})")


# What each fitted coefficient means, for ``latsim fit`` and reports.
MEANINGS = {
    "h_step_ms": "host time of every eager step (launches, step building), ms",
    "h_decode_ms": "host time added by a decode batch (its attention launches), ms",
    "h_chunk_ms": "host time added per prefill chunk, ms",
    "h_prefix_ms": "host time added per chunk after a cached prefix (mask, gather), ms",
    "h_graph_ms": "host time of a CUDA-graph replay of a decode step, ms",
    "e_weights": "weight streaming: achieved share of HBM bandwidth",
    "e_gemm": "linear layers: achieved share of peak TFLOP/s",
    "e_flash": "causal prefill attention (no prefix): share of peak TFLOP/s",
    "e_masked": "prefill attention over a cached prefix: share of peak TFLOP/s",
    "cta_prefix_gbs": "one thread block streaming a prefix's keys, GB/s",
    "e_decode": "decode attention K/V reads: share of HBM bandwidth",
    "cta_decode_gbs": "one thread block streaming one head's keys in decode, GB/s",
    "e_decode_eager": "decode attention inside an eager step of a graphed engine: share of HBM",
    "dev_per_host": "kernels' minimum device time per unit of host launch time",
    "p_step": "sharpness of the host/device overlap (p-norm)",
    "p_attn": "sharpness of the latency/throughput bound of attention (p-norm)",
    "p_gemm": "sharpness of the weight-read/FLOP bound of the GEMMs (p-norm)",
    "decode_blocks_per_sm": "decode-attention blocks resident per SM (0: no wave limit)",
    "decode_wave_cost": "share of the one-block latency each further decode wave pays",
}


def physical_rates(c: np.ndarray) -> dict:
    """The efficiencies as achieved rates (TFLOP/s, GB/s) on the profile's peaks."""
    pk, bw = float(c[ph.C_PEAK_TFLOPS]), float(c[ph.C_HBM_GBS])
    return {"gemm_tflops": pk * c[ph.C_E_GEMM], "weights_gbs": bw * c[ph.C_E_WEIGHTS],
            "flash_tflops": pk * c[ph.C_E_FLASH], "masked_tflops": pk * c[ph.C_E_MASKED],
            "decode_attention_gbs": bw * c[ph.C_E_DECODE],
            "peak_tflops": pk, "hbm_gbs": bw}
