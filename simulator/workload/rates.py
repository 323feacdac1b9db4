"""Time-varying arrival rates: diurnal, step, ramp, piecewise and ServeGen day curves.

Each kind is an arrival process (``workload.arrival.kind``) whose rate at time ``t`` is
``rate x m(t)``: ``rate`` is the scale the planner and sweeps multiply (the mean rate
for ``diurnal`` and ``servegen``, the base rate the levels multiply for ``step``,
``ramp`` and ``piecewise``) and ``m`` a non-negative multiplier held as a piecewise
linear function on knots (a step is two knots at the same time):

- ``step``: ``levels[i]`` from ``at_s[i-1]`` to ``at_s[i]`` (the last level held after).
- ``ramp``: ``from_level`` until ``start_s``, linear to ``to_level`` at ``end_s``, held.
- ``piecewise``: ``levels`` at ``times_s``, ``linear`` between them or ``hold``, held
  after the last; ``period_s`` repeats it.
- ``diurnal``: a day shape ``trough + (1 - trough) ((1 + cos(2 pi (t - peak_at_s) /
  period_s)) / 2) ^ sharpness`` with ``trough = 1 / peak_to_trough``, normalised to mean 1
  over the period (so ``rate`` is the mean rate; the peak is ``peak_over_mean`` times it),
  sampled at 1,440 knots per period (piecewise-linear error below 3e-6 of the peak).
- ``servegen``: ServeGen's per-600 s window rates (the sum over the chosen clients),
  held over each window, normalised to mean 1 over ``window``, times ``time_scale``
  (0.125 plays a day in three hours).

Arrivals are the time-rescaling of a unit-rate process (Brown et al. 2002, "The
time-rescaling theorem and its application to neural spike train data analysis"):
with ``M(t) = integral of m`` and ``u_1 < u_2 < ...`` the points of a unit-mean renewal
process (Poisson for ``burstiness: 1``, else gamma gaps of shape ``burstiness``), the
arrivals are ``t_i = M^-1(u_i / rate)``: for Poisson this is exactly the inhomogeneous
Poisson process of intensity ``rate x m(t)``, whose count over ``[a, b]`` has mean
``rate x (M(b) - M(a))``. ``M`` is piecewise quadratic, inverted in closed form.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
from pydantic import Field, model_validator

from simulator.config.strict import StrictModel

from simulator.config.registry import ARRIVALS
from simulator.workload.arrivals import GAMMA_MIN_SHAPE

DIURNAL_KNOTS = 1440   # knots per period of the diurnal shape (one a minute for a day)


class _Profile(StrictModel):
    rate: float = Field(gt=0, description="scale of the rate curve (req/s; see kind)")
    burstiness: float = Field(1.0, ge=GAMMA_MIN_SHAPE, description="gap shape in rescaled "
                              "time: 1 = Poisson, <1 burstier (gamma gaps; at least 0.01)")


class StepRate(_Profile):
    kind: Literal["step"] = "step"
    levels: list[float] = Field(min_length=1, description="multipliers of rate, one per interval")
    at_s: list[float] = Field(default_factory=list, description="times the level changes")

    @model_validator(mode="after")
    def _check(self):
        if len(self.levels) != len(self.at_s) + 1:
            raise ValueError(f"levels needs one more entry than at_s (got {len(self.levels)} "
                             f"levels, {len(self.at_s)} times)")
        _check_times(self.at_s, "at_s", strict_positive=True)
        _check_levels(self.levels)
        return self


class RampRate(_Profile):
    kind: Literal["ramp"] = "ramp"
    from_level: float = Field(1.0, ge=0)
    to_level: float = Field(..., ge=0)
    start_s: float = Field(0.0, ge=0)
    end_s: float = Field(..., gt=0)

    @model_validator(mode="after")
    def _check(self):
        if not self.end_s > self.start_s:
            raise ValueError(f"end_s must be after start_s (got {self.start_s:g}, {self.end_s:g})")
        if self.from_level == 0 and self.to_level == 0:
            raise ValueError("from_level and to_level are both 0: no arrivals")
        return self


class PiecewiseRate(_Profile):
    kind: Literal["piecewise"] = "piecewise"
    times_s: list[float] = Field(min_length=1, description="knot times, from 0, increasing")
    levels: list[float] = Field(min_length=1, description="multiplier of rate at each knot")
    interpolate: Literal["linear", "hold"] = "linear"
    period_s: Optional[float] = Field(None, gt=0, description="repeat with this period")

    @model_validator(mode="after")
    def _check(self):
        if len(self.times_s) != len(self.levels):
            raise ValueError("times_s and levels must have the same length")
        if self.times_s[0] != 0:
            raise ValueError(f"times_s must start at 0 (got {self.times_s[0]:g})")
        _check_times(self.times_s, "times_s")
        _check_levels(self.levels)
        if self.period_s is not None and self.period_s <= self.times_s[-1]:
            raise ValueError(f"period_s must exceed the last knot time {self.times_s[-1]:g}")
        return self


class DiurnalRate(_Profile):
    kind: Literal["diurnal"] = "diurnal"
    period_s: float = Field(86400.0, gt=0)
    peak_to_trough: float = Field(4.0, ge=1, description="highest rate / lowest rate")
    peak_at_s: float = Field(50400.0, ge=0, description="time of the peak in the period")
    sharpness: float = Field(1.0, gt=0, le=64, description="exponent of the bump: >1 a "
                             "narrower peak (a higher peak over the mean)")


class ServeGenRate(_Profile):
    kind: Literal["servegen"] = "servegen"
    path: str = Field(description="a ServeGen folder (chunk-*-trace.csv)")
    clients: Optional[list[int]] = Field(None, description="client ids; default: all")
    window: tuple[float, float] = Field((0.0, 86400.0), description="[start, end) on "
                                        "ServeGen's clock, in its 600 s windows")
    time_scale: float = Field(1.0, gt=0, description="multiply ServeGen's times (0.125: a "
                              "day in 3 hours)")

    @model_validator(mode="after")
    def _check(self, info):
        if not 0 <= self.window[0] < self.window[1]:
            raise ValueError(f"window must be [start, end) with 0 <= start < end "
                             f"(got {list(self.window)})")
        # The arrival builder is not told the scenario's folder: keep the path absolute.
        self.path = str(_find_folder(self.path, info))
        return self


def _find_folder(path: str, info) -> Path:
    """``path`` as is when absolute, else under the scenario's folder (when the loader
    passes it as context ``base_dir``), the working directory or the checkout."""
    p = Path(path)
    if p.is_absolute():
        return p
    ctx = getattr(info, "context", None) or {}
    base = ctx.get("base_dir") if isinstance(ctx, dict) else None
    root = Path(__file__).resolve().parents[2]
    dirs = ([Path(base)] if base is not None else []) + [Path.cwd(), root]
    for d in dirs:
        if (d / p).is_dir():
            return (d / p).resolve()
    raise ValueError(f"ServeGen folder not found (looked under {', '.join(map(str, dirs))})")


def _check_times(ts: list, name: str, strict_positive: bool = False) -> None:
    if any(b <= a for a, b in zip(ts, ts[1:])):
        raise ValueError(f"{name} must increase (got {ts})")
    if strict_positive and ts and ts[0] <= 0:
        raise ValueError(f"{name} must be > 0 (got {ts[0]:g})")


def _check_levels(levels: list) -> None:
    if any(v < 0 for v in levels):
        raise ValueError(f"levels must be >= 0 (got {levels})")
    if not any(v > 0 for v in levels):
        raise ValueError("every level is 0: no arrivals")


@dataclass
class RateCurve:
    """A multiplier ``m(t)``, piecewise linear on knots ``x`` (non-decreasing, from 0; two
    equal times make a jump) with values ``y``; held at ``y[-1]`` after the last knot, or
    repeated every ``period`` (then the knots end at ``period``)."""

    x: np.ndarray
    y: np.ndarray
    period: Optional[float] = None

    def __post_init__(self) -> None:
        self.x = np.asarray(self.x, dtype=np.float64)
        self.y = np.asarray(self.y, dtype=np.float64)
        dx = np.diff(self.x)
        # M at each knot: the trapezoids (exact for a linear segment).
        self.m = np.concatenate(([0.0], np.cumsum(dx * (self.y[:-1] + self.y[1:]) / 2.0)))

    @property
    def span(self) -> float:
        return float(self.x[-1])

    def at(self, t) -> np.ndarray:
        """``m(t)`` (right-continuous at jumps)."""
        t = np.asarray(t, dtype=np.float64)
        if self.period is not None:
            t = np.mod(t, self.period)
        # ``np.interp`` takes the left value at a repeated knot; the right one is wanted.
        i = np.searchsorted(self.x, t, side="right") - 1
        i = np.clip(i, 0, len(self.x) - 1)
        nxt = np.minimum(i + 1, len(self.x) - 1)
        dx = self.x[nxt] - self.x[i]
        with np.errstate(invalid="ignore", divide="ignore"):
            f = np.where(dx > 0, (t - self.x[i]) / dx, 0.0)
        return np.where(t >= self.span, self.y[-1], self.y[i] + f * (self.y[nxt] - self.y[i]))

    def cumulative(self, t) -> np.ndarray:
        """``M(t) = integral from 0 to t of m``."""
        t = np.asarray(t, dtype=np.float64)
        whole = 0.0
        if self.period is not None:
            q = np.floor(t / self.period)
            whole = q * self.m[-1]
            t = t - q * self.period
        i = np.clip(np.searchsorted(self.x, t, side="right") - 1, 0, len(self.x) - 1)
        nxt = np.minimum(i + 1, len(self.x) - 1)
        dx = self.x[nxt] - self.x[i]
        s = np.minimum(t - self.x[i], np.where(nxt > i, dx, np.inf))
        with np.errstate(invalid="ignore", divide="ignore"):
            slope = np.where(dx > 0, (self.y[nxt] - self.y[i]) / dx, 0.0)
        inside = self.m[i] + self.y[i] * s + 0.5 * slope * s * s
        beyond = self.m[-1] + self.y[-1] * (t - self.span)
        return whole + np.where(t >= self.span, beyond, inside)

    def inverse(self, u) -> np.ndarray:
        """The ``t`` with ``M(t) = u`` (the earliest, where ``M`` is flat)."""
        u = np.asarray(u, dtype=np.float64)
        base = 0.0
        if self.period is not None:
            q = np.floor(u / self.m[-1])
            base = q * self.period
            u = u - q * self.m[-1]
        # Segment i: m[i] <= u < m[i+1]; flat segments (m equal) are skipped.
        i = np.clip(np.searchsorted(self.m, u, side="right") - 1, 0, len(self.x) - 1)
        nxt = np.minimum(i + 1, len(self.x) - 1)
        d = u - self.m[i]
        dx = self.x[nxt] - self.x[i]
        with np.errstate(invalid="ignore", divide="ignore"):
            a = np.where(dx > 0, (self.y[nxt] - self.y[i]) / dx, 0.0)
            y0 = self.y[i]
            # a/2 s^2 + y0 s = d, in the form that stays exact as a -> 0.
            s = 2.0 * d / (y0 + np.sqrt(np.maximum(y0 * y0 + 2.0 * a * d, 0.0)))
        inside = self.x[i] + np.nan_to_num(s, nan=0.0, posinf=0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            # A curve that ends at 0 has no arrivals after its area is used up: inf.
            beyond = (self.span + (u - self.m[-1]) / self.y[-1] if self.y[-1] > 0
                      else np.full_like(u, np.inf))
        last = u >= self.m[-1]
        return base + np.where(last & (self.period is None), beyond, inside)

    @property
    def mean(self) -> float:
        """Mean of ``m`` over its knots' span."""
        return float(self.m[-1] / self.span) if self.span > 0 else float(self.y[-1])


def _diurnal(cfg: DiurnalRate) -> RateCurve:
    P = cfg.period_s
    x = np.linspace(0.0, P, DIURNAL_KNOTS + 1)
    trough = 1.0 / cfg.peak_to_trough
    bump = ((1.0 + np.cos(2.0 * math.pi * (x - cfg.peak_at_s) / P)) / 2.0) ** cfg.sharpness
    y = trough + (1.0 - trough) * bump
    c = RateCurve(x, y, period=P)
    return RateCurve(x, y / c.mean, period=P)


def _servegen(cfg: ServeGenRate) -> RateCurve:
    from simulator.errors import LatsimError
    from simulator.workload.servegen import WINDOW_S, client_ids, read_windows
    folder = Path(cfg.path)
    ids = cfg.clients if cfg.clients is not None else client_ids(folder)
    first = int(cfg.window[0] // WINDOW_S)
    count = max(1, int(math.ceil(cfg.window[1] / WINDOW_S)) - first)
    total = np.zeros(count)
    for c in ids:
        total += [w[0] for w in read_windows(folder, c, first, count)]
    if not total.sum() > 0:
        raise LatsimError("the chosen clients send nothing in this window", source=str(folder),
                          field="workload.arrival.window")
    edges = np.arange(count + 1) * WINDOW_S * cfg.time_scale
    x = np.repeat(edges, 2)[1:-1]
    y = np.repeat(total / total.mean(), 2)
    return RateCurve(x, y)


def rate_curve(cfg) -> RateCurve:
    """The multiplier ``m(t)`` of a rate-profile arrival config (see module doc)."""
    if isinstance(cfg, StepRate):
        edges = [0.0] + list(cfg.at_s)
        x = [0.0] + [t for e in cfg.at_s for t in (e, e)] + [edges[-1] + 1.0]
        y = [v for v in cfg.levels for _ in (0, 1)]
        return RateCurve(x, y)
    if isinstance(cfg, RampRate):
        return RateCurve([0.0, cfg.start_s, cfg.end_s], [cfg.from_level, cfg.from_level,
                                                        cfg.to_level])
    if isinstance(cfg, PiecewiseRate):
        x, y = list(cfg.times_s), list(cfg.levels)
        if cfg.interpolate == "hold":
            x = [x[0]] + [t for t in x[1:] for _ in (0, 1)]
            y = [v for v in y[:-1] for _ in (0, 1)] + [y[-1]]
        if cfg.period_s is not None:
            x, y = x + [cfg.period_s], y + [y[-1] if cfg.interpolate == "hold" else y[0]]
        if len(x) == 1:
            x, y = [0.0, 1.0], [y[0], y[0]]
        return RateCurve(x, y, period=cfg.period_s)
    if isinstance(cfg, DiurnalRate):
        return _diurnal(cfg)
    if isinstance(cfg, ServeGenRate):
        return _servegen(cfg)
    raise TypeError(f"not a rate profile: {type(cfg).__name__}")


def _unit_points(cfg, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` points of the unit-mean renewal process in rescaled time, from 0."""
    if cfg.burstiness == 1.0:
        gaps = rng.exponential(1.0, size=n)
    else:
        gaps = rng.gamma(cfg.burstiness, 1.0 / cfg.burstiness, size=n)
    return np.cumsum(gaps)


def profile_times(cfg, n: int, rng: np.random.Generator, start: float = 0.0) -> np.ndarray:
    """The next ``n`` arrival times after ``start`` of a rate-profile process (time
    rescaling, see module doc); inf past the end of a curve that ends at 0."""
    curve = rate_curve(cfg)
    u0 = float(curve.cumulative(start)) * cfg.rate
    t = curve.inverse((u0 + _unit_points(cfg, n, rng)) / cfg.rate)
    # Rounding in the inversion must not reorder arrivals or put one before ``start``.
    return np.maximum.accumulate(np.maximum(t, start))


PROFILES = (StepRate, RampRate, PiecewiseRate, DiurnalRate, ServeGenRate)


def is_profile(cfg) -> bool:
    """Whether an arrival config is a time-varying rate profile."""
    return isinstance(cfg, PROFILES)


def continue_arrivals(cfg, start: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` more arrival times after ``start`` (a block of a horizon being filled): a
    stationary process draws its gaps from ``start``; a rate profile continues its own
    clock from there (its rate at ``start``, not at 0)."""
    if is_profile(cfg):
        return profile_times(cfg, n, rng, start)
    from simulator.workload.arrivals import arrival_times
    return start + arrival_times(cfg, n, rng)


def _gaps(cfg, n: int, rng: np.random.Generator) -> np.ndarray:
    t = profile_times(cfg, n, rng)
    if n and not np.isfinite(t[-1]):
        from simulator.errors import LatsimError
        area = float(rate_curve(cfg).m[-1] * cfg.rate)
        raise LatsimError(f"the rate curve ends at 0 after about {area:,.0f} arrivals, fewer "
                          f"than the {n:,} asked for: give duration_s, or end on a level > 0",
                          field="workload.arrival", value=cfg.kind, has_value=True)
    return np.diff(t, prepend=0.0)


for _cls in PROFILES:
    ARRIVALS.register(_cls.model_fields["kind"].default, _cls, _gaps)
