"""Fit the physics step-cost model (``simulator.cost.physics``) to a profile's rows.

Every row of the profile (``prefill``, ``decode``, ``mixed``, and the optional
``decode_eager`` and ``prefill_partial``) is one measured step. The non-negative
coefficients (host milliseconds, efficiencies, one-block rates, transition
exponents, the kernels' device floor) are fitted to all of them at once by minimising
a robust (Huber) loss of the relative error, ``log(predicted / measured)``, with the
projected Levenberg-Marquardt solver (``simulator.cost.solve``) on the logarithms of
the coefficients (so they stay positive and within physical bounds), plus a weak pull
towards typical values that only decides what the rows leave open. numpy only.

- Targets: timing noise only ever adds time, so a row measured slower than a row
  that holds at least its work carries noise, not cost: each row's median is capped
  by the rows that dominate it (``rows.monotone_envelope``).
- Weights: a row whose repeats spread widely (p10 to p90) pulls less.
- Where decode attention spills into a further wave of thread blocks is a step
  function of the batch, chosen on a grid; a profile measured at powers of two
  cannot place it, so it comes from the profile's ``engine.decode_blocks_per_sm`` and
  ``engine.decode_wave_cost`` when given (``runs.measure_decode_waves`` measures them
  on recorded serving steps), else from the grid only where clearly better.

A profile that lacks the rows a term needs does not fit that term: it is tied to a
stated neighbour or fixed at a stated default, and ``FitResult.fallbacks`` says why.
The report gives the in-sample and leave-one-out relative errors per row kind, both
against the measured medians and against the capped ones. A fit stored in the
profile (``meta.fit``) is ``simulator.cost.fitstore``'s.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from simulator.cost import physics as ph
from simulator.cost.rows import (KINDS, Rows, dominates, monotone_envelope, predict_rows,
                                 profile_rows)
from simulator.cost.solve import solve

# Peak rates of known GPUs (dense bf16 TFLOP/s, memory GB/s). The H200 numbers are
# the ones measured on the reference H200 (an 8192^3 bf16 matmul; a device-to-device
# copy counting read and write); others are datasheet values, to be used with
# efficiencies fitted or assumed for them.
HARDWARE = {
    "H200": {"peak_tflops": 775.0, "hbm_gbs": 4282.0, "sms": 132,
             "source": "measured on the reference H200 (bf16 matmul, D2D copy)"},
    "H100": {"peak_tflops": 989.0, "hbm_gbs": 3350.0, "sms": 132, "source": "H100 SXM datasheet"},
    "A100": {"peak_tflops": 312.0, "hbm_gbs": 2039.0, "sms": 108,
             "source": "A100 80GB SXM datasheet"},
}

# Elementwise passes per token per layer of an eager Llama layer, in units of d_model
# (two RMSNorms, rotary on q and k, residual adds, attention output) and of the FFN
# width (SiLU and the gate-up product). Not identifiable from per-token time next to
# the GEMMs on one GPU, so it is a stated count with a fixed efficiency, not a fit.
ACT_PASSES_D = 12.0
ACT_PASSES_FFN = 5.0
E_ACT = 0.8

# (index, default, lower, upper): the fitted coefficients in their physical units. The
# defaults are typical values (a datasheet-minded guess) that the fit starts from and
# weakly pulls towards where the rows leave a coefficient open.
PARAMS = [
    (ph.C_H_STEP, 8.0, 0.01, 500.0),
    (ph.C_H_DECODE, 1.0, 1e-3, 500.0),
    (ph.C_H_CHUNK, 1.0, 1e-3, 500.0),
    (ph.C_H_PREFIX, 1.0, 1e-3, 500.0),
    (ph.C_H_GRAPH, 5.0, 0.01, 500.0),
    (ph.C_E_WEIGHTS, 0.8, 0.02, 1.5),
    (ph.C_E_GEMM, 0.6, 0.01, 1.2),
    (ph.C_E_FLASH, 0.4, 0.005, 1.2),
    (ph.C_E_MASKED, 0.2, 1e-4, 1.2),
    (ph.C_CTA_PREFIX, 20.0, 0.05, 1e5),
    (ph.C_E_DECODE, 0.3, 1e-3, 1.5),
    (ph.C_CTA_DECODE, 20.0, 0.05, 1e5),
    (ph.C_E_DECODE_EAGER, 0.3, 1e-3, 1.5),
    (ph.C_DEV_PER_HOST, 0.25, 1e-3, 1.0),
    (ph.C_P_STEP, 4.0, 1.2, 24.0),
    (ph.C_P_ATTN, 2.0, 1.0, 24.0),
    (ph.C_P_GEMM, 4.0, 1.2, 24.0),
]
# When the rows are too few for all of them, terms are given up in this order.
DROP_ORDER = [ph.C_DEV_PER_HOST, ph.C_P_GEMM, ph.C_P_ATTN, ph.C_CTA_PREFIX, ph.C_CTA_DECODE,
              ph.C_H_PREFIX, ph.C_E_MASKED, ph.C_E_DECODE_EAGER, ph.C_H_DECODE, ph.C_P_STEP,
              ph.C_E_FLASH, ph.C_E_WEIGHTS, ph.C_H_CHUNK]
NO_BOUND_GBS = 1e6      # a one-block rate so high the latency term vanishes
MODEL_SIGMA = 0.01      # the error a steady row is expected to have (1.7% repeatability)
PRIOR = 0.02            # weight of the pull towards the defaults (per unit of log)
HUBER = 0.02            # relative error beyond which a row's pull is capped
WAVE_BLOCKS_GRID = (1, 2, 3, 4, 6, 8, 12, 16)
WAVE_COST_GRID = (0.5, 1.0)
WAVE_GAIN = 0.02        # a wave limit must lower the loss by this share to be adopted


def hardware_of(profile: dict) -> tuple[dict, str]:
    """Peak rates for the profile's GPU: ``meta.peak_tflops`` / ``meta.hbm_gbs`` when
    given, else the table above by name, else H200's (efficiencies are then relative
    to those), with a note saying which."""
    meta = profile.get("meta") or {}
    if meta.get("peak_tflops") and meta.get("hbm_gbs"):
        return ({"peak_tflops": float(meta["peak_tflops"]), "hbm_gbs": float(meta["hbm_gbs"]),
                 "sms": int(meta.get("sms") or 132)}, "meta.peak_tflops / meta.hbm_gbs")
    hw = str(meta.get("hardware") or "")
    for name, v in HARDWARE.items():
        if name.lower() in hw.lower():
            return v, f"{name}: {v['source']}"
    v = HARDWARE["H200"]
    return v, f"hardware {hw!r} not known: H200's peaks, efficiencies relative to them"


def _model_shape(profile: dict) -> dict:
    """The model's dimensions from ``meta.model`` (checked by ``profile.check_profile``):
    its mapping, or the catalogued model it names; Llama-3-8B's where it says none."""
    m = (profile.get("meta") or {}).get("model") or {}
    if isinstance(m, str):
        from simulator.cost import catalog
        a = catalog.model(m)
        m = {"n_layers": a.layers, "d_model": a.hidden, "n_heads": a.heads,
             "n_kv_heads": a.kv_heads, "head_dim": a.head_dim, "ffn": a.ffn, "vocab": a.vocab}
    L = int(m.get("n_layers", 32))
    d = int(m.get("d_model", 4096))
    hq = int(m.get("n_heads", 32))
    hkv = int(m.get("n_kv_heads", hq))
    hd = int(m.get("head_dim", d // hq))
    ffn = int(m.get("ffn", 4 * d))
    vocab = int(m.get("vocab", 32000))
    return dict(L=L, d=d, hq=hq, hkv=hkv, hd=hd, ffn=ffn, vocab=vocab)


def base_constants(profile: dict) -> np.ndarray:
    """The constants vector for a profile: model shape from ``meta.model``, engine facts,
    peak rates, the fit's range, CUDA-graph buckets, and default coefficients."""
    s = _model_shape(profile)
    eng = profile.get("engine") or {}
    dtype = str((profile.get("meta") or {}).get("dtype", "bf16"))
    c = ph.new_constants()
    c[ph.C_LAYERS], c[ph.C_DMODEL], c[ph.C_HEADS] = s["L"], s["d"], s["hq"]
    c[ph.C_KV_HEADS], c[ph.C_HEAD_DIM], c[ph.C_FFN], c[ph.C_VOCAB] = (
        s["hkv"], s["hd"], s["ffn"], s["vocab"])
    c[ph.C_DTYPE_BYTES] = 4.0 if dtype in ("fp32", "float32") else 2.0
    # q, k, v, o projections and the three SwiGLU matrices of every layer.
    c[ph.C_PARAMS_LINEAR] = s["L"] * (s["d"] * (s["hq"] + 2 * s["hkv"]) * s["hd"]
                                      + s["hq"] * s["hd"] * s["d"] + 3 * s["d"] * s["ffn"])
    c[ph.C_ACT_D], c[ph.C_ACT_F], c[ph.C_E_ACT] = ACT_PASSES_D, ACT_PASSES_FFN, E_ACT
    c[ph.C_PADDED] = 1.0 if eng.get("decode_attention", "paged") == "padded" else 0.0
    c[ph.C_GRAPHS] = 1.0 if eng.get("cuda_graphs") else 0.0
    hw, _ = hardware_of(profile)
    c[ph.C_PEAK_TFLOPS], c[ph.C_HBM_GBS] = hw["peak_tflops"], hw["hbm_gbs"]
    c[ph.C_SMS] = hw["sms"]
    buckets = eng.get("graph_batch_buckets") or []
    if c[ph.C_GRAPHS] and isinstance(buckets, list) and buckets:
        b = sorted(int(x) for x in buckets)[:ph.MAX_BUCKETS]
        c[ph.C_N_BUCKETS] = len(b)
        c[ph.C_BUCKETS:ph.C_BUCKETS + len(b)] = b
    for idx, default, _, _ in PARAMS:
        c[idx] = default
    c[ph.C_E_DECODE_EAGER] = c[ph.C_E_DECODE]
    c[ph.C_BOOK_MS] = float(eng.get("bookkeeping_ms") or 0.0)
    c[ph.C_BOOK_SEQ_MS] = float(eng.get("bookkeeping_seq_ms") or 0.0)
    rows = profile_rows(profile)
    pre = rows.has_chunk
    dec = rows.nd > 0
    tokens = rows.nd + rows.chn
    c[ph.C_RANGE_TOKENS] = float(tokens.max())
    c[ph.C_RANGE_CHUNK] = float(rows.chn[pre].max()) if pre.any() else 0.0
    c[ph.C_RANGE_CONTEXT] = float((rows.chn + rows.chp)[pre].max()) if pre.any() else 0.0
    c[ph.C_RANGE_BATCH] = float(rows.nd[dec].max()) if dec.any() else 0.0
    c[ph.C_RANGE_DECODE_CTX] = float(rows.ctx_max[dec].max()) if dec.any() else 0.0
    return c


def plan_terms(rows: Rows, c: np.ndarray) -> tuple[list, dict, dict]:
    """Which coefficients the rows can fit: ``(free, ties, fallbacks)``; ``ties`` maps
    a coefficient to the one it copies, ``fallbacks`` names each one not fitted and
    why."""
    graphs = c[ph.C_GRAPHS] > 0
    free = [p[0] for p in PARAMS]
    ties: dict = {}
    why: dict = {}

    def fix(idx, reason, tie=None, value=None):
        if idx in free:
            free.remove(idx)
        if tie is not None:
            ties[idx] = tie
        if value is not None:
            c[idx] = value
        why[ph.NAMES[idx]] = reason

    pre = rows.has_chunk & (rows.nd == 0)
    prefixed = rows.has_chunk & (rows.chp > 0)
    flash = pre & (rows.chp == 0)
    eager_dec = (rows.nd > 0) & (rows.eager | rows.has_chunk | (not graphs))
    if prefixed.sum() < 3 or len(set(rows.chn[prefixed])) < 2:
        fix(ph.C_H_PREFIX, "fewer than 3 rows with a cached prefix (or one chunk size): "
            "no extra host cost for a prefixed chunk", value=0.0)
        fix(ph.C_E_MASKED, "no rows with a cached prefix: a prefixed chunk's attention is "
            "priced at the flash efficiency", tie=ph.C_E_FLASH)
        fix(ph.C_CTA_PREFIX, "no rows with a cached prefix: no one-block latency bound",
            value=NO_BOUND_GBS)
    if flash.sum() < 3 or len(set(rows.chn[flash])) < 3:
        fix(ph.C_E_FLASH, "fewer than 3 prefill sizes without a prefix: flash attention "
            "efficiency fixed at its default", value=0.4)
    dec = (rows.nd > 0) & ~rows.has_chunk
    if len(set(rows.nd[dec])) < 2 or len(set(rows.ctx_max[dec])) < 2:
        fix(ph.C_CTA_DECODE, "decode rows span fewer than 2 batches and 2 contexts: no "
            "one-block latency bound", value=NO_BOUND_GBS)
    if not graphs:
        fix(ph.C_H_GRAPH, "engine has no CUDA graphs: unused", value=0.0)
        fix(ph.C_E_DECODE_EAGER, "engine has no CUDA graphs: every step is eager",
            tie=ph.C_E_DECODE)
    elif not eager_dec.any():
        fix(ph.C_E_DECODE_EAGER, "no eager step with decodes (decode_eager or mixed rows): "
            "eager decode attention priced as graphed", tie=ph.C_E_DECODE)
    if not eager_dec.any() or not pre.any():
        fix(ph.C_H_DECODE, "no eager step with decodes to compare with prefill-only steps: "
            "no extra host cost for a decode batch", value=0.0)
    if not (rows.has_chunk & (rows.nd > 0)).any():
        fix(ph.C_DEV_PER_HOST, "no mixed rows (the steps whose device time shows the "
            "kernels' minimum durations): fixed at its default", value=0.2)
    n = len(rows)
    for idx in DROP_ORDER:
        if n >= len(free) + 3:
            break
        if idx in free:
            fix(idx, f"only {n} rows for {len(free)} coefficients: fixed at its default")
    return free, ties, why


def with_log_coefficients(c: np.ndarray, free: list, ties: dict, x: np.ndarray) -> np.ndarray:
    """A copy of ``c`` with the coefficients ``free`` set to ``exp(x)`` and each tied
    one (``ties``: ``{tied: source}``) to its source's value."""
    out = c.copy()
    out[free] = np.exp(x)
    for k, v in ties.items():
        out[k] = out[v]
    return out


def row_scale(rows: Rows) -> np.ndarray:
    """How much each row's error counts: ``MODEL_SIGMA / sqrt(MODEL_SIGMA^2 + s^2)``,
    ``s`` the uncertainty of the row's median from its p10-p90 spread (a log-normal
    spread over ``n = 10`` repeats): a noisy row pulls less than a steady one."""
    spread = np.log(np.maximum(rows.p90, rows.ms) / np.minimum(rows.p10, rows.ms)) / 2.5631
    s = 1.2533 * spread / np.sqrt(10.0)
    return MODEL_SIGMA / np.sqrt(MODEL_SIGMA ** 2 + s ** 2)


def _solve(c, free, ties, rows, x0, lo, hi, iters=200):
    """``solve`` (the shared solver, with its defaults: they are this fit's) on the
    log-coefficients ``free``: Huber-weighted log errors of the rows (``row_scale``),
    plus a weak pull of every coefficient towards its default (``PRIOR``, Huber-capped
    like the rows), which only decides between coefficients the rows cannot tell
    apart. Returns ``(x, residuals, loss)``."""
    logm = np.log(rows.ms)
    scale = row_scale(rows)
    default = {p[0]: np.log(p[1]) for p in PARAMS}
    xp = np.array([default[i] for i in free])
    # The exponents have no typical value to pull towards: they start at one, no more.
    pw = np.array([0.0 if i in (ph.C_P_STEP, ph.C_P_ATTN, ph.C_P_GEMM) else PRIOR
                   for i in free])

    def resid(xv):
        pred = predict_rows(with_log_coefficients(c, free, ties, xv), rows)
        return np.concatenate([(np.log(np.maximum(pred, 1e-12)) - logm) * scale,
                               pw * (xv - xp)])

    return solve(resid, x0, lo, hi, huber=HUBER, iters=iters)


@dataclass
class FitResult:
    """A fitted constants vector and how well it fits (module doc)."""

    c: np.ndarray
    free: list
    fallbacks: dict
    hardware: str
    rows: Rows
    residuals: np.ndarray            # in-sample predicted / measured - 1
    cv_residuals: np.ndarray         # leave-one-out predicted / measured - 1 (NaN: not run)
    targets: np.ndarray = None       # what was fitted: the medians capped by the envelope
    cv_capped: np.ndarray = None     # leave-one-out error against the capped median
    errors: dict = field(default_factory=dict)
    source: str = "fitted to the profile's rows"

    def coefficients(self) -> dict:
        """The fitted coefficients by name (physical units)."""
        return {ph.NAMES[p[0]]: float(self.c[p[0]]) for p in PARAMS}


def error_stats(err) -> dict:
    """``n``, median, 90th percentile and maximum of absolute relative errors (the
    finite ones)."""
    a = np.abs(np.asarray(err, float))
    a = a[np.isfinite(a)]
    if not len(a):
        return {"n": 0}
    return {"n": int(len(a)), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "max": float(a.max())}


HOST_TERMS = (ph.C_H_STEP, ph.C_H_DECODE, ph.C_H_CHUNK, ph.C_H_PREFIX, ph.C_H_GRAPH)


def _restarts(free: list, x0: np.ndarray) -> list:
    """Deterministic extra starting points: the kernel floor, the weight-streaming
    efficiency and the host/device sharpness set low and high in turn, and the host
    times scaled up and down (a large host share with a soft overlap and a small one
    with a hard overlap can meet the same rows: the ridge the restarts are for)."""
    out = []
    for dph, ew, ps, host in ((0.05, 0.5, 16.0, 1.0), (0.5, 0.9, 3.0, 1.0),
                              (0.25, 0.7, 8.0, 1.0), (0.25, 0.7, 4.0, 3.0),
                              (0.25, 0.7, 4.0, 1.0 / 3.0)):
        x = x0.copy()
        for idx, v in ((ph.C_DEV_PER_HOST, dph), (ph.C_E_WEIGHTS, ew), (ph.C_P_STEP, ps)):
            if idx in free:
                x[free.index(idx)] = np.log(v)
        for idx in HOST_TERMS:
            if idx in free:
                x[free.index(idx)] += np.log(host)
        out.append(x)
    return out


def _with_ms(rows: Rows, ms: np.ndarray) -> Rows:
    out = rows.subset(np.ones(len(rows), bool))
    out.ms = ms
    return out


def fit(profile: dict, *, cv: bool = True) -> FitResult:
    """Fit the model's coefficients to every row of ``profile`` (module doc); with
    ``cv`` also refit once per left-out row to measure the prediction error.

    The targets are the rows' medians capped by the monotone envelope
    (``monotone_envelope``); errors are reported against the measured medians."""
    rows = profile_rows(profile)
    c = base_constants(profile)
    graphs = bool(c[ph.C_GRAPHS] > 0)
    free, ties, why = plan_terms(rows, c)
    order = {p[0]: i for i, p in enumerate(PARAMS)}
    free.sort(key=order.__getitem__)
    lo = np.log([p[2] for p in PARAMS if p[0] in free])
    hi = np.log([p[3] for p in PARAMS if p[0] in free])
    x0 = np.log(c[free])
    target = _with_ms(rows, monotone_envelope(rows, graphs))
    eng = profile.get("engine") or {}
    if eng.get("decode_blocks_per_sm") is not None:
        grid = [(float(eng["decode_blocks_per_sm"]), float(eng.get("decode_wave_cost", 1.0)))]
    elif not c[ph.C_PADDED]:
        grid = [(0.0, 1.0)]
        why["decode_blocks_per_sm"] = ("paged decode attention splits its work by page, not "
                                      "by sequence: no waves of per-sequence blocks")
    else:
        grid = [(0.0, 1.0)] + [(o, k) for o in WAVE_BLOCKS_GRID for k in WAVE_COST_GRID]
    # Where a batch spills into one more wave of decode-attention blocks is a step
    # function of the batch, so it is chosen on a grid: no wave limit first, a limit
    # only where it fits clearly better (the first of equally good ones).
    best = None
    for occ, kappa in grid:
        c[ph.C_DEC_BLOCKS_PER_SM] = occ
        c[ph.C_WAVE_COST] = kappa
        x, _, f = _solve(c, free, ties, target, x0, lo, hi)
        if best is None or f < best[3] * (1.0 - WAVE_GAIN):
            best = (occ, kappa, x, f)
    c[ph.C_DEC_BLOCKS_PER_SM], c[ph.C_WAVE_COST], x = best[0], best[1], best[2]
    # The rows leave a ridge along which host/device shares and transition sharpness
    # trade off; the solver can stop on it short of the minimum, so it is restarted
    # from a few spread-out points and the lowest loss kept.
    f_best = best[3]
    for start in _restarts(free, x0):
        xs, _, fs = _solve(c, free, ties, target, start, lo, hi)
        if fs < f_best:
            x, f_best = xs, fs
    if len(grid) > 1 and best[0] == 0.0:
        why["decode_blocks_per_sm"] = ("no wave limit fits the profile clearly better than "
                                      "none (its batch sizes cannot place a cliff): smooth; "
                                      "set engine.decode_blocks_per_sm to impose one")
    best_c = with_log_coefficients(c, free, ties, x)
    resid = predict_rows(best_c, rows) / rows.ms - 1.0
    cv_res = np.full(len(rows), np.nan)
    cv_cap = np.full(len(rows), np.nan)
    if cv:
        for i in range(len(rows)):
            keep = np.ones(len(rows), bool)
            keep[i] = False
            train = rows.subset(keep)
            train = _with_ms(train, monotone_envelope(train, graphs))
            xi, _, _ = _solve(c, free, ties, train, x, lo, hi, iters=60)
            ci = with_log_coefficients(c, free, ties, xi)
            pred = predict_rows(ci, rows.subset(~keep))[0]
            cv_res[i] = pred / rows.ms[i] - 1.0
            # The left-out row capped by the rows that hold more work (only those:
            # the cap is computed as if this row were new).
            cap = rows.ms[i]
            others = np.where(keep)[0]
            for j in others:
                if rows.ms[j] < cap and dominates(rows, j, i, graphs):
                    cap = rows.ms[j]
            cv_cap[i] = pred / cap - 1.0
    hw = hardware_of(profile)[1]
    res = FitResult(c=best_c, free=[ph.NAMES[i] for i in free], fallbacks=why, hardware=hw,
                    rows=rows, residuals=resid, cv_residuals=cv_res, targets=target.ms,
                    cv_capped=cv_cap)
    fit_cap = predict_rows(best_c, rows) / target.ms - 1.0
    res.errors = {k: {"fit": error_stats(resid[rows.kind == k]),
                      "cv": error_stats(cv_res[rows.kind == k]),
                      "fit_capped": error_stats(fit_cap[rows.kind == k]),
                      "cv_capped": error_stats(cv_cap[rows.kind == k])}
                  for k in KINDS if (rows.kind == k).any()}
    return res
