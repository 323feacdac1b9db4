"""Seeded step-time noise: what makes a real engine's steps differ from the median a
cost model predicts.

Recorded serving runs of the reference engine show three things beyond a cost
model's bias (``NoiseModel.from_run`` measures them; ``benchmarks/cost_fit.py``
prints them):

- a small jitter on every step (about 1% in log terms), correlated over a few steps;
- slow episodes: a few % of steps fall in stretches of tens of steps (a few hundred
  ms) that all run 10-30% slower -- the host being slowed down for a while;
- isolated stalls: a few ms added to one step (or two), several times likelier in
  a step that finishes a prompt (a new activation shape, new request state) than in
  a decode-only step.

Slow episodes and stalls only ever add time: they lower throughput, which moves
queueing near saturation, and they are what P99s see.

Model, per step: ``ms * exp(sigma * x_t) * (1 + e_t * episode) + s_t * stall``, with
``x_t`` a unit AR(1) series (coefficient ``rho``); the episode a two-state Markov chain
(enter with ``p_episode``, stay with ``p_episode_stay``) whose slowdown ``episode`` is
log-normal (median ``episode_median``, log spread ``episode_s``), drawn when it
starts; a stall happens with
probability ``p_stall`` (``p_stall_final`` in a step that completes a prompt) and adds
log-normal milliseconds (median ``stall_median_ms``, log spread ``stall_s``). The kernel
consumes five pre-drawn standard normals per step (the executor draws them from its
numpy ``Generator``), so a run is reproducible from its seed and the compiled loop can
call the same kernel.

``NoiseModel.from_profile`` takes the jitter from the profile's rows (their
p10-to-median spread, which slow repeats do not reach) and the episode and stall
parameters from ``DEFAULT_SLOW`` (measured on the reference engine's recorded runs);
``NoiseModel.from_run`` measures them all on recorded runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from simulator.kernel import kernel

Q_SIGMA = 0
Q_RHO = 1
Q_P_EPISODE = 2
Q_P_EPISODE_STAY = 3
Q_EPISODE_MU = 4
Q_EPISODE_S = 5
Q_P_STALL = 6
Q_P_STALL_FINAL = 7
Q_STALL_MU = 8
Q_STALL_S = 9
N_Q = 10
N_Z = 5             # standard normals a step consumes

# Measured on the reference engine's two recorded runs, pooled (``from_run`` against
# the fitted physics model; ``benchmarks/cost_fit.py`` prints the measurement).
DEFAULT_SLOW = {"rho": 0.38, "p_episode": 0.002, "p_episode_stay": 0.95,
                "episode_median": 0.144, "episode_s": 0.53, "p_stall": 0.023,
                "p_stall_final": 0.134, "stall_median_ms": 2.27, "stall_s": 0.57}
# A step is in a slow episode when the median of the 15 steps around it runs this much
# (log) above what its composition usually costs; a stall is a step this much above
# (both relative, several jitter sigmas, and in milliseconds).
EPISODE_REL = 0.05
STALL_REL = 0.04
STALL_MS = 1.0


@kernel
def normal_cdf(z):
    """Standard normal CDF (turns a pre-drawn normal into a uniform)."""
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


@kernel
def noise_ms(q, state, ms, z, completes):
    """The next step's time with noise, from its modelled ``ms``; ``state`` = ``[x,
    in_episode, slowdown]`` is updated in place; ``z``: five standard normals; ``completes``:
    the step finishes a prompt."""
    rho = q[Q_RHO]
    # state: [x, in an episode, the episode's slowdown]
    x = rho * state[0] + math.sqrt(max(1.0 - rho * rho, 0.0)) * z[0]
    u = normal_cdf(z[1])
    if state[1] > 0.0:
        ep = u < q[Q_P_EPISODE_STAY]
    else:
        ep = u < q[Q_P_EPISODE]
        if ep:
            # An episode's slowdown is drawn when it starts and holds throughout.
            state[2] = math.exp(q[Q_EPISODE_MU] + q[Q_EPISODE_S] * z[4])
    state[0] = x
    state[1] = 1.0 if ep else 0.0
    t = ms * math.exp(q[Q_SIGMA] * x)
    if ep:
        t *= 1.0 + state[2]
    p = q[Q_P_STALL_FINAL] if completes else q[Q_P_STALL]
    if normal_cdf(z[2]) < p:
        t += math.exp(q[Q_STALL_MU] + q[Q_STALL_S] * z[3])
    return t


@kernel
def noise_run(q, state, ms, z):
    """``ms[:k]`` of ``k`` consecutive decode-only steps with noise, in place
    (``z``: ``[k, 5]``)."""
    for j in range(ms.shape[0]):
        ms[j] = noise_ms(q, state, ms[j], z[j], False)


def _iqr_sigma(x: np.ndarray) -> float:
    q25, q75 = np.percentile(x, [25, 75])
    return float((q75 - q25) / 1.349)


@dataclass
class NoiseModel:
    """Parameters of the step-time noise (module doc) and its running state."""

    sigma: float
    rho: float = DEFAULT_SLOW["rho"]
    p_episode: float = DEFAULT_SLOW["p_episode"]
    p_episode_stay: float = DEFAULT_SLOW["p_episode_stay"]
    episode_median: float = DEFAULT_SLOW["episode_median"]
    episode_s: float = DEFAULT_SLOW["episode_s"]
    p_stall: float = DEFAULT_SLOW["p_stall"]
    p_stall_final: float = DEFAULT_SLOW["p_stall_final"]
    stall_median_ms: float = DEFAULT_SLOW["stall_median_ms"]
    stall_s: float = DEFAULT_SLOW["stall_s"]
    source: str = ""
    q: np.ndarray = field(init=False, repr=False)
    state: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.q = np.array([self.sigma, self.rho, self.p_episode, self.p_episode_stay,
                           math.log(max(self.episode_median, 1e-9)), self.episode_s,
                           self.p_stall, self.p_stall_final,
                           math.log(max(self.stall_median_ms, 1e-9)), self.stall_s],
                          dtype=np.float64)
        self.state = np.zeros(3)

    @classmethod
    def from_profile(cls, profile: dict) -> "NoiseModel":
        """The jitter from the rows' lower spread, ``log(ms / p10) / z(0.9)``, median over
        rows; episodes and stalls from ``DEFAULT_SLOW``."""
        s = []
        for sec in ("prefill", "decode", "mixed", "decode_eager", "prefill_partial"):
            for r in profile.get(sec) or []:
                if r.get("p10") and r["ms"] > r["p10"] > 0:
                    s.append(math.log(r["ms"] / r["p10"]) / 1.2815516)
        sigma = float(np.median(s)) if s else 0.0
        return cls(sigma=sigma, source="jitter from the profile's spread; episodes and "
                                        "stalls measured on the reference runs")

    @classmethod
    def from_run(cls, measured_ms, predicted_ms, completes, cells, skip: int = 40
                 ) -> "NoiseModel":
        """Measure every parameter on recorded runs. Per step: the measured and a cost
        model's predicted milliseconds, whether the step completes a prompt, and a label
        of its composition (steps alike in kind, batch, context and prefill tokens share
        one); each argument an array, or a list of arrays (one per run, pooled). The
        model's own bias is removed first: a step's log ratio minus the median of its
        label's, so what is left is how this step differs from steps like it. The first
        ``skip`` steps of each run (warm-up) are left out."""
        if isinstance(measured_ms, np.ndarray):
            measured_ms, predicted_ms, completes, cells = (
                [measured_ms], [predicted_ms], [completes], [cells])
        per_run = []
        for d, m, f, cell in zip(measured_ms, predicted_ms, completes, cells):
            d = np.asarray(d, float)
            lr = np.log(d / np.asarray(m, float))
            cell = np.asarray(cell)
            med = {k: np.median(lr[cell == k]) for k in np.unique(cell)}
            x = lr - np.array([med[k] for k in cell])
            ex = d - d * np.exp(-x)                     # ms above steps like it
            n = len(x)
            roll = np.array([np.median(x[max(0, i - 7):i + 8]) for i in range(n)])
            per_run.append((x[skip:], ex[skip:], np.asarray(f, bool)[skip:], roll[skip:]))
        ep_frac, ep_lens, ep_levels = [], [], []
        core, pairs, stall_ms = [], [], []
        n_st = {True: [0, 0], False: [0, 0]}
        for x, ex, fin, roll in per_run:
            ep = roll > EPISODE_REL
            ep_frac.append(ep)
            start = None
            for i, v in enumerate(np.append(ep, False)):
                if v and start is None:
                    start = i
                elif not v and start is not None:
                    ep_lens.append(i - start)
                    ep_levels.append(np.median(x[start:i]))
                    start = None
            st = (x > STALL_REL) & (ex > STALL_MS) & ~ep
            for flag in (True, False):
                sel = ~ep & (fin == flag)
                n_st[flag][0] += int(st[sel].sum())
                n_st[flag][1] += int(sel.sum())
            stall_ms.append(ex[st])
            ok = ~ep & ~st
            core.append(x[ok])
            both = ok[:-1] & ok[1:]
            pairs.append(np.c_[x[:-1][both], x[1:][both]])
        in_ep = np.concatenate(ep_frac)
        f_ep = float(in_ep.mean())
        mean_len = float(np.mean(ep_lens)) if ep_lens else 1.0
        stay = 1.0 - 1.0 / max(mean_len, 1.0)
        enter = f_ep / max(1.0 - f_ep, 1e-9) * (1.0 - stay)
        lev = np.array(ep_levels)
        lev = np.log(np.maximum(np.expm1(lev[lev > 0]), 1e-6)) if (lev > 0).sum() > 1 else None
        core = np.concatenate(core)
        lag = np.concatenate(pairs)
        rho = float(np.clip(np.corrcoef(lag[:, 0], lag[:, 1])[0, 1], 0.0, 0.95)) \
            if len(lag) > 3 else 0.0
        sm = np.concatenate(stall_ms)
        ls = np.log(sm) if len(sm) > 1 else None
        return cls(
            sigma=_iqr_sigma(core), rho=rho, p_episode=enter, p_episode_stay=stay,
            episode_median=float(np.exp(np.median(lev))) if lev is not None
            else DEFAULT_SLOW["episode_median"],
            episode_s=float(np.std(lev)) if lev is not None else DEFAULT_SLOW["episode_s"],
            p_stall=n_st[False][0] / max(n_st[False][1], 1),
            p_stall_final=n_st[True][0] / max(n_st[True][1], 1),
            stall_median_ms=float(np.exp(np.median(ls))) if ls is not None
            else DEFAULT_SLOW["stall_median_ms"],
            stall_s=float(np.std(ls)) if ls is not None else DEFAULT_SLOW["stall_s"],
            source=f"measured on {len(per_run)} recorded run(s)")

    def next(self, rng: np.random.Generator, ms: float, completes: bool) -> float:
        """The next step's milliseconds with noise (draws ``N_Z`` normals from ``rng``)."""
        return noise_ms(self.q, self.state, ms, rng.standard_normal(N_Z), completes)

    def run(self, rng: np.random.Generator, ms: np.ndarray) -> np.ndarray:
        """``ms`` of consecutive decode-only steps with noise, in place: the same draws,
        in the same order, as one call of ``next`` per step."""
        noise_run(self.q, self.state, ms, rng.standard_normal((len(ms), N_Z)))
        return ms

    def min_factor(self) -> float:
        """A lower bound on the jitter factor for practical purposes (five sigma)."""
        return math.exp(-5.0 * self.sigma)

    def describe(self) -> dict:
        out = {k: round(float(getattr(self, k)), 5) for k in (
            "sigma", "rho", "p_episode", "p_episode_stay", "episode_median", "episode_s",
            "p_stall", "p_stall_final", "stall_median_ms", "stall_s")}
        out["source"] = self.source
        return out
