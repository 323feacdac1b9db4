"""Capacity planner: the cheapest configuration that meets every SLO for a scenario's traffic.

The search space is the product of ``--search`` axes (as sweep grids); ``replicas``
(``cluster.replicas``, default ``1:64``) is special: latency does not get worse with
more replicas of the same engine, so for every combination of the other axes the
smallest sufficient replica count is found by binary search (about log2(R) runs, not
R), the combinations' searches advancing in lockstep so they run in parallel. A
configuration costs ``replicas x cluster.gpus_per_replica x $/GPU-hour``; the cheapest
feasible one is chosen (ties: the one with the most slack), the next ones are the
runner-ups.

An SLO is ``[class:]metric<=bound`` (also ``<``, ``>=``, ``>``): ``metric`` is a summary
column (``p99_ttft_ms``, ``mean_t_queue_ms``, ``request_goodput`` ...), ``class`` a
priority class of the workload (case-insensitive). With several seeds every seed must
meet it. Every request must also complete (an implicit SLO, ``completed``).

Headroom: the highest multiple of the workload's rate the chosen configuration
sustains within the SLOs, by bracketing (doubling) and then bisection to ``tol``
(each round evaluates as many points inside the bracket as there are idle workers;
with one it is plain bisection). Rate scaling: synthetic ``workload.arrival.rate``;
trace ``rate``, ``speedup`` or ``rate_scale``; servegen ``rate_scale``.
"""
from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from simulator.config.scenario import validate_scenario
from simulator.errors import LatsimError
from simulator.report.metrics import BREAKDOWN, PCTS
from simulator.planning.executors import load_profile_for, make_executor
from simulator.planning.sweep import describe, expand, point_scenario, policy_axis, resolve_key

REPLICAS = "cluster.replicas"
COMPLETED = "completed"
_OPS = {"<=": lambda v, b: v <= b, "<": lambda v, b: v < b,
        ">=": lambda v, b: v >= b, ">": lambda v, b: v > b}
_METRICS = ({f"{p}_{m}_ms" for p, _ in PCTS for m in ("ttft", "tpot", "itl", "e2el")}
            | {f"{p}_{b}_ms" for p in ("mean", "p99") for b in BREAKDOWN}
            | {"request_throughput", "output_throughput", "total_token_throughput",
               "request_goodput", "good_requests"})


@dataclass(frozen=True)
class SLOSpec:
    """One service-level objective on a summary column (overall or of one class)."""

    text: str
    cls: Optional[str]
    metric: str
    op: str
    bound: float
    column: str

    def ok(self, v: float) -> bool:
        """True when ``v`` meets the objective (NaN never does)."""
        return v == v and _OPS[self.op](v, self.bound)

    def ratio(self, v: float) -> float:
        """How far ``v`` is along the way to the bound: > 1 violates (``<=``-type), inf for NaN."""
        if v != v:
            return math.inf
        if self.op[0] == "<":
            return v / self.bound if self.bound else math.inf
        return self.bound / v if v > 0 else math.inf


def class_names_of(scenario) -> list[str]:
    """The workload's priority class names (as the scenario lists them)."""
    return [c.name for c in getattr(scenario.workload, "classes", None) or []]


def parse_slo(text: str, classes: list[str]) -> SLOSpec:
    """``[class:]metric<op>bound[ms]`` -> ``SLOSpec``; one-line errors naming the problem."""
    m = re.fullmatch(r"\s*(?:([^:<>=\s]+)\s*:\s*)?([A-Za-z0-9_]+)\s*(<=|>=|<|>)\s*"
                     r"([-+0-9.eE]+)\s*(?:ms)?\s*", text)
    if not m:
        raise LatsimError("an SLO looks like [class:]metric<=bound, e.g. p0:p99_ttft_ms<=500",
                          source="--slo", value=text, has_value=True)
    cls, metric, op, bound = m.groups()
    if metric not in _METRICS:
        raise LatsimError(f"unknown metric {metric!r}; e.g. p99_ttft_ms, median_tpot_ms, "
                          "mean_t_queue_ms, p99_e2el_ms, request_goodput", source="--slo")
    try:
        b = float(bound)
    except ValueError:
        raise LatsimError("bound is not a number", source="--slo", value=text,
                          has_value=True) from None
    if cls is not None:
        found = [c for c in classes if c.lower() == cls.lower()]
        if not found:
            raise LatsimError(f"unknown class {cls!r}; the workload's classes: "
                              f"{', '.join(classes) or '(none)'}", source="--slo")
        cls = found[0]
        if metric.endswith("_itl_ms"):
            raise LatsimError("ITL is pooled over all requests: give it without a class",
                              source="--slo", value=text, has_value=True)
    column = f"{cls}:{metric}" if cls is not None and len(classes) > 1 else metric
    return SLOSpec(text.strip(), cls, metric, op, b, column)


def default_slos(scenario) -> list[SLOSpec]:
    """P99 TTFT/TPOT/E2EL bounds from the workload classes' own SLOs (when no --slo)."""
    classes = class_names_of(scenario)
    out = []
    for c in getattr(scenario.workload, "classes", None) or []:
        slo = c.slo or scenario.slo
        for m in ("ttft", "tpot", "e2el"):
            b = getattr(slo, f"{m}_ms", None)
            if b is not None:
                out.append(parse_slo(f"{c.name}:p99_{m}_ms<={b:g}", classes))
    return out


def scale_rate(data: dict, scenario, mult: float) -> dict:
    """A copy of the scenario mapping with its workload's arrival rate multiplied by ``mult``."""
    out = copy.deepcopy(data)
    wl = scenario.workload
    w = out["workload"]
    if wl.kind == "synthetic":
        arrival = dict(w.get("arrival") or {})
        arrival["rate"] = wl.arrival.rate * mult
        w["arrival"] = arrival
    elif wl.kind == "trace":
        key = next((k for k in ("rate", "speedup", "rate_scale") if getattr(wl, k)), "rate_scale")
        w[key] = (getattr(wl, key) or 1.0) * mult
    elif hasattr(wl, "rate_scale"):
        w["rate_scale"] = wl.rate_scale * mult
    else:
        raise LatsimError(f"cannot scale the rate of a {wl.kind!r} workload", field="workload")
    return out


@dataclass
class Eval:
    """One configuration at one rate multiplier: its rows (one per seed) against the SLOs."""

    params: dict
    mult: float
    gpus: int
    rows: list
    slos: list

    def value(self, slo: SLOSpec) -> float:
        """The worst value over seeds (NaN when any seed lacks it)."""
        vals = [float(r.get(slo.column, math.nan)) for r in self.rows]
        if any(v != v for v in vals):
            return math.nan
        return max(vals) if slo.op[0] == "<" else min(vals)

    def mean(self, column: str) -> float:
        """The mean of a column over seeds."""
        vals = [float(r.get(column, math.nan)) for r in self.rows]
        return sum(vals) / len(vals)

    @property
    def errors(self) -> list[str]:
        """Error messages of seeds whose run failed (a user error in the point)."""
        return [r["error"] for r in self.rows if "error" in r]

    @property
    def violations(self) -> list[tuple[str, float]]:
        """``(slo text, worst value)`` for each SLO missed, ``completed`` if requests were lost."""
        if self.errors:
            return [("error", math.nan)]
        out = [(s.text, self.value(s)) for s in self.slos if not s.ok(self.value(s))]
        lost = max(int(r.get("not_finished", 0)) for r in self.rows)
        return out + ([(COMPLETED, lost)] if lost else [])

    @property
    def feasible(self) -> bool:
        """Meets every SLO on every seed, with every request completed."""
        return not self.violations

    @property
    def slack(self) -> float:
        """The largest SLO ratio (lower = more slack)."""
        return max((s.ratio(self.value(s)) for s in self.slos), default=0.0)


@dataclass
class Plan:
    """The planner's answer."""

    slos: list
    chosen: Optional[Eval]
    runner_ups: list
    best_per_combo: list            # (combo, its cheapest feasible Eval, else its largest tried)
    below: Optional[Eval]           # chosen combo at the next smaller replica count tried
    binding: Optional[str]
    binding_detail: str
    headroom: Optional[float] = None
    headroom_capped: bool = False
    headroom_binding: Optional[str] = None
    curve: list = field(default_factory=list)
    runs: int = 0
    space: int = 0


class Planner:
    """Runs the search; see the module docstring."""

    def __init__(self, base: dict, base_dir: Path, slos: list, axes: list, *,
                 seeds: int = 1, executor: str = "local", workers: Optional[int] = None) -> None:
        self.base = copy.deepcopy(base)
        self.runs = None
        if self.base.get("policies") and not any(
                resolve_key(self.base, a.key) == "engine.policy" for a in axes):
            axis, self.runs = policy_axis(self.base)
            axes = [*axes, axis]
        self.base.pop("policies", None)
        self.base_dir, self.slos, self.seeds = Path(base_dir), slos, seeds
        rep = [a for a in axes if resolve_key(self.base, a.key) == REPLICAS]
        others = [a for a in axes if resolve_key(self.base, a.key) != REPLICAS]
        vals = rep[0].values if rep else tuple(range(1, 65))
        if not vals or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in vals):
            raise LatsimError("replicas must be whole numbers >= 1", source="--search",
                              value=list(vals)[:5], has_value=True)
        self.replicas = sorted(set(vals))
        self.combos = expand(others)
        self.seed0 = int(self.base.get("seed", 0) or 0)
        self.executor = make_executor(executor, workers)
        self.cache: dict = {}
        self._profiles: dict = {}
        self.runs = 0
        for c in self.combos:  # fail fast on a bad axis value
            validate_scenario(point_scenario(self.base, {**c, REPLICAS: self.replicas[0]}, self.runs),
                              source=f"search point {describe(c)}")

    def close(self) -> None:
        """Release the executor."""
        self.executor.close()

    def evaluate(self, configs: list[tuple[dict, float]]) -> list[Eval]:
        """Run (params, rate multiplier) configurations not yet run, all seeds in parallel."""
        todo, tasks = [], []
        for params, mult in configs:
            key = (tuple(sorted((k, repr(v)) for k, v in params.items())), mult)
            if key in self.cache or key in todo:
                continue
            data = point_scenario(self.base, params, self.runs)
            sc = validate_scenario(data, source=f"search point {describe(params)}")
            if mult != 1.0:
                data = scale_rate(data, sc, mult)
            prof = load_profile_for(sc, self.base_dir, self._profiles)
            todo.append(key)
            self.cache[key] = Eval(params, mult, params[REPLICAS] * sc.cluster.gpus_per_replica,
                                   [None] * self.seeds, self.slos)
            for j in range(self.seeds):
                tasks.append((key, j, (data, self.seed0 + j, str(self.base_dir), prof)))
        for i, row in self.executor.imap_unordered([t[2] for t in tasks]):
            key, j, _ = tasks[i]
            self.cache[key].rows[j] = row
        self.runs += len(tasks)
        return [self.cache[(tuple(sorted((k, repr(v)) for k, v in p.items())), m)]
                for p, m in configs]

    def search(self) -> Plan:
        """Binary search on replicas for every combination, in lockstep."""
        n = len(self.replicas)
        state = [[0, n] for _ in self.combos]          # first feasible index in [lo, hi]
        while any(lo < hi for lo, hi in state):
            active = [i for i, (lo, hi) in enumerate(state) if lo < hi]
            mids = {i: (state[i][0] + state[i][1]) // 2 for i in active}
            evs = self.evaluate([({**self.combos[i], REPLICAS: self.replicas[mids[i]]}, 1.0)
                                 for i in active])
            for i, ev in zip(active, evs):
                if ev.feasible:
                    state[i][1] = mids[i]
                else:
                    state[i][0] = mids[i] + 1
        best = []
        for c, (lo, _) in zip(self.combos, state):
            k = min(lo, n - 1)
            best.append((c, self.evaluate([({**c, REPLICAS: self.replicas[k]}, 1.0)])[0]))
        feas = sorted((ev for _, ev in best if ev.feasible),
                      key=lambda e: (e.gpus, e.slack))
        plan = Plan(self.slos, feas[0] if feas else None, feas[1:], best, None, None, "",
                    space=n * len(self.combos))
        _bind(plan, self)
        plan.runs = self.runs
        return plan

    def headroom(self, plan: Plan, tol: float = 0.05, max_mult: float = 64.0,
                 curve: bool = True) -> None:
        """Highest rate multiplier the chosen configuration sustains (bracket, then bisect)."""
        ch = plan.chosen
        width = max(1, min(8, self.executor.workers // self.seeds))
        lo, hi = 1.0, None
        while hi is None and lo < max_mult:
            # Bracket: w points up to 2x the last feasible rate, geometrically spaced.
            ms = [min(lo * 2 ** ((k + 1) / width), max_mult) for k in range(width)]
            lo, hi, _ = self._step(ch, dict.fromkeys(ms), lo, hi)
        while hi is not None and (hi - lo) / lo > tol:
            ms = [lo + (hi - lo) * (k + 1) / (width + 1) for k in range(width)]
            lo, hi, _ = self._step(ch, ms, lo, hi)
        plan.headroom, plan.headroom_capped = lo, hi is None
        if hi is not None:
            bad = self.evaluate([(ch.params, hi)])[0]
            plan.headroom_binding = max(bad.violations, key=lambda tv: self._ratio(*tv))[0]
        if curve:
            done = [m for m, _ in self._chosen_evals(ch)]
            fill = [f * lo for f in (0.25, 0.5, 0.75)]
            if hi is None or hi > 1.3 * lo:
                fill.append(1.2 * lo)
            self.evaluate([(ch.params, m) for m in fill
                           if all(abs(m - d) > 0.03 * lo for d in done)])
        plan.curve = [ev for m, ev in sorted(self._chosen_evals(ch), key=lambda t: t[0])
                      if m <= 1.6 * lo]
        plan.runs = self.runs

    def _step(self, ch: Eval, ms, lo: float, hi: Optional[float]):
        """Evaluate multipliers (increasing); the bracket moves to the last feasible one."""
        bad = None
        for ev in self.evaluate([(ch.params, m) for m in ms]):
            if ev.feasible:
                lo = ev.mult
            else:
                hi, bad = ev.mult, ev
                break
        return lo, hi, bad

    def _ratio(self, text: str, v: float) -> float:
        slo = next((s for s in self.slos if s.text == text), None)
        return slo.ratio(v) if slo else math.inf

    def _chosen_evals(self, ch: Eval) -> list:
        """``(multiplier, Eval)`` of every run of the chosen configuration."""
        key = tuple(sorted((k, repr(v)) for k, v in ch.params.items()))
        return [(m, ev) for (k, m), ev in self.cache.items() if k == key]


def _bind(plan: Plan, planner: Planner) -> None:
    """Which SLO binds: for the choice, what the next smaller size missed; without one,
    the SLO missed by the most combinations at their largest size (ties: the closer miss)."""
    if plan.chosen is not None:
        ch = plan.chosen
        r = planner.replicas
        k = r.index(ch.params[REPLICAS])
        if k == 0:
            tight = max(plan.slos, key=lambda s: s.ratio(ch.value(s)), default=None)
            plan.binding = tight.text if tight else None
            plan.binding_detail = (f"the smallest size searched ({r[0]} replica{'s' * (r[0] > 1)}) already meets "
                                   "every SLO" + (f"; tightest: {tight.text}" if tight else ""))
            return
        below = planner.evaluate([({**ch.params, REPLICAS: r[k - 1]}, 1.0)])[0]
        plan.below = below
        viol = below.violations
        plan.binding = max(viol, key=lambda tv: planner._ratio(*tv))[0] if viol else None
        plan.binding_detail = f"with {r[k - 1]} replicas: " + "; ".join(
            f"{t} missed ({_fmt(v)})" for t, v in viol)
        return
    counts: dict = {}
    for _, ev in plan.best_per_combo:
        for text, _v in ev.violations:
            counts[text] = counts.get(text, 0) + 1
    if not counts:
        return
    # The closest candidate: the one whose worst miss is smallest.
    closest = min((ev for _, ev in plan.best_per_combo),
                  key=lambda e: max(planner._ratio(*tv) for tv in e.violations))
    at_closest = {t: planner._ratio(t, v) for t, v in closest.violations}
    text = max(counts, key=lambda t: (counts[t], at_closest.get(t, 0.0)))
    r = at_closest.get(text)
    plan.binding = text
    plan.binding_detail = (
        f"missed by {counts[text]} of {len(plan.best_per_combo)} configuration(s) even at their "
        f"largest size" + (f"; the closest ({describe(closest.params)}) is at {r:.2f}x its bound"
                           if r is not None and math.isfinite(r) else ""))


def _fmt(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return "n/a" if v != v else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.3g}")


def knee(xs: list, ys: list) -> Optional[int]:
    """Index of the knee of an increasing convex curve (Kneedle: farthest below the chord)."""
    pts = [(x, y) for x, y in zip(xs, ys) if y == y]
    if len(pts) < 3:
        return None
    x0, x1 = pts[0][0], pts[-1][0]
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if x1 <= x0 or y1 <= y0:
        return None
    d = [(x - x0) / (x1 - x0) - (y - y0) / (y1 - y0) for x, y in pts]
    i = max(range(len(d)), key=d.__getitem__)
    return xs.index(pts[i][0]) if d[i] > 0 else None
