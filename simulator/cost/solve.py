"""The one solver every cost fit uses: robust, bounded, non-negative least squares.

A fit here finds coefficients ``x`` (usually the logarithms of non-negative physical
coefficients, so that they stay positive) within ``[lo, hi]`` that minimise

    sum_i  w_i * rho(r_i(x))  [+  sum_j ((x_j - p_j) / sd)^2 / 2]

where ``r(x)`` are residuals (typically log errors of predicted over measured
times), ``w`` optional fixed weights, ``rho`` the Huber loss (squares up to
``huber``, linear beyond: a row the model misses pulls less) and the bracket an
optional quadratic pull towards prior values that only decides what the data leave
open. It is projected Levenberg-Marquardt: a finite-difference Jacobian, damped
Gauss-Newton steps on the Huber-weighted normal equations, clipped to the bounds,
with a coordinate pinned at a bound while the gradient pushes it outwards. numpy only.

Callers (``fit``: a profile's rows; ``roofline``: the default efficiencies and a
calibration's scales; ``calibration.refit``: a recorded run's intervals) set the
damping schedule, the stopping rule and the finite differences they were tuned and
their stored results computed with; the defaults are the profile fit's.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np


class Solution(NamedTuple):
    """Where ``solve`` stopped: the coefficients, their residuals, and the loss."""

    x: np.ndarray
    r: np.ndarray
    loss: float


def huber_loss(r: np.ndarray, huber: float) -> np.ndarray:
    """Per residual: ``r^2 / 2`` up to ``|r| = huber``, ``huber (|r| - huber / 2)``
    beyond (the same slope at the join); ``r^2 / 2`` everywhere when ``huber <= 0``."""
    a = np.abs(r)
    if huber <= 0.0:
        return 0.5 * a * a
    return np.where(a <= huber, 0.5 * a * a, huber * (a - 0.5 * huber))


def huber_weights(r: np.ndarray, huber: float) -> np.ndarray:
    """The weight of each residual in the reweighted normal equations: 1 up to
    ``huber``, ``huber / |r|`` beyond (all ones when ``huber <= 0``)."""
    if huber <= 0.0:
        return np.ones_like(r)
    a = np.abs(r)
    return np.where(a <= huber, 1.0, huber / np.maximum(a, 1e-300))


def jacobian(resid: Callable[[np.ndarray], np.ndarray], x: np.ndarray, r: np.ndarray, *,
             step: float = 1e-6, relative_step: bool = False,
             hi: Optional[np.ndarray] = None) -> np.ndarray:
    """Forward-difference Jacobian of ``resid`` at ``x`` (``r = resid(x)``): a step of
    ``step`` (times ``max(1, |x_j|)`` when ``relative_step``), taken backwards where a
    forward one would leave ``hi`` (when given), so ``resid`` is only evaluated inside
    the bounds."""
    J = np.empty((len(r), len(x)))
    for j in range(len(x)):
        xp = x.copy()
        h = step * max(1.0, abs(x[j])) if relative_step else step
        if hi is not None and xp[j] + h > hi[j]:
            h = -h
        xp[j] += h
        J[:, j] = (resid(xp) - r) / h
    return J


def solve(resid: Callable[[np.ndarray], np.ndarray], x0, lo, hi, *, huber: float = 0.0,
          weights: Optional[np.ndarray] = None, prior: Optional[tuple] = None,
          iters: int = 200, lam: float = 1e-3, tries: int = 12, ridge: float = 1e-9,
          tol: float = 1e-10, lam_min: float = 1e-9, step: float = 1e-6,
          relative_step: bool = False, step_inside: bool = True,
          sqrt_weights: bool = True) -> Solution:
    """Minimise the robust loss of ``resid`` over ``x`` in ``[lo, hi]`` from ``x0``
    (module doc); returns the ``Solution`` it stopped at.

    - ``huber``: the Huber threshold on the residuals (``<= 0``: plain least squares);
      ``weights``: a fixed weight per residual (default all 1).
    - ``prior``: ``(centre, sd)``: adds ``sum ((x - centre) / sd)^2 / 2``, never
      Huber-capped. (A pull that should be capped belongs in ``resid`` instead.)
    - Damping: Marquardt's ``lam`` to start, times 10 on each of up to ``tries``
      rejected steps, divided by 10 (not below ``lam_min``) after an accepted one; it
      scales ``diag(H) + ridge``. Stops after ``iters`` steps, when no damping gives a
      lower loss, or when a step lowers it by less than ``tol`` of itself.
    - Finite differences (``jacobian``): ``step``, ``relative_step``; ``step_inside``:
      step backwards at the upper bound.
    - ``sqrt_weights``: form the normal equations from the rows scaled by the square
      roots of their weights (``A = sqrt(w) J``, ``H = A^T A``) rather than as
      ``J^T W J``. The two agree to rounding; each caller keeps the form its stored
      fits were computed with, so that they reproduce to the bit."""
    lo = np.asarray(lo, float)
    hi = np.asarray(hi, float)
    x = np.clip(np.asarray(x0, float), lo, hi)

    def loss(xv, rv):
        h = huber_loss(rv, huber)
        data = np.sum(h if weights is None else weights * h)
        if prior is None:
            return float(data)
        return float(data + 0.5 * np.sum(((xv - prior[0]) / prior[1]) ** 2))

    r = resid(x)
    f = loss(x, r)
    for _ in range(iters):
        g, H = _normal_equations(resid, x, r, huber, weights, prior, hi if step_inside else None,
                                 step, relative_step, sqrt_weights)
        # Coordinates pinned at a bound with the gradient pushing outwards stay there.
        pinned = ((x <= lo + 1e-12) & (g > 0)) | ((x >= hi - 1e-12) & (g < 0))
        improved = False
        for _ in range(tries):
            M = H + lam * np.diag(np.diag(H) + ridge)
            M[pinned, :] = 0.0
            M[:, pinned] = 0.0
            M[pinned, pinned] = 1.0
            gg = np.where(pinned, 0.0, g)
            try:
                dx = -np.linalg.solve(M, gg)
            except np.linalg.LinAlgError:
                dx = -gg / (np.diag(M) + ridge)
            xn = np.clip(x + dx, lo, hi)
            rn = resid(xn)
            fn = loss(xn, rn)
            if fn < f:
                improved = True
                break
            lam *= 10.0
        if not improved:
            break
        done = f - fn < tol * max(f, 1e-12)
        x, r, f = xn, rn, fn
        lam = max(lam / 10.0, lam_min)
        if done:
            break
    return Solution(x, r, f)


def _normal_equations(resid, x, r, huber, weights, prior, hi, step, relative_step,
                      sqrt_weights) -> tuple[np.ndarray, np.ndarray]:
    """Gradient ``g`` and Gauss-Newton Hessian ``H`` of ``solve``'s loss at ``x``."""
    w = huber_weights(r, huber)
    if weights is not None:
        w = weights * w
    J = jacobian(resid, x, r, step=step, relative_step=relative_step, hi=hi)
    if sqrt_weights:
        sw = np.sqrt(w)
        A = J * sw[:, None]
        g = A.T @ (r * sw)
        H = A.T @ A
    else:
        g = J.T @ (w * r)
        H = J.T @ (J * w[:, None])
    if prior is not None:
        g = g + (x - prior[0]) / prior[1] ** 2
        H = H + np.eye(len(x)) / prior[1] ** 2
    return g, H
