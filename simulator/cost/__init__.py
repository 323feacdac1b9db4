"""Cost models: step time of an engine iteration. Registered by ``kind``:

- ``profile``: interpolation in a measured profile's table (``profile``);
- ``fitted``: the physics model (``physics``) with coefficients fitted to a measured
  profile (``fit``, ``fitted``);
- ``roofline``: the same physics model with its constants from the GPU and model
  catalogues and default efficiencies, optionally calibrated to a few measured rows
  (``roofline``).

``step_ms`` prices engine steps outside a simulation, as ``latsim cost`` does
(``steps``: the model set up once, then one ``step_time`` call per step).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from simulator.config.registry import COST_MODELS
from simulator.cost.profile import (REPO_ROOT, ProfileCostConfig, ProfileCostModel,  # noqa: F401
                                    load_profile, profile_search_dirs, resolve_profile_path)

__all__ = ["ProfileCostConfig", "ProfileCostModel", "load_profile", "build_cost_model",
           "profile_search_dirs", "step_ms"]



def _build_profile(cfg: ProfileCostConfig, rng, base_dirs: Sequence[Path], profile: dict | None = None):
    if profile is None:
        profile = load_profile(resolve_profile_path(cfg.path, base_dirs))
    return ProfileCostModel(profile, scale=cfg.scale, noise=cfg.noise, rng=rng)


COST_MODELS.register("profile", ProfileCostConfig, _build_profile)


def _build_fitted(cfg, rng, base_dirs: Sequence[Path], profile: dict | None = None):
    from simulator.cost.fitted import build_fitted
    return build_fitted(cfg, rng, base_dirs, profile=profile)


def _register_fitted() -> None:
    from simulator.cost.fitted import FittedCostConfig
    COST_MODELS.register("fitted", FittedCostConfig, _build_fitted)


_register_fitted()


def _build_roofline(cfg, rng, base_dirs: Sequence[Path], profile: dict | None = None):
    from simulator.cost.roofline.model import build_roofline
    return build_roofline(cfg, rng, base_dirs, profile=profile)


def _register_roofline() -> None:
    from simulator.cost.roofline.model import RooflineCostConfig
    COST_MODELS.register("roofline", RooflineCostConfig, _build_roofline)


_register_roofline()


def profile_path_of(cfg) -> str | None:
    """The profile a ``model.cost`` config reads, if it reads one (``path``)."""
    return getattr(cfg, "path", None)


def build_cost_model(cfg, rng, base_dirs, profile: dict | None = None):
    """The cost model a ``model.cost`` config describes."""
    return COST_MODELS.build(cfg, rng, base_dirs, profile=profile)


def step_ms(prefill=None, decode=None, **config):
    """Milliseconds of one engine step, or of arrays of steps, priced as ``latsim cost``
    prices them (``simulator.cost.steps.step_ms``: the arguments and an example there
    and in README)."""
    from simulator.cost.steps import step_ms as _step_ms
    return _step_ms(prefill, decode, **config)
