"""``latsim sweep`` and ``latsim plan``: typer command functions, their console report and
the planner's latency-vs-load plot. The commands raise ``LatsimError`` for user errors
(the CLI prints them on one line and exits 2).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from simulator.errors import LatsimError
from simulator.report.tables import fmt

console = Console()


def _base(scenario: Path, set_: Optional[List[str]]) -> tuple[dict, Path]:
    """The scenario file as a mapping with ``--set`` applied, validated once, and its folder."""
    from simulator.config.scenario import read_yaml, validate_scenario
    from simulator.config.yamlfile import apply_overrides
    data = read_yaml(scenario)
    if not isinstance(data, dict):
        raise LatsimError("a scenario must be a YAML mapping", source=str(scenario))
    data = apply_overrides(data, set_, source=str(scenario))
    base_dir = Path(scenario).resolve().parent
    validate_scenario(data, source=str(scenario), base_dir=base_dir)
    return data, base_dir


def sweep(
    scenario: Path = typer.Argument(..., help="scenario YAML"),
    grid: Optional[List[str]] = typer.Option(
        None, "--grid", help="key=v1,v2,... or key=start:stop[:step] (repeat per axis)"),
    out: Path = typer.Option(..., "--out", help="folder for results.csv and results.parquet"),
    seeds: int = typer.Option(1, "--seeds", help="seeds per point: scenario seed, +1, ..."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="override: a.b=value"),
    executor: str = typer.Option("local", "--executor", help="local | ray (honours RAY_ADDRESS)"),
    address: Optional[str] = typer.Option(None, "--address", help="with --executor ray: a "
                                          "running Ray cluster (host:port; default: "
                                          "RAY_ADDRESS, else a local Ray started here)"),
    workers: Optional[int] = typer.Option(None, "--workers", min=1,
                                          help="processes (default and at most: the cores)"),
    resume: bool = typer.Option(False, "--resume", help="skip points already in results.csv"),
    force: bool = typer.Option(False, "--force", help="discard existing results and start again"),
    limit: Optional[int] = typer.Option(None, "--limit", min=1,
                                        help="stop after N points (--resume later)"),
) -> None:
    """Run every point of a parameter grid and write one tidy table (CSV + parquet)."""
    from simulator.planning.sweep import parse_axis, run_sweep
    from simulator.report.files import check_out_dir
    check_out_dir(out, keep=True)      # a sweep resumes into its folder
    base, base_dir = _base(scenario, set_)
    axes = [parse_axis(g) for g in grid or []]
    from simulator.cli.run import announce_cold_cache, err_console
    try:
        res = run_sweep(base, base_dir, axes, out, seeds=seeds, executor=executor,
                        workers=workers, resume=resume, force=force, limit=limit, console=console,
                        address=address, on_start=lambda n: announce_cold_cache(err_console, n))
    except KeyboardInterrupt:
        from simulator.cli.common import on_interrupt
        kept = Path(out) / "results.csv"
        on_interrupt(f"the finished points are kept in {kept}: rerun with --resume to "
                     "continue" if kept.exists() else f"nothing written to {out}")
        raise typer.Exit(130)
    df = res.table
    rate = f", {res.ran / res.wall_s * 60:,.1f} points/min" if res.ran and res.wall_s else ""
    console.print(f"ran {res.ran} point(s) in {res.wall_s:.1f} s{rate}; {res.skipped} already "
                  f"done; table: {len(df)} rows x {len(df.columns)} columns -> {res.path}")
    if res.errors:
        console.print(f"[yellow]warning[/]: {res.errors} point(s) failed; see the error column")
    if 0 < len(df) <= 40:
        cols = list(df.columns)
        keys = cols[cols.index("point") + 1:cols.index("seed")] if "seed" in cols else []
        labels = {"p99_ttft_ms": "P99 TTFT ms", "p99_tpot_ms": "P99 TPOT ms",
                  "p99_e2el_ms": "P99 E2EL ms", "request_goodput": "goodput/s",
                  "diagnosis": "diagnosis", "error": "error"}
        show = [c for c in (*keys, "seed", *labels) if c in cols]
        t = Table(title_justify="left")
        cells = [[_fmt(v) for v in r] for _, r in df[show].iterrows()]
        for j, c in enumerate(show):
            text = c in keys or c in ("diagnosis", "error")
            # A cell (a number, a word) is never split across lines: the column is at
            # least as wide as its widest one; headers and error texts wrap at spaces.
            widest = max((len(w) for row in cells for w in
                          (row[j].split() if c == "error" else [row[j]])), default=1)
            t.add_column(labels.get(c, c), overflow="fold", min_width=min(widest, 30),
                         justify="left" if text else "right")
        for row in cells:
            t.add_row(*row)
        console.print(t)


def parse_prices(text: str):
    """``--cost-per-gpu-hour``: one price (``3.5``) or one per GPU type
    (``h100-80gb=3.9,a100-80gb=2.2``; catalogue names or aliases)."""
    from simulator.cost import catalog
    text = (text or "").strip()
    try:
        v = float(text)
    except ValueError:
        pass
    else:
        if not (v > 0 and math.isfinite(v)):
            raise LatsimError("must be a finite price > 0", source="--cost-per-gpu-hour",
                              value=v, has_value=True)
        return v
    out = {}
    for item in text.split(","):
        name, eq, price = item.partition("=")
        try:
            p = float(price)
        except ValueError:
            p = math.nan
        if not eq or not name.strip() or not (p > 0 and math.isfinite(p)):
            raise LatsimError("must be a price, or gpu=price,... (e.g. h100-80gb=3.9,l40s=1.1)",
                              source="--cost-per-gpu-hour", value=item, has_value=True)
        try:
            out[catalog.gpu(name.strip()).name] = p
        except LatsimError as e:
            raise LatsimError(str(e).split(": ", 1)[-1], source="--cost-per-gpu-hour") from None
    return out


def plan(
    scenario: Path = typer.Argument(..., help="scenario YAML"),
    slo: Optional[List[str]] = typer.Option(
        None, "--slo", help="[class:]metric<=bound, e.g. p0:p99_ttft_ms<=500 (default: the "
        "classes' own SLOs as P99 bounds)"),
    cost_per_gpu_hour: str = typer.Option(..., "--cost-per-gpu-hour", help="$ per GPU-hour, or "
                                          "one per GPU type: h100-80gb=3.9,a100-80gb=2.2"),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="GPU types to search (roofline "
                                       "step costs per type), e.g. h100-80gb,a100-80gb,l40s"),
    search: Optional[List[str]] = typer.Option(
        None, "--search", help="axis as in sweep --grid (also tp=, pp=, gpu=); replicas "
        "defaults to 1:64"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="override: a.b=value"),
    seeds: int = typer.Option(1, "--seeds", help="every seed must meet the SLOs"),
    executor: str = typer.Option("local", "--executor", help="local | ray (honours RAY_ADDRESS)"),
    workers: Optional[int] = typer.Option(None, "--workers", min=1,
                                          help="processes (default and at most: the cores)"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for plan.json, evaluations.csv"
                                       " and load_curve.png (default: results/plan-<name>)"),
    force: bool = typer.Option(False, "--force", help="--out may hold an earlier plan: it is "
                               "replaced"),
    headroom: bool = typer.Option(True, "--headroom/--no-headroom", help="find the max rate"),
    tol: float = typer.Option(0.05, "--headroom-tol", min=1e-4, max=1.0,
                              help="relative precision of the headroom"),
    runner_ups: int = typer.Option(3, "--runner-ups", min=0, help="how many runner-ups to show"),
    disaggregate: Optional[int] = typer.Option(
        None, "--disaggregate", help="a scenario with prefill and decode pools: try every "
        "prefill:decode split of this many replicas (or --search prefill_replicas=..., "
        "decode_replicas=...)"),
) -> None:
    """Find the cheapest configuration that meets every SLO for the scenario's traffic.

    Exit 0 with the choice; exit 1 when no configuration in the search space meets
    them (the report says which SLO binds and what each one missed)."""
    from simulator.config.scenario import validate_scenario
    from simulator.planning.planner import Planner
    from simulator.planning.slo import class_names_of, default_slos, parse_slo
    from simulator.planning.sweep import parse_axis
    from simulator.report.files import check_out_dir
    prices = parse_prices(cost_per_gpu_hour)
    if not math.isfinite(tol):
        raise LatsimError("must be a number in [0.0001, 1]", source="--headroom-tol", value=tol,
                          has_value=True)
    if seeds < 1:
        raise LatsimError("must be at least 1", source="--seeds", value=seeds, has_value=True)
    gpu_list = [g.strip() for g in gpus.split(",") if g.strip()] if gpus is not None else None
    if gpus is not None and not gpu_list:
        raise LatsimError("name at least one GPU type", source="--gpus", value=gpus, has_value=True)
    base, base_dir = _base(scenario, set_)
    sc = validate_scenario(base, source=str(scenario), base_dir=base_dir)
    # The default folder is named after the scenario, as a file name: a name with path
    # separators ('../x') must not write elsewhere.
    out = out or Path("results") / ("plan-" + re.sub(r"[^\w.-]+", "_", sc.name).strip("."))
    check_out_dir(out, force=force)
    from simulator.cli.common import on_interrupt
    on_interrupt(f"nothing written to {out}")    # the plan is staged, then moved at once
    slos = ([parse_slo(s, class_names_of(sc)) for s in slo] if slo else default_slos(sc))
    if not slos:
        raise LatsimError("no SLO: give --slo or SLOs on the workload's classes", source="--slo")
    axes = [parse_axis(s, source="--search") for s in search or []]
    if gpu_list:
        gpu_list = [_gpu_name(g) for g in gpu_list]
    if sc.cluster.disaggregated:
        # Prefill and decode pools: every split searched (``planning.disagg``).
        from simulator.planning.disagg import DisaggPlanner
        pl = DisaggPlanner(base, base_dir, slos, axes, total=disaggregate, seeds=seeds,
                           executor=executor, workers=workers, gpus=gpu_list, prices=prices)
    elif disaggregate is not None:
        raise LatsimError("needs a scenario with a prefill pool and a decode pool "
                          "(cluster.pools[].role)", source="--disaggregate",
                          value=disaggregate, has_value=True)
    else:
        pl = Planner(base, base_dir, slos, axes, seeds=seeds, executor=executor,
                     workers=workers, gpus=gpu_list, prices=prices)
    try:
        for combo, why in pl.skipped:
            console.print(f"[yellow]skipped[/] {_params_text(combo)}: {why}", highlight=False)
        if not pl.combos:
            raise LatsimError("no configuration in the search space can run (see the skipped "
                              "lines above)", source=str(scenario))
        from simulator.cli.run import announce_cold_cache, err_console
        expected = getattr(sc.workload, "expected_requests", None)
        announce_cold_cache(err_console, expected() if expected is not None else None)
        watch = plan_progress(pl)
        try:
            result = pl.search()
            if result.chosen is not None and headroom:
                pl.headroom(result, tol=tol)
        finally:
            watch.close()
    finally:
        pl.close()
    from simulator.report.files import StagedDir
    with StagedDir(out, PLAN_OUTPUTS) as staged:    # no half-written plan/, ever
        write_plan(staged.path, result, prices)
    files = staged.files
    on_interrupt(f"the plan is written to {out}")
    print_plan(console, result, prices, runner_ups, len(pl.combos), len(pl.replicas))
    console.print(f"wrote {', '.join(str(f) for f in files)}")
    if result.chosen is None:
        raise typer.Exit(1)


def plan_progress(pl, out: Optional[Console] = None):
    """``run``'s progress watcher (``cli.run.RunProgress``) counting the plan's simulated
    runs, on stderr: after two seconds a counter on a terminal, a line every ten seconds
    otherwise. The total is not known ahead (the searches stop where they find)."""
    from simulator.cli.run import RunProgress, err_console
    watch = RunProgress("plan", None, out or err_console, count=lambda: pl.settled,
                        unit="runs", verb="simulated")
    watch("plan", None)
    return watch


def _gpu_name(name: str) -> str:
    """A GPU type's catalogue name (one-line error naming ``--gpus`` otherwise)."""
    from simulator.cost import catalog
    try:
        return catalog.gpu(name).name
    except LatsimError as e:
        raise LatsimError(str(e).split(": ", 1)[-1], source="--gpus") from None


def _params_text(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "(base scenario)"


def _fmt(v) -> str:
    return fmt(v, ".3g")


def config_text(ev) -> str:
    """``replicas=N, key=value, ...`` for one configuration."""
    from simulator.planning.planner import REPLICAS
    rest = {k: v for k, v in ev.params.items() if k != REPLICAS}
    head = [f"replicas={ev.params[REPLICAS]}"] if REPLICAS in ev.params else []
    return ", ".join(head + [f"{k}={v}" for k, v in rest.items()]) or "(base scenario)"


def _costs(ev, per_gpu_hour) -> tuple[float, float]:
    """$ per hour and per million output tokens of a configuration."""
    if ev.cost_per_hour == ev.cost_per_hour:
        per_hour = ev.cost_per_hour
    else:
        from simulator.planning.planner import price_of
        per_hour = ev.gpus * price_of(per_gpu_hour, ev.params)
    tok = ev.mean("output_throughput")
    return per_hour, (per_hour / (tok * 3600) * 1e6 if tok and tok == tok else math.nan)


def print_plan(con: Console, plan, per_gpu_hour, n_runner_ups: int, combos: int,
               sizes: int) -> None:
    """The planner's answer as a person reads it."""
    shape = f" ({combos} combination(s) x {sizes} replica counts)" if sizes > 1 else ""
    con.print(f"search space: {combos * sizes} configurations{shape}; simulated {plan.runs} run(s)"
              + (f"; {len(plan.skipped)} combination(s) skipped (cannot run)"
                 if plan.skipped else ""))
    if plan.transfer:
        con.print(f"step costs: {plan.transfer}", style="yellow", highlight=False)
    ch = plan.chosen
    if ch is None:
        con.print("[bold red]No configuration in the search space meets the SLOs.[/]")
        con.print(f"binding SLO: [bold]{plan.binding}[/] ({plan.binding_detail})")
        t = Table(title="Each combination at its largest size" if sizes > 1 else
                  "Each configuration", title_justify="left")
        for c in ("configuration", "missed (worst value)"):
            t.add_column(c, overflow="fold")
        for _, ev in plan.best_per_combo:
            t.add_row(config_text(ev), _misses(ev, plan.slos))
        con.print(t)
        return
    per_hour, per_mtok = _costs(ch, per_gpu_hour)
    con.print(f"[bold green]chosen[/]: {config_text(ch)}: {ch.gpus} GPU(s), "
              f"${per_hour:,.2f}/hour, ${per_mtok:,.3f} per million output tokens "
              f"(at {rate_text(ch)})")
    t = Table(title="SLOs", title_justify="left")
    for c in ("SLO", "predicted", "bound", "unit", "used"):
        t.add_column(c, justify="left" if c in ("SLO", "unit") else "right")
    for s in plan.slos:
        t.add_row(s.text, _fmt(ch.value(s)), _fmt(s.bound), s.unit,
                  f"{s.ratio(ch.value(s)):.0%}")
    con.print(t)
    con.print(class_table(ch))
    if plan.headroom is not None:
        rate = plan.headroom * ch.mean("offered_rate")
        top = [e for e in plan.curve if abs(e.mult - plan.headroom) < 1e-12]
        extra = ""
        if top:
            ph, pm = _costs(top[0], per_gpu_hour)
            extra = f"; ${pm:,.3f} per million output tokens there"
        cap = "at least " if plan.headroom_capped else ""
        asked = plan.headroom * ch.asked_rate
        said = (f"{asked:.3g} req/s asked, {rate:.3g} realised" if asked == asked else
                f"{rate:.3g} req/s")
        con.print(f"headroom: sustains {cap}{plan.headroom:.2f}x the scenario's rate "
                  f"({said}) within the SLOs{extra}" +
                  (f"; above it {plan.binding} is missed first"
                   if plan.headroom_binding else ""))
    con.print(f"binding SLO: [bold]{plan.binding or '-'}[/] ({plan.binding_detail})")
    if plan.runner_ups and n_runner_ups:
        t = Table(title="Runner-ups", title_justify="left")
        for c in ("configuration", "GPUs", "$/hour", "$/M output tokens", "tightest SLO used"):
            t.add_column(c, justify="left" if c == "configuration" else "right",
                         overflow="fold")
        for ev in plan.runner_ups[:n_runner_ups]:
            ph, pm = _costs(ev, per_gpu_hour)
            t.add_row(config_text(ev), str(ev.gpus), f"{ph:,.2f}", f"{pm:,.3f}", f"{ev.slack:.0%}")
        con.print(t)
    bad = [ev for _, ev in plan.best_per_combo if not ev.feasible]
    for ev in bad:
        where = " even at its largest size" if sizes > 1 else ""
        con.print(f"[dim]infeasible{where}: {config_text(ev)}: " + _misses(ev, plan.slos)
                  + "[/]")


def _misses(ev, slos) -> str:
    """``slo (value unit); ...`` for what a configuration missed."""
    from simulator.planning.planner import value_text
    return "; ".join(f"{t} ({value_text(t, v, slos)})" for t, v in ev.violations)


def rate_text(ev) -> str:
    """The arrival rate of a configuration's runs: the one asked for and the one its
    sampled arrivals realise (they differ by sampling noise: 1,000 Poisson arrivals at
    10 req/s span 100 s +- 3%)."""
    real = ev.mean("offered_rate")
    if ev.asked_rate == ev.asked_rate:
        return f"{ev.asked_rate:.3g} req/s asked, {real:.3g} req/s realised by the arrivals"
    return f"{real:.3g} req/s"


def class_table(ev) -> Table:
    """Predicted P50/P99 of TTFT, TPOT and E2EL per class (ms)."""
    row = ev.rows[0]
    classes = sorted({k.split(":", 1)[0] for k in row if ":" in k}) or [None]
    t = Table(title="Predicted latency (ms)" + (" , seed-averaged" if len(ev.rows) > 1 else ""),
              title_justify="left")
    t.add_column("class")
    cols = [(m, p) for m in ("ttft", "tpot", "e2el") for p in ("median", "p99")]
    for m, p in cols:
        t.add_column(f"{m.upper()} {'P50' if p == 'median' else 'P99'}", justify="right")
    for c in classes:
        pre = f"{c}:" if c else ""
        t.add_row(c or "all", *[_fmt(ev.mean(f"{pre}{p}_{m}_ms")) for m, p in cols])
    return t


PLAN_OUTPUTS = ("plan.json", "evaluations.csv", "load_curve.png")   # what a plan writes


def write_plan(out: Path, plan, per_gpu_hour) -> list[Path]:
    """plan.json, evaluations.csv (every run) and load_curve.png (when there is a choice),
    into ``out`` (the command stages them: ``report.files.StagedDir``)."""
    import pandas as pd
    out.mkdir(parents=True, exist_ok=True)

    def summary(ev):
        """One configuration as JSON: parameters, GPUs, costs, SLO values, misses."""
        if ev is None:
            return None
        ph, pm = _costs(ev, per_gpu_hour)
        return {"config": ev.params, "gpus": ev.gpus, "cost_per_hour": ph,
                "cost_per_million_output_tokens": pm,
                "slos": {s.text: ev.value(s) for s in plan.slos},
                "violations": dict(ev.violations)}
    doc = {"chosen": summary(plan.chosen), "runner_ups": [summary(e) for e in plan.runner_ups],
           "binding_slo": plan.binding, "binding_detail": plan.binding_detail,
           "headroom_multiplier": plan.headroom, "headroom_capped": plan.headroom_capped,
           "runs": plan.runs, "cost_per_gpu_hour": per_gpu_hour,
           "skipped": [{"config": c, "reason": r} for c, r in plan.skipped],
           "step_costs": plan.transfer}
    files = [out / "plan.json"]
    files[0].write_text(json.dumps(doc, indent=2, default=str,
                                   allow_nan=True).replace("NaN", "null") + "\n")
    pd.DataFrame(evaluation_rows(plan, per_gpu_hour)).to_csv(out / "evaluations.csv",
                                                            index=False)
    files.append(out / "evaluations.csv")
    if plan.chosen is not None and len(plan.curve) >= 2:
        files.append(plot_curve(plan, out / "load_curve.png"))
    return files


def binding_slo(plan):
    """The SLO the plot marks as binding and puts the knee on: the plan's (planner module
    doc: the one missed first as the load grows), the one report line and plot share."""
    return next((s for s in plan.slos if s.text == plan.binding),
                max(plan.slos, key=lambda s: s.ratio(plan.curve[-1].value(s))))


def evaluation_rows(plan, per_gpu_hour) -> list[dict]:
    """evaluations.csv: one row per simulated run (a configuration at a rate multiplier,
    one seed), in the order they ran: its parameters, seed, the rate asked and realised,
    GPUs and $/hour, each SLO's value in that run, whether the configuration met every
    SLO over all its seeds (``feasible``) and what it was to the plan (``role``)."""
    role = {}
    for ev in plan.runner_ups:
        role[id(ev)] = "runner-up"
    if plan.below is not None:
        role[id(plan.below)] = "next smaller size"
    if plan.chosen is not None:
        role[id(plan.chosen)] = "chosen"
    for ev in plan.curve:
        role.setdefault(id(ev), "load curve of the choice")
    recs = []
    for ev in plan.evaluations or [ev for _, ev in plan.best_per_combo]:
        for j, row in enumerate(ev.rows):
            row = row or {}
            recs.append({**ev.params, "rate_multiplier": ev.mult,
                         "seed": row.get("seed", math.nan), "asked_rate": ev.asked_rate,
                         "offered_rate": row.get("offered_rate", math.nan), "gpus": ev.gpus,
                         "cost_per_hour": _costs(ev, per_gpu_hour)[0],
                         "feasible": ev.feasible,
                         "role": role.get(id(ev), "search" if ev.mult == 1.0 else "headroom"),
                         **{s.text: float(row.get(s.column, math.nan)) for s in plan.slos},
                         "error": row.get("error", "")})
    return recs


def plot_curve(plan, path: Path) -> Path:
    """Each SLO's metric against offered load for the chosen configuration: SLO lines,
    the scenario's load, the headroom, and the knee (on the binding metric) marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from simulator.planning.planner import knee
    ch, curve, slos = plan.chosen, plan.curve, plan.slos
    base = ch.mean("offered_rate")
    xs = [e.mult * base for e in curve]
    bind = binding_slo(plan)
    ki = knee(xs, [e.value(bind) for e in curve])
    ncol = min(len(slos), 2)
    nrow = -(-len(slos) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.2 * ncol, 4.2 * nrow), squeeze=False)
    for ax, s in zip(axes.flat, slos):
        ys = [e.value(s) for e in curve]
        ok = [s.ok(y) for y in ys]
        ax.plot(xs, ys, "-", color="tab:blue", lw=1.5)
        ax.scatter(xs, ys, c=["tab:blue" if o else "tab:red" for o in ok], zorder=3, s=22)
        ax.axhline(s.bound, color="tab:red", ls="--", lw=1.2, label=f"SLO {s.bound:g}")
        ax.axvline(base, color="grey", ls=":", lw=1.2, label=f"scenario {base:.3g} req/s")
        if plan.headroom is not None:
            ax.axvline(plan.headroom * base, color="tab:green", ls="-.", lw=1.2,
                       label=f"headroom {plan.headroom * base:.3g} req/s")
        if ki is not None and ys[ki] == ys[ki]:
            ax.plot([xs[ki]], [ys[ki]], "o", ms=12, mfc="none", mec="black", mew=2,
                    label=f"knee {xs[ki]:.3g} req/s", zorder=4)
        pos = [y for y in ys if y == y and y > 0]
        if pos and max(pos) > 30 * min(pos):
            ax.set_yscale("log")
        ax.set_title(s.text + (" (binding)" if s is bind else ""), fontsize=10)
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel(s.metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(slos):]:
        ax.set_visible(False)
    fig.suptitle(f"latency vs load: {config_text(ch)}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
