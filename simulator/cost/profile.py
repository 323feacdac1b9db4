"""Step cost from a measured profile (``profiles/*.json``, format in profiles/README.md).

A step's time is looked up from what the engine was measured to take:

- prefill-only step of one chunk: ``P(chunk, prior)``, interpolated on both the
  chunk size and the cached prefix before it (a chunk after a prefix is slower);
- decode-only step: ``D(batch, context)``, where context is the longest context
  in the batch if the engine pads decode attention to it (``decode_attention:
  padded``), or the mean context if it is paged (cost follows the sum);
- a step with several parts (decodes plus chunks, or several chunks): the parts'
  times summed (the decode part from the ``decode_eager`` rows when the profile has
  them: an engine that captures decode steps in CUDA graphs runs mixed steps eagerly), minus ``alpha * floor`` for every part after the first. ``floor``
  is the fixed host cost of a step (the cheapest measured step, or the profile's
  ``host_overhead_ms``); the host cost is paid once, not once per part, and
  ``alpha`` is fitted by least squares to the profile's ``mixed`` rows (1 when
  there are none). Adding the parts' times naively would count the fixed cost
  twice.

The profile's ``engine.bookkeeping_ms`` (host work per step outside the timed rows:
scheduling, applying results) is added to every step.

Above the measured range the tables extrapolate linearly from their last two
points, and every such lookup is counted in ``extrapolations``; the run reports it.
Below the smallest measured size (a 3-token chunk, a context of 40) they hold the
smallest row's value: less work than the smallest measured step cannot cost more,
and small steps sit on the engine's fixed floor.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import ClassVar, Literal, Optional, Sequence

import numpy as np
from pydantic import Field

from simulator.config.strict import StrictModel

import simulator.cost.table as T
from simulator.cost.chunks import ChunkArrays
from simulator.cost.counts import LookupCounts, new_counts
from simulator.cost.replica import ShapeSized
from simulator.errors import LatsimError, read_text


class ProfileCostConfig(ShapeSized, StrictModel):
    """``model.cost`` for a measured profile."""

    kind: Literal["profile"] = "profile"
    path: str = "profiles/h200-llama3-8b-refbench.json"
    noise: bool = Field(False, description="multiply each step by seeded log-normal noise "
                                            "fitted to the profile's p10/p90 spread")
    scale: float = Field(1.0, gt=0, description="multiply every step time (what-if)")


REPO_ROOT = Path(__file__).resolve().parents[2]


def profile_search_dirs(base_dir: Path | None) -> list[Path]:
    """Where a relative profile path is looked up: scenario dir, cwd, repository root."""
    dirs = [Path(base_dir)] if base_dir is not None else []
    return dirs + [Path.cwd(), REPO_ROOT]


def resolve_profile_path(path: str, base_dirs: Sequence[Path]) -> Path:
    """Find a profile: absolute, or relative to each base dir (scenario dir, cwd, repo)."""
    p = Path(path)
    found = None
    if p.is_absolute():
        found = p if p.exists() else None
    else:
        found = next(((Path(d) / p).resolve() for d in base_dirs if (Path(d) / p).exists()), None)
    if found is None:
        raise LatsimError("profile file not found", source=str(path), field="model.cost.path")
    if found.is_dir():
        raise LatsimError("is a folder, not a profile", source=str(path), field="model.cost.path")
    return found


MAX_PROFILE_BYTES = 64 * 2**20   # measured profiles are KBs
_MAX_SIZE = 1e9                  # chunk, prior, batch, context: tokens or requests
_MAX_MS = 1e7                    # a step of ~3 hours is a broken row, not a measurement


# Row columns counted in tokens or requests: whole numbers; all but ``prior`` at least 1
# (a step of no tokens or no sequences measures nothing).
_COUNTS = ("chunk", "prior", "batch", "context")
# Optional per-row statistics: step times in ms (as ``ms``) and the repeat count.
_ROW_STATS = ("p10", "p90", "mean", "min")


def _number(v, c: str) -> bool:
    """A usable value for column ``c``: a finite number within range: a positive ``ms``
    (and p10/p90/mean/min) up to 1e7, a whole count of tokens or requests up to 1e9
    (at least 1 but for ``prior``), a repeat count ``n`` of at least 1."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    if c == "ms" or c in _ROW_STATS:
        return 0 < v <= _MAX_MS
    if c == "n":
        return v >= 1 and float(v).is_integer() and v <= _MAX_SIZE
    if c in _COUNTS:
        return (0 if c == "prior" else 1) <= v <= _MAX_SIZE and float(v).is_integer()
    return 0 <= v <= _MAX_SIZE


def _bad_row_value(c: str) -> str:
    if c == "ms" or c in _ROW_STATS:
        return "missing or invalid number (finite, > 0 and at most 1e7 ms)"
    if c == "n":
        return "invalid repeat count (a whole number >= 1)"
    if c == "prior":
        return "missing or invalid number (a whole number of tokens, >= 0 and at most 1e9)"
    return "missing or invalid number (a whole number, >= 1 and at most 1e9)"


# Engine facts a cost model reads: (lowest, highest) allowed, ``None`` for no bound.
# engine.step_tail: the mean step over the typical one (calibration.facts.measure_tail,
# at least 1). A loaded 2-core box measured 2.55 on a CPU server's bench run; past ten
# the run is dominated by stalls rather than by steps, and calibrate refuses it.
STEP_TAIL_RANGE = (0.5, 10.0)
_ENGINE_NUMBERS = {"bookkeeping_ms": (0.0, _MAX_MS), "host_overhead_ms": (0.0, _MAX_MS),
                   "bookkeeping_seq_ms": (0.0, _MAX_MS), "step_tail": STEP_TAIL_RANGE,
                   "decode_blocks_per_sm": (0.0, 1e4), "decode_wave_cost": (0.0, 100.0),
                   "kv_block_size": (1.0, 1e6)}


def _finite_in(v, lo: float, hi: float) -> bool:
    return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            and lo <= v <= hi)


def load_profile(path: Path) -> dict:
    """Read a profile JSON and check it (``check_profile``); one-line errors naming
    file and field."""
    text = read_text(path, max_bytes=MAX_PROFILE_BYTES, what="profile")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise LatsimError(f"invalid JSON at line {e.lineno}: {e.msg}", source=str(path)) from None
    except RecursionError:
        raise LatsimError("invalid JSON: nested too deeply", source=str(path)) from None
    return check_profile(data, str(path))


def check_profile(data, source: str) -> dict:
    """Check a profile (read from ``source``); one-line errors naming file and field.
    Every row the cost model reads (``prefill``, ``decode`` and, when present,
    ``decode_eager``, ``prefill_partial`` and ``mixed``) must hold finite numbers in
    range (a NaN step time is an error here, not a poisoned run), the engine facts a
    model reads must be in range, and a stored fit (``meta.fit``) must hold finite
    coefficients within the fit's bounds (one that no longer matches the rows is fitted
    again; one that cannot be right is an error)."""
    if not isinstance(data, dict) or data.get("format") != "latsim-profile/1":
        raise LatsimError("not a latsim profile (format must be 'latsim-profile/1')",
                          source=source, field="format",
                          value=data.get("format") if isinstance(data, dict) else None,
                          has_value=True)
    # section -> (required columns, optional columns); the first two sections must be there.
    sections = {"prefill": (("chunk", "prior", "ms"), ()),
                "decode": (("batch", "context", "ms"), ()),
                "decode_eager": (("batch", "context", "ms"), ()),
                "prefill_partial": (("chunk", "ms"), ("prior",)),
                "mixed": (("batch", "context", "chunk", "ms"), ("prior",))}
    for section, (cols, opt) in sections.items():
        rows = data.get(section)
        needed = section in ("prefill", "decode")
        if not needed and rows in (None, []):
            continue
        if not isinstance(rows, list) or not rows:
            raise LatsimError("section missing or empty" if needed else "must be a list of rows",
                              source=source, field=section)
        for i, r in enumerate(rows):
            for c in (*cols, *opt, *_ROW_STATS, "n"):
                v = r.get(c) if isinstance(r, dict) else None
                if v is None and (c in opt or c in _ROW_STATS or c == "n"):
                    continue
                if not _number(v, c):
                    raise LatsimError(_bad_row_value(c), source=source,
                                      field=f"{section}[{i}].{c}", value=v, has_value=True)
    # The tables interpolate between distinct points: a repeated point divides by zero.
    for section, keys in (("prefill", ("prior", "chunk")), ("decode", ("batch", "context")),
                          ("decode_eager", ("batch", "context"))):
        seen: dict = {}
        for i, r in enumerate(data.get(section) or []):
            k = tuple(float(r[c]) for c in keys)
            if k in seen:
                raise LatsimError(f"repeats {section}[{seen[k]}] (the same {keys[0]} and "
                                  f"{keys[1]}): each row must be a distinct point",
                                  source=source, field=f"{section}[{i}]",
                                  value={c: r[c] for c in keys}, has_value=True)
            seen[k] = i
    meta = data.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise LatsimError("must be a mapping", source=source, field="meta", value=meta,
                          has_value=True)
    _check_meta(meta or {}, source)
    eng = data.setdefault("engine", {})
    if not isinstance(eng, dict):
        raise LatsimError("must be a mapping", source=source, field="engine",
                          value=eng, has_value=True)
    if eng.get("decode_attention", "paged") not in ("paged", "padded"):
        raise LatsimError("must be 'paged' or 'padded'", source=source,
                          field="engine.decode_attention", value=eng.get("decode_attention"),
                          has_value=True)
    for key, (lo, hi) in _ENGINE_NUMBERS.items():
        v = eng.get(key)
        if v is not None and not _finite_in(v, lo, hi):
            raise LatsimError(f"must be a finite number in [{lo:g}, {hi:g}]", source=source,
                              field=f"engine.{key}", value=v, has_value=True)
    if eng.get("cuda_graphs") is not None and not isinstance(eng["cuda_graphs"], bool):
        raise LatsimError("must be true or false", source=source, field="engine.cuda_graphs",
                          value=eng["cuda_graphs"], has_value=True)
    buckets = eng.get("graph_batch_buckets")
    if buckets is not None and not (isinstance(buckets, list) and all(
            _whole_in(b, 1, _MAX_SIZE) for b in buckets)):
        raise LatsimError("must be a list of batch sizes (whole numbers >= 1)", source=source,
                          field="engine.graph_batch_buckets", value=buckets, has_value=True)
    _check_stored_fit((meta or {}).get("fit"), source)
    return data


# ``meta.model``'s dimensions, whole numbers in [1, _MAX_DIM]: the largest published
# models' are below 10^6 (a 256k vocabulary, a 73,728-wide MLP), so one of 10^7 or more
# is a broken field; the bound also keeps the fit's FLOP counts (layers x d_model x
# ffn ...) far inside float range.
_MAX_DIM = 1e7
_MODEL_DIMS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab")
# Other ``meta`` facts the cost models read: text, or numbers in (lowest, highest].
_META_TEXT = ("hardware", "gpu", "dtype", "weight_dtype", "kv_dtype")
_META_NUMBERS = {"peak_tflops": (0.0, 1e6), "hbm_gbs": (0.0, 1e7)}   # TFLOP/s, GB/s
_META_COUNTS = {"sms": 1e5, "tp": 1e5, "pp": 1e5, "tensor_parallel": 1e5,
                "pipeline_parallel": 1e5}


def _whole_in(v, lo: float, hi: float) -> bool:
    return _finite_in(v, lo, hi) and float(v).is_integer()


def _check_meta(meta: dict, source: str) -> None:
    """The ``meta`` facts a cost model reads have the type and range they must have:
    ``meta.model`` a mapping of positive whole dimensions (``n_kv_heads`` at most
    ``n_heads``; without ``head_dim``, ``d_model`` at least ``n_heads``) or a catalogued
    model's name; the hardware and dtype names text; peak rates positive numbers; SM,
    tensor- and pipeline-parallel counts whole numbers >= 1 (one-line errors naming
    the field)."""
    def bad(field, why, v):
        return LatsimError(why, source=source, field=f"meta.{field}", value=v, has_value=True)

    m = meta.get("model")
    if isinstance(m, str):
        from simulator.cost import catalog
        try:
            catalog.model(m)
        except LatsimError:
            raise bad("model", "names no catalogued model (give its dimensions as a mapping: "
                      "n_layers, d_model, n_heads, ...)", m) from None
    elif m is not None:
        if not isinstance(m, dict):
            raise bad("model", "must be a mapping of the model's dimensions (n_layers, "
                      "d_model, n_heads, ...) or a catalogued model's name", m)
        for k in _MODEL_DIMS:
            if m.get(k) is not None and not _whole_in(m[k], 1, _MAX_DIM):
                raise bad(f"model.{k}", f"must be a whole number in [1, {_MAX_DIM:.0e}]", m[k])
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise bad("model.name", "must be text", m["name"])
        if m.get("params") is not None and not _finite_in(m["params"], 1.0, 1e15):
            raise bad("model.params", "must be a number of parameters in [1, 1e15]",
                      m["params"])
        heads, kv = m.get("n_heads"), m.get("n_kv_heads")
        if heads is not None and kv is not None and kv > heads:
            raise bad("model.n_kv_heads", f"must be at most n_heads ({heads})", kv)
        if (m.get("head_dim") is None and heads is not None and m.get("d_model") is not None
                and m["d_model"] < heads):
            raise bad("model.n_heads", f"is above d_model ({m['d_model']}): the head size "
                      "d_model / n_heads would be 0 (give head_dim)", heads)
    for k in _META_TEXT:
        if meta.get(k) is not None and not isinstance(meta[k], str):
            raise bad(k, "must be text", meta[k])
    for k, (lo, hi) in _META_NUMBERS.items():
        v = meta.get(k)
        if v is not None and not (_finite_in(v, lo, hi) and v > lo):
            raise bad(k, f"must be a number in ({lo:g}, {hi:g}]", v)
    for k, hi in _META_COUNTS.items():
        v = meta.get(k)
        if v is not None and not _whole_in(v, 1, hi):
            raise bad(k, f"must be a whole number in [1, {hi:g}]", v)


def _check_stored_fit(fit, source: str) -> None:
    """A stored fit's coefficients, where it has them, are finite numbers within the
    bounds the fit keeps them in (``simulator.cost.fit.PARAMS``): a model would use
    them as they are while the fit's digest matches."""
    if fit is None:
        return
    if not isinstance(fit, dict):
        raise LatsimError("must be a mapping", source=source, field="meta.fit", value=fit,
                          has_value=True)
    co = fit.get("coefficients")
    if co is None:
        return
    if not isinstance(co, dict):
        raise LatsimError("must be a mapping", source=source, field="meta.fit.coefficients",
                          value=co, has_value=True)
    from simulator.cost import physics as ph
    from simulator.cost.fit import PARAMS
    bounds = {ph.NAMES[p[0]]: (p[2], p[3]) for p in PARAMS}
    # A host time a fit leaves unused (graph replays in an engine without graphs) sits
    # at zero; the wave facts have their own ranges.
    bounds.update(decode_blocks_per_sm=_ENGINE_NUMBERS["decode_blocks_per_sm"],
                  decode_wave_cost=_ENGINE_NUMBERS["decode_wave_cost"])
    for name, v in co.items():
        lo, hi = bounds.get(name, (0.0, 1e12))
        # The fit solves in log units: a bound comes back a few ulps off.
        if not (_finite_in(v, lo * (1 - 1e-9), hi * (1 + 1e-9))
                or (_finite_in(v, 0.0, 0.0) and name.startswith("h_"))):
            raise LatsimError(f"must be a finite number in [{lo:g}, {hi:g}]", source=source,
                              field=f"meta.fit.coefficients.{name}", value=v, has_value=True)


# Batch sizes whose decode curve is blended once per model (``table.blend``); a larger
# batch reads the table itself.
BLEND_BATCHES = 1025


class ProfileCostModel(LookupCounts):
    """Step time (seconds) of a ``StepPlan``-shaped step, from a measured profile. The
    lookups are ``table``'s kernels (the compiled event loop calls the same ones)."""

    compiled_kernels: ClassVar[Optional[str]] = "table"    # ``table``'s, in the compiled loop
    # ``StepCost``'s monotone contract does not hold: the tables follow the rows as
    # measured, and near the step floor those differ by their own noise.
    not_monotone: ClassVar[Optional[str]] = (
        "it interpolates the measured rows as measured: near the step floor they differ "
        "by the measurement's noise (the refbench profile's decode of 1 at context 256 "
        "measured 8.3 ms, at context 1 11.1 ms)")

    def __init__(self, profile: dict, *, scale: float = 1.0, noise: bool = False,
                 rng: Optional[np.random.Generator] = None) -> None:
        self.profile = profile
        eng = profile.get("engine", {})
        self.padded = eng.get("decode_attention", "paged") == "padded"
        pre, dec = profile["prefill"], profile["decode"]
        self.PT = T.pack_table([r["prior"] for r in pre], [r["chunk"] for r in pre],
                               [r["ms"] for r in pre])
        self.DT = T.pack_table([r["batch"] for r in dec], [r["context"] for r in dec],
                               [r["ms"] for r in dec])
        # An engine that graphs pure-decode steps runs any step holding a prefill chunk
        # eagerly: the decode part of such a step costs what the eager rows say.
        eager = profile.get("decode_eager") or []
        self.ET = (T.pack_table([r["batch"] for r in eager], [r["context"] for r in eager],
                                [r["ms"] for r in eager]) if eager else self.DT)
        # Prefill rows time a chunk that completes its prompt (LM head + a sampled token);
        # ``prefill_partial`` rows time the same chunk leaving its prompt unfinished. Their
        # median difference is what a non-final chunk does not pay.
        self.lm_head_ms = self._fit_lm_head(pre, profile.get("prefill_partial") or [])
        # Scheduling and applying a step's results on the host, not inside the timed rows.
        self.bookkeeping_ms = float(eng.get("bookkeeping_ms") or 0.0)
        self.bookkeeping_seq_ms = float(eng.get("bookkeeping_seq_ms") or 0.0)
        all_ms = [r["ms"] for r in pre] + [r["ms"] for r in dec] + [r["ms"] for r in eager]
        self._min_ms = float(min(all_ms))
        host = eng.get("host_overhead_ms")
        self.floor_ms = float(host) if host else float(min(all_ms))
        self.scale = scale
        self.CF = np.zeros(T.C_NCONST)
        self.CF[T.C_BK] = self.bookkeeping_ms
        self.CF[T.C_BK_SEQ] = self.bookkeeping_seq_ms
        self.CF[T.C_LMHEAD] = self.lm_head_ms
        self.CF[T.C_FLOOR] = self.floor_ms
        self.CF[T.C_MIN] = self._min_ms
        self.CF[T.C_SCALE] = scale
        self.CF[T.C_PADDED] = 1.0 if self.padded else 0.0
        self.alpha, self.mixed_residuals = self._fit_alpha(profile.get("mixed") or [])
        self.CF[T.C_ALPHA] = self.alpha
        # The three tables stacked, as the kernels take them (``table.pack_tables``), and
        # the decode table blended per batch size (``table.blend``).
        stacked = T.pack_tables(self.PT, self.DT, self.ET)
        self.tables = stacked + T.blended(stacked, BLEND_BATCHES)
        self.CL = new_counts()
        self._chunks = ChunkArrays()
        self._rng = rng if noise else None
        self.noise_sigma = self._fit_noise(pre + dec) if noise else 0.0

    # -- fitting ---------------------------------------------------------------
    def _row(self, tab, qa: float, qb: float) -> float:
        return float(T.table(tab[0], tab[1], tab[2], tab[3], float(qa), float(qb))[0])

    def _fit_alpha(self, mixed: list) -> tuple[float, list]:
        """Least-squares share of the fixed cost saved per extra part, from mixed rows."""
        if not mixed:
            return 1.0, []
        excess = []
        for r in mixed:
            d = self._row(self.ET, r["batch"], r["context"])
            p = self._row(self.PT, r.get("prior", 0), r["chunk"])
            excess.append(d + p - r["ms"])
        # alpha < 0: a mixed step costs more than its parts (e.g. graphed decode rows, eager
        # mixed steps); alpha > 1 would save more than the whole floor, which is not physical.
        alpha = float(np.clip(np.mean(excess) / self.floor_ms, -1.0, 1.0))
        res = [(r["ms"], d_p - alpha * self.floor_ms)
               for r, d_p in zip(mixed, [e + r["ms"] for e, r in zip(excess, mixed)])]
        return alpha, [(pred - meas) / meas for meas, pred in res]

    @staticmethod
    def _fit_lm_head(final: list, partial: list) -> float:
        by_key = {(r["chunk"], r.get("prior", 0)): r["ms"] for r in final}
        diffs = [by_key[(r["chunk"], r.get("prior", 0))] - r["ms"] for r in partial
                 if (r["chunk"], r.get("prior", 0)) in by_key]
        return max(0.0, float(np.median(diffs))) if diffs else 0.0

    @staticmethod
    def _fit_noise(rows: list) -> float:
        """Log-normal sigma from the rows' p10/p90 (z(0.9) = 1.2816), median over rows."""
        s = [math.log(r["p90"] / r["p10"]) / (2 * 1.2815516)
             for r in rows if r.get("p10") and r.get("p90") and r["p90"] > r["p10"] > 0]
        return float(np.median(s)) if s else 0.0

    # -- lookups -----------------------------------------------------------------
    def prefill_ms(self, chunk: int, prior: int) -> float:
        """A profile row's time: one chunk that completes its prompt, nothing else."""
        y, out = T.table(*self.PT, float(prior), float(chunk))
        self.CL[0] += 1
        self.CL[1] += out
        return float(y)

    def decode_ms(self, batch: int, context: float) -> float:
        """A profile row's time: ``batch`` decodes at ``context``, nothing else."""
        y, out = T.table(*self.DT, float(batch), float(context))
        self.CL[0] += 1
        self.CL[1] += out
        return float(y)

    def _noisy(self, ms):
        if self._rng is not None and self.noise_sigma > 0:
            s = self.noise_sigma
            if np.ndim(ms):
                z = self._rng.standard_normal(len(ms))
                return ms * np.exp(s * z - 0.5 * s ** 2)
            return ms * math.exp(s * self._rng.standard_normal() - 0.5 * s ** 2)
        return ms

    def step_time(self, n_decode: int, decode_ctx_max: int, decode_ctx_sum: int,
                  chunks: Sequence[tuple]) -> float:
        """Seconds for one step: ``n_decode`` decodes and prefill parts, each
        ``(chunk, prior)`` or ``(chunk, prior, completes_prompt)`` (``table.step_ms``)."""
        k = self._chunks.pack(chunks)
        n, p, f = self._chunks.n, self._chunks.p, self._chunks.f
        ms = T.step_ms(self.CF, *self.tables, self.CL, n_decode, decode_ctx_max,
                       decode_ctx_sum, n, p, f, k)
        return self._noisy(ms) / 1000.0

    @property
    def min_step_s(self) -> float:
        """A lower bound on any step's time (s): the floor, shrunk for noise (5 sigma)."""
        return self._min_ms * self.scale / 1000.0 * math.exp(-5 * self.noise_sigma)

    def decode_times(self, batch: int, ctx0: float, k: int) -> list:
        """Seconds of ``k`` consecutive decode-only steps of ``batch`` requests whose
        (longest, if padded; mean, if paged) context is ``ctx0`` at the first step and
        grows by one per step: ``k`` calls of ``step_time`` (``table.decode_run_ms``)."""
        out = np.empty(k)
        T.decode_run_ms(self.CF, *self.tables, self.CL, batch, ctx0, batch * ctx0, k, out,
                        self._chunks.n, self._chunks.f)
        return (self._noisy(out) / 1000.0).tolist()

    def compiled_reason(self) -> Optional[str]:
        """None: the compiled loop prices its steps with the same table kernels, unless
        they are noisy (the noise draws are the Python model's own)."""
        return "cost noise" if self._rng is not None else None

    def describe(self) -> dict:
        """What the model fitted, for the run's summary."""
        return {
            "kind": "profile",
            "decode_attention": "padded" if self.padded else "paged",
            "floor_ms": round(self.floor_ms, 4),
            "alpha": round(self.alpha, 4),
            "mixed_rel_errors": [round(e, 4) for e in self.mixed_residuals],
            "noise_sigma": round(self.noise_sigma, 4),
            "lm_head_ms": round(self.lm_head_ms, 4),
            "bookkeeping_ms": round(self.bookkeeping_ms, 5),
            "bookkeeping_seq_ms": round(self.bookkeeping_seq_ms, 5),
        }
