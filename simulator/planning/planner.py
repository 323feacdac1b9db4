"""Capacity planner: the cheapest configuration that meets every SLO for a scenario's traffic.

The search space is the product of ``--search`` axes (as sweep grids); ``replicas``
(``cluster.replicas``, default ``1:64``) is special: latency does not get worse with
more replicas of the same engine, so for every combination of the other axes the
smallest sufficient replica count is found by binary search (about log2(R) runs, not
R), the combinations' searches advancing in lockstep so they run in parallel. A
configuration costs ``replicas x GPUs per replica x $/GPU-hour``; the cheapest
feasible one is chosen (ties: the one with the most slack), the next ones are the
runner-ups.

Hardware is an axis too: ``gpus`` (a list of catalogued GPU types) makes the model's
step cost a roofline estimate (``simulator.cost.roofline``) for each type, with the
axes ``tp`` and ``pp`` (``model.cost.tp`` / ``.pp``); a scenario whose cost model is a
measured profile has that profile carried to each GPU (``calibrate``). GPUs per
replica are then tp x pp, and the price per GPU-hour may differ by type
(``prices``). A configuration that cannot run (a TP the model's heads do not divide,
weights that do not fit the GPU's memory) is skipped before any simulation, with
its reason (``Plan.skipped``).

An SLO is ``[class:]metric<=bound`` (also ``<``, ``>=``, ``>``): ``metric`` is a summary
column (``p99_ttft_ms``, ``mean_t_queue_ms``, ``request_goodput`` ...), ``class`` a
priority class of the workload (case-insensitive). With several seeds every seed must
meet it. Every request must also complete (an implicit SLO, ``completed``).

The binding SLO of a choice is the SLO it misses first as its load grows (one rule for
the report, the headroom line and the load-curve plot): of its own runs at higher
rates (the headroom search), the first that misses one; without those, the next smaller
size; without that, the SLO closest to its bound. Of the SLOs one run misses, the one
furthest past its bound. Without a choice: the SLO most configurations miss.

Headroom: the highest multiple of the workload's rate the chosen configuration
sustains within the SLOs, by bracketing (doubling) and then bisection to ``tol``
(each round evaluates as many points inside the bracket as there are idle workers;
with one it is plain bisection). Rate scaling: synthetic ``workload.arrival.rate``;
trace ``rate``, ``speedup`` or ``rate_scale``; servegen ``rate_scale``.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from simulator.config.scenario import validate_scenario
from simulator.cost.model import kind_fact
from simulator.deploy.replica import replica_gpus
from simulator.errors import LatsimError
from simulator.planning.executors import load_profile_for, make_executor
from simulator.planning.slo import SLOSpec
from simulator.planning.sweep import describe, expand, point_scenario, policy_axis, resolve_key

REPLICAS = "cluster.replicas"
GPU = "model.cost.gpu"
COMPLETED = "completed"
# Axis names the planner resolves itself (on top of sweep's shorthands).
PLAN_SHORTHANDS = {"tp": "model.cost.tp", "pp": "model.cost.pp", "ep": "model.cost.ep",
                   "dp": "model.cost.dp", "gpu": GPU}
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
    cost_per_hour: float = math.nan
    asked_rate: float = math.nan    # the scenario's rate x mult (NaN: a trace's own rate)

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
    evaluations: list = field(default_factory=list)  # every Eval simulated, in run order
    runs: int = 0
    space: int = 0
    skipped: list = field(default_factory=list)     # (params, reason) never simulated
    transfer: Optional[str] = None                  # how a GPU axis prices the steps


def price_of(prices, params: dict, cluster_price: Optional[float] = None) -> float:
    """$ per GPU-hour of a single-fleet configuration (``cluster.pools.gpu_hour_price``:
    the price of its GPU type, else ``cluster_price``, the scenario's
    ``cluster.gpu_cost_per_hour``, else the one price)."""
    from simulator.cluster.pools import gpu_hour_price
    price = gpu_hour_price(params.get(GPU), None, cluster_price, prices)
    return math.nan if price is None else price


def plan_axes(base: dict, axes: list, gpus: Optional[list],
              base_dir: Path) -> tuple[dict, Optional[str], list]:
    """A plan's scenario mapping (a copy), how its cost model was carried to the GPU types
    (``hardware_base``; None without ``--gpus``) and its axes: shorthands
    (``PLAN_SHORTHANDS``) spelled out, ``--gpus`` a GPU axis (given once: with
    ``--search gpu=`` too it is a one-line error)."""
    from simulator.planning.sweep import Axis
    base = copy.deepcopy(base)
    transfer = None
    axes = [Axis(PLAN_SHORTHANDS.get(a.key, a.key), a.values) for a in axes]
    if gpus:
        if any(a.key == GPU for a in axes):
            raise LatsimError("give the GPU types once: --gpus or --search gpu=",
                              source="--gpus")
        base, transfer = hardware_base(base, list(gpus), base_dir)
        axes = [*axes, Axis(GPU, tuple(gpus))]
    return base, transfer, axes


def _hardware_fields(kind) -> tuple:
    """The fields of a ``model.cost`` kind that name its hardware (a roofline's gpu, tp,
    pp; none for a kind measured on one machine or not registered)."""
    return kind_fact(kind, "hardware_fields", ())


def _measured(kind) -> bool:
    """Whether a ``model.cost`` kind reads a measured profile (``path``)."""
    return kind_fact(kind, "measured", False)


def hardware_base(base: dict, gpus: list, base_dir: Path) -> tuple[dict, str]:
    """The scenario mapping with ``model.cost`` made a roofline for a GPU axis, and a
    sentence on how: a roofline keeps its settings; a measured profile (``profile``,
    ``fitted``) calibrates the roofline (its engine's terms carried to every GPU). The
    model is ``model.name``, else the profile's ``meta.model.name``."""
    from simulator.cost import catalog, load_profile, profile_search_dirs, resolve_profile_path
    out = copy.deepcopy(base)
    model = out.setdefault("model", {})
    cost = dict(model.get("cost") or {"kind": "profile",
                                      "path": "profiles/h200-llama3-8b-refbench.json"})
    for g in gpus:
        try:
            catalog.gpu(g)
        except LatsimError as e:
            raise LatsimError(str(e).split(": ", 1)[-1], source="--gpus") from None
    kind = cost.get("kind", "profile")
    if _hardware_fields(kind):
        return out, "roofline estimates from datasheets (the scenario's model.cost)"
    if not _measured(kind):
        raise LatsimError(f"a GPU axis needs a roofline or a measured profile, not a {kind!r} "
                          "cost model", source="--gpus")
    path = cost.get("path", "profiles/h200-llama3-8b-refbench.json")
    name = model.get("name")
    if not name:
        meta = load_profile(resolve_profile_path(path, profile_search_dirs(base_dir))).get("meta") or {}
        m = meta.get("model")
        mname = m.get("name") if isinstance(m, dict) else m
        try:
            name = catalog.model(str(mname)).name
        except LatsimError:
            raise LatsimError("a GPU axis needs the scenario's model: set model.name",
                              source="--gpus") from None
    model.pop("shape", None)
    model["name"] = name
    model["cost"] = {"kind": "roofline", "gpu": gpus[0], "calibrate": path}
    return out, (f"roofline estimates from datasheets, calibrated to the scenario's measured "
                 f"profile {path} (its engine's terms carried to every GPU)")


class Planner:
    """Runs the search; see the module docstring. ``gpus``: GPU types to search (a
    roofline axis); ``prices``: $ per GPU-hour, one number or one per GPU type (None:
    configurations are compared by their GPU count)."""

    settled = 0     # runs finished so far (the progress line reads it)

    def __init__(self, base: dict, base_dir: Path, slos: list, axes: list, *,
                 seeds: int = 1, executor: str = "local", workers: Optional[int] = None,
                 gpus: Optional[list] = None, prices=None) -> None:
        self.base_dir = Path(base_dir)
        self.base, self.transfer, axes = plan_axes(base, axes, gpus, self.base_dir)
        # A ``policies:`` list is an ``engine.policy`` axis whose values name its entries
        # (``policy_runs``); the run counter is kept apart from it.
        self.policy_runs: Optional[dict] = None
        if self.base.get("policies") and not any(
                resolve_key(self.base, a.key) == "engine.policy" for a in axes):
            axis, self.policy_runs = policy_axis(self.base)
            axes = [*axes, axis]
        self.base.pop("policies", None)
        if (self.base.get("cluster") or {}).get("pools"):
            # The search is over how many replicas of one engine; a mixed fleet has a
            # count per pool, and no single answer to "one more replica".
            raise LatsimError("plan sizes a fleet of one engine type, or a prefill:decode "
                              "split (pools with roles); this scenario is a mixed "
                              "fleet: plan each GPU type (--search gpu=..., tp=...) or "
                              "compare fleets with latsim sweep", source="cluster.pools")
        self.slos, self.seeds = slos, seeds
        self.prices = prices
        if isinstance(prices, dict):
            missing = sorted({v for a in axes if a.key == GPU for v in a.values} - set(prices))
            if missing or not any(a.key == GPU for a in axes):
                raise LatsimError("a price per GPU type needs a GPU axis and a price for each "
                                  f"type searched; missing: {', '.join(missing) or 'the axis'}",
                                  source="--cost-per-gpu-hour")
        rep = [a for a in axes if resolve_key(self.base, a.key) == REPLICAS]
        others = [a for a in axes if resolve_key(self.base, a.key) != REPLICAS]
        vals = rep[0].values if rep else tuple(range(1, 65))
        if not vals or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in vals):
            raise LatsimError("replicas must be whole numbers >= 1", source="--search",
                              value=list(vals)[:5], has_value=True)
        self.replicas = sorted(set(vals))
        self.seed0 = int(self.base.get("seed", 0) or 0)
        self.cache: dict = {}
        self._profiles: dict = {}
        self.runs = 0
        self.skipped: list = []
        self._keep_runnable(expand(others))  # fail fast on a bad axis value
        self.executor = make_executor(executor, workers)

    def _keep_runnable(self, combos) -> None:
        """``combos`` into ``self.combos`` (those that can run) and ``self.skipped``
        (``(combo, why)`` for those that cannot: ``_cannot_run``)."""
        self.combos = []
        for c in combos:
            why = self._cannot_run(c)
            if why is None:
                self.combos.append(c)
            else:
                self.skipped.append((c, why))

    def _cannot_run(self, combo: dict) -> Optional[str]:
        """Why a combination cannot run at all (a roofline that does not fit or cannot be
        split), or None. Other errors in a point are the user's: raised."""
        data = point_scenario(self.base, {**combo, REPLICAS: self.replicas[0]}, self.policy_runs)
        where = f"search point {describe(combo)}"
        cost = ((data.get("model") or {}).get("cost") or {})
        try:
            sc = validate_scenario(data, source=where, base_dir=self.base_dir)
        except LatsimError as e:
            if _hardware_fields(cost.get("kind")) and any(
                    f"'model.cost.{k}'" in str(e) for k in ("tp", "pp", "ep", "dp")):
                return str(e).split(": ", 1)[-1]
            raise
        return sc.model.cost.fit_reason(sc)
    def _point(self, params: dict) -> dict:
        """The scenario mapping of one configuration."""
        return point_scenario(self.base, params, self.policy_runs)

    def _size(self, sc, params: dict) -> tuple[int, float]:
        """GPUs of a configuration and its $ per hour (NaN without prices)."""
        gpus = params[REPLICAS] * replica_gpus(sc)
        return gpus, (gpus * price_of(self.prices, params, sc.cluster.gpu_cost_per_hour)
                      if self.prices is not None else math.nan)

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
            data = self._point(params)
            sc = validate_scenario(data, source=f"search point {describe(params)}",
                                   base_dir=self.base_dir)
            asked = asked_rate(sc) * mult
            if mult != 1.0:
                data = scale_rate(data, sc, mult)
            prof = load_profile_for(sc, self.base_dir, self._profiles)
            todo.append(key)
            gpus, per_hour = self._size(sc, params)
            self.cache[key] = Eval(params, mult, gpus, [None] * self.seeds, self.slos, per_hour,
                                   asked)
            for j in range(self.seeds):
                tasks.append((key, j, (data, self.seed0 + j, str(self.base_dir), prof)))
        for i, row in self.executor.imap_unordered([t[2] for t in tasks]):
            key, j, _ = tasks[i]
            self.cache[key].rows[j] = {**row, "seed": self.seed0 + j}
            self.settled += 1
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
                      key=lambda e: (e.cost_per_hour if e.cost_per_hour == e.cost_per_hour
                                     else e.gpus, e.gpus, e.slack))
        plan = Plan(self.slos, feas[0] if feas else None, feas[1:], best, None, None, "",
                    space=n * len(self.combos), skipped=list(self.skipped),
                    transfer=self.transfer)
        _bind(plan, self)
        plan.runs = self.runs
        plan.evaluations = list(self.cache.values())
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
        if curve:
            done = [m for m, _ in self._chosen_evals(ch)]
            fill = [f * lo for f in (0.25, 0.5, 0.75)]
            if hi is None or hi > 1.3 * lo:
                fill.append(1.2 * lo)
            self.evaluate([(ch.params, m) for m in fill
                           if all(abs(m - d) > 0.03 * lo for d in done)])
        plan.curve = [ev for m, ev in sorted(self._chosen_evals(ch), key=lambda t: t[0])
                      if m <= 1.6 * lo]
        # The SLO missed first as the load grows, now that higher rates have been run.
        first = next((ev for _, ev in sorted(self._chosen_evals(ch), key=lambda t: t[0])
                      if not ev.feasible), None)
        if first is not None:
            worst = self._worst(first.violations)
            plan.binding = plan.headroom_binding = worst
            plan.binding_detail = (
                f"missed first as the load grows: at {first.mult:.3g}x the scenario's rate, "
                + missed_text(first.violations, self.slos) + "; " + plan.binding_detail)
        plan.runs = self.runs
        plan.evaluations = list(self.cache.values())

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

    def _worst(self, violations: list) -> Optional[str]:
        """Of one run's ``(slo text, value)`` misses, the one furthest past its bound."""
        return max(violations, key=lambda tv: self._ratio(*tv))[0] if violations else None

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
        plan.binding = planner._worst(viol)
        plan.binding_detail = (f"with {r[k - 1]} replica{'s' * (r[k - 1] > 1)}: "
                               + missed_text(viol, plan.slos))
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


def value_text(text: str, v, slos: list) -> str:
    """A missed objective's value as a person reads it, with its unit: ``5,461 ms``,
    ``3 request(s) unfinished`` (the implicit ``completed``)."""
    if text == COMPLETED:
        return f"{_fmt(v)} request(s) unfinished"
    slo = next((s for s in slos if s.text == text), None)
    unit = slo.unit if slo is not None else ""
    return f"{_fmt(v)} {unit}".rstrip()


def missed_text(violations: list, slos: list) -> str:
    """``P0:p99_ttft_ms<=300 missed (5,461 ms); ...`` for one run's misses."""
    return "; ".join("completed missed (" + value_text(t, v, slos) + ")" if t == COMPLETED
                     else f"{t} missed ({value_text(t, v, slos)})" for t, v in violations)


def asked_rate(sc) -> float:
    """The arrival rate (req/s) a scenario asks for, when it names one (a synthetic
    workload's ``arrival.rate``, a trace's ``rate``), else NaN: what the sampled arrivals
    realise (``offered_rate``) differs from it by sampling noise."""
    wl = sc.workload
    if wl.kind == "synthetic":
        return float(wl.arrival.rate)
    rate = getattr(wl, "rate", None)
    return float(rate) if rate else math.nan


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
