"""Token-length distributions for prompts and outputs.

- ``constant``: always ``value``.
- ``uniform``: integers in ``[low, high]``.
- ``lognormal``: given ``mean`` and coefficient of variation ``cv`` (heavy tail, as
  real prompt lengths), clipped to ``[min, max]``.
- ``exponential``: given ``mean``, clipped.
Sampling a ``lengths_file`` (paired prompt/output columns) lives in ``synthetic``.
"""
from __future__ import annotations

import math

from typing import Literal, Optional

import numpy as np
from pydantic import Field, model_validator

from simulator.config.strict import StrictModel

from simulator.config.registry import LENGTHS

MAX_TOKENS = 10**9   # a token count beyond this is a mistake, not a request


class _Len(StrictModel):
    min: int = Field(1, ge=1, le=MAX_TOKENS)
    max: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _check(self):
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) < min ({self.min})")
        return self


def _inside(cfg: _Len, what: str, x: float) -> None:
    """A distribution whose ``what`` (its value or median) lies outside ``[min, max]``
    would be clipped to a bound for most requests: an error, not a workload (a lognormal
    of mean 5000 with max 100 drew 100 for every request). A tail cut at ``max`` is what
    the bound is for, so the median is checked, not the mean."""
    if x < cfg.min or (cfg.max is not None and x > cfg.max):
        bounds = f"[{cfg.min}, {cfg.max if cfg.max is not None else MAX_TOKENS}]"
        raise ValueError(f"its {what} lies outside min..max {bounds}: most requests would "
                         "be clipped to a bound; widen min/max or move the "
                         f"{what}")


class ConstantLen(_Len):
    kind: Literal["constant"] = "constant"
    value: int = Field(ge=1, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _bounds(self):
        _inside(self, "value", self.value)
        return self


class UniformLen(_Len):
    kind: Literal["uniform"] = "uniform"
    low: int = Field(ge=1, le=MAX_TOKENS)
    high: int = Field(ge=1, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _order(self):
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) < low ({self.low})")
        _inside(self, "median", (self.low + self.high) / 2)
        return self


class LognormalLen(_Len):
    kind: Literal["lognormal"] = "lognormal"
    mean: float = Field(gt=0, le=MAX_TOKENS)
    cv: float = Field(1.0, gt=0, le=100)

    @model_validator(mode="after")
    def _bounds(self):
        _inside(self, "median", self.mean / math.sqrt(1.0 + self.cv ** 2))
        return self


class ExponentialLen(_Len):
    kind: Literal["exponential"] = "exponential"
    mean: float = Field(gt=0, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _bounds(self):
        _inside(self, "median", self.mean * math.log(2.0))
        return self


def _clip(cfg: _Len, x: np.ndarray) -> np.ndarray:
    x = np.maximum(np.rint(x), cfg.min)
    # A heavy tail is cut at ``max``, or at MAX_TOKENS, so the cast stays exact.
    x = np.minimum(x, cfg.max if cfg.max is not None else MAX_TOKENS)
    return x.astype(np.int64)


def _lognormal(cfg: LognormalLen, n: int, rng: np.random.Generator) -> np.ndarray:
    sigma2 = np.log1p(cfg.cv ** 2)
    mu = np.log(cfg.mean) - sigma2 / 2
    return _clip(cfg, rng.lognormal(mu, np.sqrt(sigma2), size=n))


LENGTHS.register("constant", ConstantLen, lambda c, n, rng: _clip(c, np.full(n, c.value)))
LENGTHS.register("uniform", UniformLen,
                 lambda c, n, rng: _clip(c, rng.integers(c.low, c.high + 1, size=n)))
LENGTHS.register("lognormal", LognormalLen, _lognormal)
LENGTHS.register("exponential", ExponentialLen,
                 lambda c, n, rng: _clip(c, rng.exponential(c.mean, size=n)))


def sample_lengths(cfg, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` token counts from the distribution ``cfg``."""
    return LENGTHS.build(cfg, n, rng)
