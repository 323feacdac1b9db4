"""Planning a disaggregated cluster (``cluster.disagg``): the cheapest prefill:decode split
(and, when asked, GPU type and TP per role) that meets every SLO.

A disaggregated scenario (one pool with ``role: prefill``, one with ``role: decode``) has
two replica counts, not one, and latency is not monotone in their sum: one more prefill
replica shortens TTFT, one more decode replica TPOT. So the planner does not bisect a
replica count as ``planner.Planner`` does; it simulates every point of the product of
its axes:

- ``prefill_replicas`` and ``decode_replicas`` (``--search prefill_replicas=1:4``), or
  ``total``: every split of that many replicas (1 to total - 1 prefill replicas, the
  rest decode; ``latsim plan --disaggregate N``);
- ``prefill_gpu`` / ``decode_gpu`` and ``prefill_tp`` / ``decode_tp`` (and ``_pp``): a
  role's roofline GPU type and parallelism; ``gpu=``, ``tp=``, ``pp=`` or ``--gpus``
  search each role's independently (every pair);
- any other scenario key, as ``latsim sweep --grid``.

A point costs, over its pools, replicas x GPUs per replica (tp x pp) x $ per GPU-hour,
each pool priced as ``latsim run`` prices it (``cluster.pools.gpu_hour_price``: the
``--cost-per-gpu-hour`` price of its GPU type, else its own ``gpu_cost_per_hour``, else
the cluster's, else the one ``--cost-per-gpu-hour`` price; a pool left unpriced is a
one-line error before any run). A ``policies:`` list is an axis, as for ``Planner``; an
entry that makes the cluster colocated has no split to search and is skipped. What cannot run (a TP the heads do not
divide, a model that does not fit a pool's GPU) is skipped before any simulation, with
the reason (``Plan.skipped``); every point run and missed is reported with what it
missed; the cheapest feasible one wins (ties: fewer GPUs, then more slack). Headroom
(``Planner.headroom``) works on the choice as for a single fleet.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from simulator.config.scenario import validate_scenario
from simulator.cost.model import kind_fact
from simulator.errors import LatsimError
from simulator.planning.planner import GPU, PLAN_SHORTHANDS, REPLICAS, Plan, Planner, _bind
from simulator.planning.sweep import (Axis, describe, expand, point_scenario, policy_axis,
                                      resolve_key)

ROLES = ("prefill", "decode")
# Per role: the pool field an axis sets (``replicas``, or a field of its cost model).
ROLE_FIELDS = {"replicas": None, "gpu": "gpu", "tp": "tp", "pp": "pp"}
ROLE_KEYS = {f"{r}_{f}" for r in ROLES for f in ROLE_FIELDS}
# A single-fleet axis that, here, means one axis per role.
_PER_ROLE = {GPU: "gpu", PLAN_SHORTHANDS["tp"]: "tp", PLAN_SHORTHANDS["pp"]: "pp"}


class DisaggPlanner(Planner):
    """The search of the module doc over ``base`` (a disaggregated scenario mapping);
    the rest as ``Planner`` (``slos``, ``seeds``, ``executor``, ``workers``, ``gpus``,
    ``prices``); ``total``: search every split of that many replicas."""

    def __init__(self, base: dict, base_dir: Path, slos: list, axes: list, *,
                 total: Optional[int] = None, seeds: int = 1, executor: str = "local",
                 workers: Optional[int] = None, gpus: Optional[list] = None,
                 prices=None) -> None:
        from simulator.planning.executors import make_executor
        from simulator.planning.planner import plan_axes
        self.base_dir = Path(base_dir)
        self.roles = _role_pools(base)
        self.base, self.transfer, axes = plan_axes(base, axes, gpus, self.base_dir)
        if any(resolve_key(self.base, a.key) == REPLICAS for a in axes):
            raise LatsimError("a disaggregated cluster has a count per role: search "
                              "prefill_replicas= and decode_replicas=, or --disaggregate N",
                              source="--search")
        axes = [Axis(f"{r}_{_PER_ROLE[a.key]}", a.values) for a in axes for r in ROLES
                if a.key in _PER_ROLE] + [a for a in axes if a.key not in _PER_ROLE]
        split = [a for a in axes if a.key in ("prefill_replicas", "decode_replicas")]
        if total is not None:
            if split:
                raise LatsimError("give the split once: --disaggregate N, or "
                                  "prefill_replicas= and decode_replicas=", source="--search")
            if total < 2:
                raise LatsimError("a split needs at least 2 replicas (one of each role)",
                                  source="--disaggregate", value=total, has_value=True)
        for a in axes:
            if a.key.endswith("_replicas") and any(
                    not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in a.values):
                raise LatsimError("replicas must be whole numbers >= 1", source="--search",
                                  value=f"{a.key}={list(a.values)[:5]}", has_value=True)
        # A ``policies:`` list is an ``engine.policy`` axis whose values name its entries,
        # as for ``Planner``; an entry whose cluster is not a split is skipped, with why.
        self.policy_runs = None
        if self.base.get("policies") and not any(
                resolve_key(self.base, a.key) == "engine.policy" for a in axes):
            axis, self.policy_runs = policy_axis(self.base)
            axes.append(axis)
        self.base.pop("policies", None)
        self.slos, self.seeds, self.prices = slos, seeds, prices
        if isinstance(prices, dict):
            # A type searched must have its price (the scenario's prices are for the
            # GPUs it names); the other pools are priced as ``latsim run`` prices them.
            named = {v for a in axes if a.key.endswith("_gpu") for v in a.values}
            missing = sorted(named - set(prices))
            if missing:
                raise LatsimError("a price per GPU type needs a price for each type "
                                  f"searched; missing: {', '.join(missing)}",
                                  source="--cost-per-gpu-hour")
        self.replicas = [1]          # no replica count is bisected here
        self.seed0 = int(self.base.get("seed", 0) or 0)
        self.cache: dict = {}
        self._profiles: dict = {}
        self.runs = 0
        self.skipped: list = []
        splits = ([{"prefill_replicas": p, "decode_replicas": total - p}
                   for p in range(1, total)] if total is not None else [{}])
        self._keep_runnable(dict(s, **o) for s in splits for o in expand(axes))
        self.executor = make_executor(executor, workers)

    def _point(self, params: dict) -> dict:
        """The scenario mapping of one point: role keys set on their pool."""
        rest = {k: v for k, v in params.items() if k not in ROLE_KEYS}
        data = point_scenario(self.base, rest, self.policy_runs)
        roles = _role_pools(data)
        pools = data["cluster"]["pools"]
        model_cost = (data.get("model") or {}).get("cost") or {}
        for key, value in params.items():
            if key not in ROLE_KEYS:
                continue
            role, field = key.split("_", 1)
            pool = pools[roles[role]]
            if field == "replicas":
                pool["replicas"] = value
                continue
            cost = dict(pool.get("cost") or model_cost)
            if field not in kind_fact(cost.get("kind"), "hardware_fields", ()):
                raise LatsimError(f"a GPU or parallelism axis per role needs a roofline cost "
                                  f"model (pool {pool['name']!r} has {cost.get('kind')!r}); "
                                  "give --gpus to estimate one", source="--search")
            cost[field] = value
            pool["cost"] = cost
        data["cluster"].pop("replicas", None)
        return data

    def _size(self, sc, params: dict) -> tuple[int, float]:
        """GPUs of a point and its $ per hour: its pools' sums, each pool priced by
        ``cluster.pools.gpu_hour_price`` as ``latsim run`` prices it, the plan's prices
        (``--cost-per-gpu-hour``) its GPU type's first and its last resort. NaN without
        a price for some pool and no plan prices (points compared by GPUs); a one-line
        error naming ``--cost-per-gpu-hour`` when plan prices leave a pool unpriced."""
        from simulator.cluster.pools import gpu_hour_price, plan_pools
        by_name = {p.name: p for p in sc.cluster.pools}
        gpus, cost = 0, 0.0
        for p in plan_pools(sc):
            n = p.replicas * p.gpus
            gpus += n
            price = gpu_hour_price(p.gpu, by_name[p.name].gpu_cost_per_hour,
                                   sc.cluster.gpu_cost_per_hour, self.prices)
            if price is None and self.prices is not None:
                raise LatsimError(f"no price for pool {p.name!r}'s GPU type {p.gpu!r} (nor "
                                  "gpu_cost_per_hour on the pool or cluster); add "
                                  f"{p.gpu}=<price>", source="--cost-per-gpu-hour",
                                  value=describe(params), has_value=True)
            cost += n * (math.nan if price is None else price)
        return gpus, cost

    def _cannot_run(self, combo: dict) -> Optional[str]:
        """Why a point cannot run (a pool's roofline cannot be split or does not fit its
        GPU), or None; other errors in a point are the user's: raised."""
        from simulator.cluster.pools import plan_pools
        run = combo.get("engine.policy")
        try:
            data = self._point(combo)
        except LatsimError:
            if self.policy_runs and isinstance(self.policy_runs.get(run), dict) and (
                    "cluster" in self.policy_runs[run]):
                return f"policies entry {run!r} has no prefill:decode split to search"
            raise
        try:
            sc = validate_scenario(data, source=f"search point {describe(combo)}",
                                   base_dir=self.base_dir)
            plan_pools(sc)
        except LatsimError as e:
            text = str(e)
            if "cluster.pools" in text and ("pool '" in text or ".cost" in text):
                return text.split(": ", 1)[-1]
            raise
        self._size(sc, combo)        # every pool priced, before any run
        return None

    def search(self) -> Plan:
        """Every point, once; the cheapest feasible one."""
        evs = self.evaluate([(c, 1.0) for c in self.combos])
        feas = sorted((ev for ev in evs if ev.feasible),
                      key=lambda e: (e.cost_per_hour if e.cost_per_hour == e.cost_per_hour
                                     else e.gpus, e.gpus, e.slack))
        plan = Plan(self.slos, feas[0] if feas else None, feas[1:],
                    list(zip(self.combos, evs)), None, None, "", space=len(self.combos),
                    skipped=list(self.skipped), transfer=self.transfer)
        if plan.chosen is None:
            _bind(plan, self)
        else:
            tight = max(self.slos, key=lambda s: s.ratio(plan.chosen.value(s)), default=None)
            cheaper = [ev for ev in evs if not ev.feasible and _cheaper(ev, plan.chosen)]
            plan.binding = tight.text if tight else None
            plan.binding_detail = (f"the cheapest split meeting every SLO; tightest: "
                                   f"{tight.text if tight else '-'}" +
                                   (f"; {len(cheaper)} cheaper point(s) missed"
                                    if cheaper else ""))
        plan.runs = self.runs
        return plan


def _cheaper(a, b) -> bool:
    if a.cost_per_hour == a.cost_per_hour and b.cost_per_hour == b.cost_per_hour:
        return a.cost_per_hour < b.cost_per_hour
    return a.gpus < b.gpus


def _role_pools(base: dict) -> dict:
    """``{role: index of its pool}``: exactly one prefill and one decode pool."""
    pools = (base.get("cluster") or {}).get("pools") or []
    out = {}
    for role in ROLES:
        idx = [i for i, p in enumerate(pools) if p.get("role") == role]
        if len(idx) != 1:
            raise LatsimError(f"plan searches a split of one prefill pool and one decode pool; "
                              f"the scenario has {len(idx)} {role} pool(s)",
                              source="cluster.pools")
        out[role] = idx[0]
    return out


def is_disaggregated(base: dict) -> bool:
    """Whether a scenario mapping's cluster has pools with roles."""
    pools = (base.get("cluster") or {}).get("pools") or []
    return any(isinstance(p, dict) and p.get("role", "mixed") != "mixed" for p in pools)
