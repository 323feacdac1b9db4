"""``FittedCostModel``: the physics step-cost model (``simulator.cost.physics``) with
coefficients fitted to a profile (``simulator.cost.fit``), behind the interface the
simulator's replicas call (the same as ``ProfileCostModel``'s).

Every step time comes from the one compiled kernel ``physics.step_ms`` (its
constants in ``FittedCostModel.c``), so Python callers, ``decode_times`` and a
compiled event loop calling the kernel agree to the bit. Optional
seeded step-time noise (``simulator.cost.noise``: jitter, slow episodes, stalls) is
applied to each step.

Engine facts a profile's rows cannot show are read from its ``engine`` section when
present: ``bookkeeping_ms`` and ``bookkeeping_seq_ms`` (host time between steps, per
step and per sequence in it), ``decode_blocks_per_sm`` / ``decode_wave_cost``
(where decode attention spills into further waves) and ``step_tail`` (what slow
episodes and stalls add to a typical step on average; applied to every step when the
step-time noise is off, since the noise draws them otherwise);
``simulator.cost.calibration`` measures them on recorded serving runs.

A profile may carry its fit in ``meta.fit`` (``latsim fit --write``, or the
coefficients ``latsim calibrate`` fitted to a recorded run): it is used only while
its content hash matches the profile's rows, engine facts and the fit's settings;
otherwise the rows are fitted again (``fitted_constants``).

``FittedCostConfig`` is the ``model.cost`` section of ``kind: fitted`` and
``build_fitted`` builds the model from it (the signature the cost-model registry
calls).
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import ClassVar, Literal, Optional, Sequence

import numpy as np
from pydantic import Field

from simulator.config.strict import StrictModel

from simulator.cost import physics as ph
from simulator.cost.chunks import ChunkArrays
from simulator.cost.counts import LookupCounts, new_counts
from simulator.cost.fit import FitResult, fit
from simulator.cost.fitstore import fit_from_dict, stored_fit_state
from simulator.cost.noise import NoiseModel
from simulator.cost.replica import ShapeSized

_FITS: dict = {}


class FittedCostConfig(ShapeSized, StrictModel):
    """``model.cost`` for the fitted physics model of a measured profile."""

    kind: Literal["fitted"] = "fitted"
    prices_verify: ClassVar[bool] = True     # the physics prices a verify step
    path: str = "profiles/h200-llama3-8b-refbench.json"
    noise: bool = Field(False, description="seeded step-time noise: jitter, slow episodes "
                                            "and stalls (simulator.cost.noise)")
    scale: float = Field(1.0, gt=0, description="multiply every step time (what-if)")


def fitted_constants(profile: dict, *, cv: bool = False) -> FitResult:
    """The fit of ``profile``: the one stored in its ``meta.fit`` when that still
    matches the profile (``fitstore.stored_fit_state``: same rows, engine facts and fit
    settings, by content hash; with ``cv``, only if it holds leave-one-out errors),
    else a fit of its rows. Cached by content: a sweep builds many cost models from
    one profile and a fit takes a second or two."""
    key = (hashlib.sha256(json.dumps(profile, sort_keys=True, default=str).encode()).hexdigest(),
           cv)
    res = _FITS.get(key)
    if res is None:
        res = fit_from_dict(profile)
        if res is not None and cv and not np.isfinite(res.cv_residuals).any():
            res = None
        if res is None:
            res = fit(profile, cv=cv)
            state = stored_fit_state(profile)
            if state == "stale":
                res.source = ("fitted to the profile's rows (its meta.fit is stale: the rows, "
                              "engine facts or fit settings changed since it was stored)")
        _FITS[key] = res
    return res


def step_tail(profile: dict) -> float:
    """The profile's ``engine.step_tail`` (1 when absent or not a sane factor): the mean
    over the typical time of a real step, measured on recorded runs
    (``simulator.cost.calibration``)."""
    from simulator.cost.profile import STEP_TAIL_RANGE
    lo, hi = STEP_TAIL_RANGE
    v = (profile.get("engine") or {}).get("step_tail")
    return float(v) if isinstance(v, (int, float)) and lo <= v <= hi else 1.0


class FittedCostModel(LookupCounts):
    """Step time (seconds) of a step, from the fitted physics model.

    ``scale`` multiplies every step (what-if); ``noise`` turns on the seeded
    step-time noise drawn from ``rng``; ``bookkeeping_ms`` / ``bookkeeping_seq_ms``
    (per step, and per sequence in the step) set the host time between steps that
    the profile's rows do not include (default: the profile's
    ``engine.bookkeeping_ms`` and ``engine.bookkeeping_seq_ms``, 0 when absent);
    ``fit_result`` reuses a fit; ``noise_model`` replaces the noise parameters taken
    from the profile (``NoiseModel.from_profile``)."""

    not_monotone: ClassVar[Optional[str]] = None    # the physics never charges more work less
    compiled_kernels: ClassVar[Optional[str]] = "physics"   # ``physics``', in the compiled loop

    def __init__(self, profile: dict, *, scale: float = 1.0, noise: bool = False,
                 rng: Optional[np.random.Generator] = None,
                 fit_result: Optional[FitResult] = None,
                 bookkeeping_ms: Optional[float] = None,
                 bookkeeping_seq_ms: Optional[float] = None,
                 noise_model: Optional[NoiseModel] = None) -> None:
        self.profile = profile
        self.fit = fit_result if fit_result is not None else fitted_constants(profile)
        c = self.fit.c.copy()
        if bookkeeping_ms is not None:
            c[ph.C_BOOK_MS] = float(bookkeeping_ms)
        if bookkeeping_seq_ms is not None:
            c[ph.C_BOOK_SEQ_MS] = float(bookkeeping_seq_ms)
        # Real steps come with slow episodes and stalls (``noise``); a fit follows the
        # typical step. Without noise every step takes on their measured mean
        # (``engine.step_tail``), so busy time matches; with noise they are drawn.
        tail = 1.0 if noise else step_tail(profile)
        c[ph.C_SCALE] = float(scale) * tail
        self.c = c
        self.scale = float(scale)
        self.padded = c[ph.C_PADDED] > 0.0
        self.CL = new_counts()
        self._chunks = ChunkArrays()
        self._rng = rng if noise else None
        if noise:
            self.noise = noise_model if noise_model is not None else NoiseModel.from_profile(profile)
            if self._rng is None:
                self._rng = np.random.default_rng(0)
        else:
            self.noise = None

    # -- single lookups (reports) -------------------------------------------------------
    def prefill_ms(self, chunk: int, prior: int) -> float:
        """Milliseconds of a prefill-only step of one chunk that completes its prompt
        (as a profile's prefill row times it: no bookkeeping, no scale, no noise)."""
        self.lookups += 1
        n, p, f = np.array([chunk], np.int64), np.array([prior], np.int64), np.ones(1, np.bool_)
        if ph.outside_range(self.c, 0, 0, 0, n, p, f, 1):
            self.extrapolations += 1
        return float(ph.step_core_ms(self.c, 0, 0, 0, n, p, f, 1, False))

    def decode_ms(self, batch: int, context: float) -> float:
        """Milliseconds of a decode-only step of ``batch`` sequences at ``context`` each
        (as a profile's decode row times it)."""
        self.lookups += 1
        z, f = np.zeros(1, np.int64), np.zeros(1, np.bool_)
        cs = batch * context
        if ph.outside_range(self.c, batch, context, cs, z, z, f, 0):
            self.extrapolations += 1
        return float(ph.step_core_ms(self.c, batch, context, cs, z, z, f, 0, False))

    # -- the simulator's interface ------------------------------------------------------
    def stepping_constants(self) -> np.ndarray:
        """``c`` with its decode table (``physics.with_decode_table``): what the event
        loops step with (the same bits as ``c``, faster). Rebuilt whenever ``c``'s
        values change (replaced or edited in place: compared byte for byte, ~0.1 µs)."""
        key = self.c.tobytes()
        if getattr(self, "_stepping_key", None) != key:
            self._stepping = ph.with_decode_table(self.c)
            self._stepping_key = key
        return self._stepping

    def step_time(self, n_decode: int, decode_ctx_max: int, decode_ctx_sum: int,
                  chunks: Sequence[tuple]) -> float:
        """Seconds for one step of ``n_decode`` decodes and prefill chunks, each
        ``(n, prior)`` or ``(n, prior, completes_prompt)`` (a chunk given without the
        flag completes its prompt, as a profile's prefill rows do)."""
        k = self._chunks.pack(chunks)
        n, p, f = self._chunks.n, self._chunks.p, self._chunks.f
        completes = bool(f[:k].any())
        ms = ph.counted_step_ms(self.stepping_constants(), self.CL, n_decode, decode_ctx_max,
                                decode_ctx_sum, n, p, f, k)
        if self.noise is not None:
            ms = self.noise.next(self._rng, ms, completes)
        return ms / 1000.0

    def verify_time(self, n_decode: int, q: int, decode_ctx_max: int, decode_ctx_sum: int,
                    chunks: Sequence[tuple]) -> float:
        """Seconds for a speculative-decoding verify step: each of ``n_decode``
        sequences runs ``q`` tokens (its last one and ``q - 1`` drafts) through the
        model (``physics.verify_ms``), with the step's prefill chunks."""
        k = self._chunks.pack(chunks)
        n, p, f = self._chunks.n, self._chunks.p, self._chunks.f
        ms = ph.verify_ms(self.stepping_constants(), n_decode, q, decode_ctx_max,
                          decode_ctx_sum, n, p, f, k)
        self.lookups += 1
        if ph.outside_range(self.c, n_decode * q, decode_ctx_max, decode_ctx_sum * q, n, p, f, k):
            self.extrapolations += 1
        if self.noise is not None:
            ms = self.noise.next(self._rng, ms, bool(f[:k].any()))
        return ms / 1000.0

    def decode_times(self, batch: int, ctx0: float, k: int) -> list:
        """Seconds of ``k`` consecutive decode-only steps of ``batch`` requests whose
        context (the longest, if decode attention is padded; the mean, if paged) is
        ``ctx0`` at the first step and grows by one per step: exactly ``k`` calls of
        ``step_time`` (the same kernel, the same noise draws)."""
        # Padded: ``ctx0`` is the longest context; paged: the mean, so the sum is
        # ``batch * ctx0`` (the model reads only the one its engine's attention follows).
        out = np.empty(k)
        ph.counted_decode_run_ms(self.stepping_constants(), self.CL, batch, ctx0, k, out)
        if self.noise is not None:
            self.noise.run(self._rng, out)
        return (out / 1000.0).tolist()

    @property
    def min_step_s(self) -> float:
        """A lower bound on any step (s). Every step holds a decode or a prefill token,
        and the model never charges more work less, so the cheaper of one decode at
        context 1 and a one-token prefill bounds every step; shrunk for noise."""
        one = np.ones(1, dtype=np.int64)
        zero = np.zeros(1, dtype=np.int64)
        f = np.zeros(1, dtype=np.bool_)
        ms = min(ph.step_ms(self.c, 1, 1, 1, one, zero, f, 0),
                 ph.step_ms(self.c, 0, 0, 0, one, zero, f, 1))
        lo = self.noise.min_factor() if self.noise is not None else 1.0
        return ms * lo / 1000.0

    def compiled_reason(self) -> Optional[str]:
        """None: the compiled loop prices its steps with the same physics kernels, unless
        they are noisy (the noise draws are the Python model's own)."""
        return "cost noise" if self._rng is not None or self.noise is not None else None

    def describe(self) -> dict:
        """What the model fitted and how well, for the run's summary."""
        f = self.fit
        out = {
            "kind": "fitted",
            "decode_attention": "padded" if self.padded else "paged",
            "cuda_graphs": bool(self.c[ph.C_GRAPHS] > 0.0),
            "hardware": f.hardware,
            "fit_source": f.source,
            "step_tail": step_tail(self.profile) if self.noise is None else 1.0,
            "coefficients": {k: round(v, 5) for k, v in f.coefficients().items()},
            "decode_blocks_per_sm": float(self.c[ph.C_DEC_BLOCKS_PER_SM]),
            "bookkeeping_ms": float(self.c[ph.C_BOOK_MS]),
            "bookkeeping_seq_ms": float(self.c[ph.C_BOOK_SEQ_MS]),
            "fit_errors": {k: {a: {kk: (round(vv, 4) if isinstance(vv, float) else vv)
                                   for kk, vv in b.items()} for a, b in v.items() if b["n"]}
                           for k, v in f.errors.items()},
            "fallbacks": dict(f.fallbacks),
            "noise": self.noise.describe() if self.noise is not None else None,
        }
        if not math.isfinite(sum(f.coefficients().values())):
            out["warning"] = "non-finite coefficient"
        return out


def build_fitted(cfg: FittedCostConfig, rng, base_dirs: Sequence[Path],
                 profile: Optional[dict] = None) -> FittedCostModel:
    """The model a ``kind: fitted`` config describes (the profile is read from
    ``cfg.path`` unless given)."""
    if profile is None:
        from simulator.cost.profile import load_profile, resolve_profile_path

        profile = load_profile(resolve_profile_path(cfg.path, base_dirs))
    return FittedCostModel(profile, scale=cfg.scale, noise=cfg.noise, rng=rng)
