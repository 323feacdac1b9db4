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
  twice (DESIGN.md §7).

The profile's ``engine.bookkeeping_ms`` (host work per step outside the timed rows:
scheduling, applying results) is added to every step.

Above the measured range the tables extrapolate linearly from their last two
points, and every such lookup is counted in ``extrapolations``; the run reports it.
Below the smallest measured size (a 3-token chunk, a context of 40) they hold the
smallest row's value: less work than the smallest measured step cannot cost more,
and small steps sit on the engine's fixed floor.
"""
from __future__ import annotations

import bisect
import json
import math
from pathlib import Path
from typing import Literal, Optional, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from simulator.errors import LatsimError


class ProfileCostConfig(BaseModel):
    """``model.cost`` for a measured profile."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["profile"] = "profile"
    path: str = "profiles/h200-llama3-8b-refbench.json"
    noise: bool = Field(False, description="multiply each step by seeded log-normal noise "
                                            "fitted to the profile's p10/p90 spread")
    scale: float = Field(1.0, gt=0, description="multiply every step time (what-if)")


class _Curve:
    """Piecewise-linear y(x) on sorted knots, linear extrapolation beyond both ends."""

    __slots__ = ("x", "y", "lo", "hi")

    def __init__(self, x: Sequence[float], y: Sequence[float]) -> None:
        order = np.argsort(x)
        self.x = [float(x[i]) for i in order]
        self.y = [float(y[i]) for i in order]
        self.lo = self.x[0]
        self.hi = self.x[-1]

    def vec(self, q: np.ndarray) -> tuple[np.ndarray, int]:
        """Vectorised ``__call__``: values and how many queries lay above the range."""
        x, y = self.x, self.y
        out = np.interp(q, x, y)  # holds the end values outside the range
        above = q > x[-1]
        n_above = int(above.sum())
        if n_above and len(x) > 1:
            slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
            out = np.where(above, y[-1] + slope * (q - x[-1]), out)
        return out, n_above

    def __call__(self, q: float) -> tuple[float, bool]:
        x, y = self.x, self.y
        n = len(x)
        if q <= x[0]:
            # Below the smallest measured size the step only gets smaller work; at that
            # size engines are already at their fixed host floor, so hold the value.
            return y[0], False
        if n == 1:
            return y[0], q != x[0]
        if q >= x[-1]:
            i, out = n - 1, q > x[-1]
        else:
            i, out = bisect.bisect_right(x, q), False
        x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
        return y0 + (y1 - y0) * (q - x0) / (x1 - x0), out


class _Table2D:
    """y(a, b): a curve in ``b`` for each measured ``a``, linear across ``a``."""

    def __init__(self, a: Sequence[float], b: Sequence[float], y: Sequence[float]) -> None:
        levels: dict[float, tuple[list, list]] = {}
        for ai, bi, yi in zip(a, b, y):
            levels.setdefault(float(ai), ([], []))
            levels[float(ai)][0].append(bi)
            levels[float(ai)][1].append(yi)
        self.a = sorted(levels)
        self.curves = [_Curve(*levels[k]) for k in self.a]

    def __call__(self, qa: float, qb: float) -> tuple[float, bool]:
        a = self.a
        if len(a) == 1 or qa <= a[0]:
            return self.curves[0](qb)
        j = bisect.bisect_left(a, qa)
        if j < len(a) and a[j] == qa:
            return self.curves[j](qb)  # a measured level: no blending with a neighbour
        if qa >= a[-1]:
            i, out = len(a) - 1, qa > a[-1]
        else:
            i, out = bisect.bisect_right(a, qa), False
        y0, o0 = self.curves[i - 1](qb)  # noqa: E501  (scalar path)
        y1, o1 = self.curves[i](qb)
        a0, a1 = a[i - 1], a[i]
        return y0 + (y1 - y0) * (qa - a0) / (a1 - a0), out or o0 or o1


def resolve_profile_path(path: str, base_dirs: Sequence[Path]) -> Path:
    """Find a profile: absolute, or relative to each base dir (scenario dir, cwd, repo)."""
    p = Path(path)
    if p.is_absolute():
        if p.exists():
            return p
    else:
        for d in base_dirs:
            cand = (Path(d) / p)
            if cand.exists():
                return cand.resolve()
    raise LatsimError("profile file not found", source=str(path), field="model.cost.path")


def load_profile(path: Path) -> dict:
    """Read and check a profile JSON; one-line errors naming file and field."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise LatsimError(f"invalid JSON at line {e.lineno}: {e.msg}", source=str(path)) from None
    if not isinstance(data, dict) or data.get("format") != "latsim-profile/1":
        raise LatsimError("not a latsim profile (format must be 'latsim-profile/1')",
                          source=str(path), field="format",
                          value=data.get("format") if isinstance(data, dict) else None,
                          has_value=True)
    need = {"prefill": ("chunk", "prior", "ms"), "decode": ("batch", "context", "ms")}
    for section, cols in need.items():
        rows = data.get(section)
        if not isinstance(rows, list) or not rows:
            raise LatsimError("section missing or empty", source=str(path), field=section)
        for i, r in enumerate(rows):
            for c in cols:
                v = r.get(c) if isinstance(r, dict) else None
                if not isinstance(v, (int, float)) or v < 0 or (c == "ms" and v <= 0):
                    raise LatsimError("missing or invalid number", source=str(path),
                                      field=f"{section}[{i}].{c}", value=v, has_value=True)
    eng = data.setdefault("engine", {})
    if eng.get("decode_attention", "paged") not in ("paged", "padded"):
        raise LatsimError("must be 'paged' or 'padded'", source=str(path),
                          field="engine.decode_attention", value=eng.get("decode_attention"),
                          has_value=True)
    return data


def _table_vec(t: _Table2D, qa: float, qb: np.ndarray) -> tuple[np.ndarray, int]:
    """``_Table2D`` at one ``qa`` for many ``qb``: values and above-range count."""
    a = t.a
    if len(a) == 1 or qa <= a[0]:
        return t.curves[0].vec(qb)
    j = bisect.bisect_left(a, qa)
    if j < len(a) and a[j] == qa:
        return t.curves[j].vec(qb)
    i = len(a) - 1 if qa >= a[-1] else bisect.bisect_right(a, qa)
    y0, o0 = t.curves[i - 1].vec(qb)
    y1, o1 = t.curves[i].vec(qb)
    w = (qa - a[i - 1]) / (a[i] - a[i - 1])
    n_out = len(qb) if qa > a[-1] else max(o0, o1)
    return y0 + (y1 - y0) * w, n_out


class ProfileCostModel:
    """Step time (seconds) of a ``StepPlan``-shaped step, from a measured profile."""

    def __init__(self, profile: dict, *, scale: float = 1.0, noise: bool = False,
                 rng: Optional[np.random.Generator] = None) -> None:
        self.profile = profile
        eng = profile.get("engine", {})
        self.padded = eng.get("decode_attention", "paged") == "padded"
        pre, dec = profile["prefill"], profile["decode"]
        self._prefill = _Table2D([r["prior"] for r in pre], [r["chunk"] for r in pre],
                                 [r["ms"] for r in pre])
        self._decode = _Table2D([r["batch"] for r in dec], [r["context"] for r in dec],
                                [r["ms"] for r in dec])
        # An engine that graphs pure-decode steps runs any step holding a prefill chunk
        # eagerly: the decode part of such a step costs what the eager rows say.
        eager = profile.get("decode_eager") or []
        self._decode_eager = (_Table2D([r["batch"] for r in eager], [r["context"] for r in eager],
                                       [r["ms"] for r in eager]) if eager else self._decode)
        # Prefill rows time a chunk that completes its prompt (LM head + a sampled token);
        # ``prefill_partial`` rows time the same chunk leaving its prompt unfinished. Their
        # median difference is what a non-final chunk does not pay.
        self.lm_head_ms = self._fit_lm_head(pre, profile.get("prefill_partial") or [])
        # Scheduling and applying a step's results on the host, not inside the timed rows.
        self.bookkeeping_ms = float(eng.get("bookkeeping_ms") or 0.0)
        all_ms = [r["ms"] for r in pre] + [r["ms"] for r in dec] + [r["ms"] for r in eager]
        self._min_ms = float(min(all_ms))
        host = eng.get("host_overhead_ms")
        self.floor_ms = float(host) if host else float(min(all_ms))
        self.alpha, self.mixed_residuals = self._fit_alpha(profile.get("mixed") or [])
        self.scale = scale
        self._decode_curves: dict = {}
        self.extrapolations = 0
        self.lookups = 0
        self._rng = rng if noise else None
        self.noise_sigma = self._fit_noise(pre + dec) if noise else 0.0

    # -- fitting ---------------------------------------------------------------
    def _fit_alpha(self, mixed: list) -> tuple[float, list]:
        """Least-squares share of the fixed cost saved per extra part, from mixed rows."""
        if not mixed:
            return 1.0, []
        excess = []
        for r in mixed:
            d, _ = self._decode_eager(r["batch"], r["context"])
            p, _ = self._prefill(r.get("prior", 0), r["chunk"])
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
        y, out = self._prefill(prior, chunk)
        self.lookups += 1
        self.extrapolations += out
        return y

    def decode_ms(self, batch: int, context: float) -> float:
        y, out = self._decode(batch, context)
        self.lookups += 1
        self.extrapolations += out
        return y

    def step_time(self, n_decode: int, decode_ctx_max: int, decode_ctx_sum: int,
                  chunks: Sequence[tuple]) -> float:
        """Seconds for one step: ``n_decode`` decodes and prefill parts, each
        ``(chunk, prior)`` or ``(chunk, prior, completes_prompt)``."""
        parts = 0
        ms = self.bookkeeping_ms
        if n_decode:
            ctx = decode_ctx_max if self.padded else decode_ctx_sum / n_decode
            if chunks:
                y, out = self._decode_eager(n_decode, ctx)
                self.lookups += 1
                self.extrapolations += out
                ms += y
            else:
                ms += self.decode_ms(n_decode, ctx)
            parts = 1
        for c in chunks:
            # (chunk, prior) or (chunk, prior, completes_prompt); a non-final chunk skips
            # the LM head the prefill rows include.
            ms += self.prefill_ms(c[0], c[1])
            if len(c) > 2 and not c[2]:
                ms -= self.lm_head_ms
            parts += 1
        if parts > 1:
            ms -= self.alpha * self.floor_ms * (parts - 1)
        if ms < self._min_ms:
            ms = self._min_ms   # no step is cheaper than the cheapest one measured
        ms *= self.scale
        if self._rng is not None and self.noise_sigma > 0:
            ms *= math.exp(self.noise_sigma * self._rng.standard_normal()
                           - 0.5 * self.noise_sigma ** 2)
        return ms / 1000.0

    @property
    def min_step_s(self) -> float:
        """A lower bound on any step's time (s): the floor, shrunk for noise (5 sigma)."""
        return self._min_ms * self.scale / 1000.0 * math.exp(-5 * self.noise_sigma)

    def _blended_decode(self, batch: int) -> tuple:
        """The decode table blended at this batch size, once: knots, values (numpy and
        lists), the slope above the last knot, and whether the batch lies beyond."""
        curve = self._decode_curves.get(batch)
        if curve is None:
            grid = np.unique(np.concatenate([np.asarray(c.x) for c in self._decode.curves]))
            y, _ = _table_vec(self._decode, float(batch), grid)
            slope = float((y[-1] - y[-2]) / (grid[-1] - grid[-2])) if len(grid) > 1 else 0.0
            curve = self._decode_curves[batch] = (grid, y, slope, batch > self._decode.a[-1],
                                                  grid.tolist(), y.tolist())
        return curve

    def decode_times(self, batch: int, ctx0: float, k: int) -> list:
        """Seconds of ``k`` consecutive decode-only steps of ``batch`` requests whose
        (longest, if padded; mean, if paged) context is ``ctx0`` at the first step and
        grows by one per step - exactly what ``k`` calls of ``step_time`` would give."""
        x, y, slope, beyond, xl, yl = self._blended_decode(batch)
        bk, mn, sc = self.bookkeeping_ms, self._min_ms, self.scale / 1000.0
        self.lookups += k
        if k <= 32 and self._rng is None:
            # Short epochs are the common case: plain Python beats numpy's call overhead.
            out = []
            n_out = 0
            lo, hi = xl[0], xl[-1]
            for j in range(k):
                q = ctx0 + j
                if q <= lo:
                    v = yl[0]
                elif q >= hi:
                    v = yl[-1] + slope * (q - hi)
                    n_out += q > hi
                else:
                    i = bisect.bisect_right(xl, q)
                    x0, y0 = xl[i - 1], yl[i - 1]
                    v = y0 + (yl[i] - y0) * (q - x0) / (xl[i] - x0)
                v += bk
                out.append((v if v > mn else mn) * sc)
            self.extrapolations += k if beyond else n_out
            return out
        ctx = ctx0 + np.arange(k, dtype=np.float64)
        ms = np.interp(ctx, x, y) + bk
        n_out = k if beyond else 0
        if ctx[-1] > x[-1]:
            above = ctx > x[-1]
            ms = np.where(above, y[-1] + slope * (ctx - x[-1]) + bk, ms)
            n_out = k if beyond else int(above.sum())
        self.extrapolations += n_out
        ms = np.maximum(ms, mn) * self.scale
        if self._rng is not None and self.noise_sigma > 0:
            z = self._rng.standard_normal(k)
            ms = ms * np.exp(self.noise_sigma * z - 0.5 * self.noise_sigma ** 2)
        return (ms / 1000.0).tolist()

    def describe(self) -> dict:
        """What the model fitted, for the run's summary."""
        return {
            "decode_attention": "padded" if self.padded else "paged",
            "floor_ms": round(self.floor_ms, 4),
            "alpha": round(self.alpha, 4),
            "mixed_rel_errors": [round(e, 4) for e in self.mixed_residuals],
            "noise_sigma": round(self.noise_sigma, 4),
            "lm_head_ms": round(self.lm_head_ms, 4),
        }
