"""``latsim fit`` and ``latsim calibrate``, and the ``--run`` mode of ``latsim validate``:
the fidelity commands that need no engine.

- ``fit PROFILE``: the physics step-cost model fitted to a profile's rows, its
  coefficients with their physical meaning and the leave-one-out error per row kind;
  ``--write`` stores the fit in the profile's ``meta.fit`` (reused while the rows hash
  the same).
- ``calibrate SCENARIO --run DIR``: engine facts and engine-specific coefficients
  measured on a recorded serving run (``simulator.cost.calibration``), real vs
  simulated latency before and after, and the calibrated profile (``--out``).
- ``validate --run DIR SCENARIO`` (``validate_run``, called by ``simulator.cli.engine``):
  real vs simulated for a recorded run and where the error comes from.

Command functions only; ``simulator.cli.main`` registers them. Exit codes: 0 done; 1 it
ran but did not do what was asked (the calibration made the model's step times worse
on its run, the replay could not follow the run, or no simulated number could be
compared); 2 bad input, one ``latsim: error:`` line before any work.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from simulator.errors import LatsimError

console = Console()
err_console = Console(stderr=True)


class NotMet(LatsimError):
    """The command ran but did not do what was asked (exit 1)."""

    exit_code = 1


def one_line_errors(f):
    """Run command ``f``; a ``LatsimError`` becomes one ``latsim: error:`` line on stderr
    and its exit code (also under a test runner that calls the app directly)."""
    import functools

    @functools.wraps(f)
    def run(*a, **kw):
        try:
            return f(*a, **kw)
        except LatsimError as e:
            err_console.print(f"latsim: error: {e}", markup=False, highlight=False,
                              soft_wrap=True)
            raise typer.Exit(e.exit_code) from None

    return run


def _pct(v) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v * 100:+.1f}%"


def _num(v, d: int = 2) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:,.{d}f}"


# -- latsim fit ----------------------------------------------------------------------------

def _read_profile(path: Path) -> tuple[dict, dict]:
    """The profile as checked by ``load_profile`` and as written (to write back)."""
    from simulator.cost.profile import load_profile
    if not path.exists():
        raise LatsimError("file not found", source=str(path), field="PROFILE")
    prof = load_profile(path)
    raw = json.loads(path.read_text())
    return prof, raw


def fit_lines(res, prof: dict) -> list[str]:
    """The fit as a person reads it: coefficients with their meaning and achieved
    rates, what fell back and why."""
    from simulator.cost import physics as ph
    from simulator.cost.fitstore import MEANINGS, physical_rates
    c = res.c
    r = physical_rates(c)
    lines = [f"fit source: {res.source}", f"hardware: {res.hardware}"]
    for name, v in res.coefficients().items():
        flag = "fitted" if name in res.free else "fixed"
        lines.append(f"  {name:16s} {v:12.5g}  {flag:6s}  {MEANINGS.get(name, '')}")
    lines.append(f"  {'decode_blocks_per_sm':16s} {c[ph.C_DEC_BLOCKS_PER_SM]:12.5g}  "
                 f"{'':6s}  {MEANINGS['decode_blocks_per_sm']}")
    lines.append(f"  {'decode_wave_cost':16s} {c[ph.C_WAVE_COST]:12.5g}  "
                 f"{'':6s}  {MEANINGS['decode_wave_cost']}")
    lines.append(f"achieved: GEMMs {r['gemm_tflops']:.0f} TFLOP/s, weights {r['weights_gbs']:.0f}"
                 f" GB/s, flash prefill attention {r['flash_tflops']:.0f} TFLOP/s, masked "
                 f"{r['masked_tflops']:.0f} TFLOP/s, decode attention "
                 f"{r['decode_attention_gbs']:.0f} GB/s (peaks {r['peak_tflops']:.0f} TFLOP/s, "
                 f"{r['hbm_gbs']:.0f} GB/s)")
    eng = prof.get("engine") or {}
    lines.append(f"engine facts: bookkeeping {float(eng.get('bookkeeping_ms') or 0):.5f} ms + "
                 f"{float(eng.get('bookkeeping_seq_ms') or 0):.5f} ms per sequence, step tail "
                 f"{float(eng.get('step_tail') or 1):.4f}")
    for k, v in res.fallbacks.items():
        lines.append(f"fallback {k}: {v}")
    return lines


def error_rows(res) -> list[tuple]:
    """``(kind, n, median, p90, max, capped median, repeat spread)`` per row kind: the
    leave-one-out relative error; its median against each row capped by the rows that
    hold more work (more work never costs less: a row slower than one with more work
    is noise no monotone model follows); and the median of the rows' own repeat spread,
    ``(p90 - p10) / 2`` over their median, the noise a prediction cannot beat."""
    import numpy as np
    out = []
    rows = res.rows
    spread = (rows.p90 - rows.p10) / (2.0 * rows.ms)
    for kind, e in res.errors.items():
        cv = e.get("cv") or {}
        if cv.get("n"):
            capped = (e.get("cv_capped") or {}).get("median", float("nan"))
            sp = float(np.median(spread[rows.kind == kind]))
            out.append((kind, cv["n"], cv["median"], cv["p90"], cv["max"], capped, sp))
    return out


@one_line_errors
def fit(
    profile: Path = typer.Argument(..., help="profile JSON (latsim-profile/1)"),
    as_json: bool = typer.Option(False, "--json", help="print the fit as JSON"),
    write: bool = typer.Option(False, "--write", help="store the fit in the profile's meta.fit"),
) -> None:
    """Fit the physics step-cost model to a profile: coefficients and their meaning, and
    the cross-validated (leave-one-out) relative error per row kind."""
    from simulator.cost.fit import fit as fit_profile
    from simulator.cost.fitstore import fit_to_dict, physical_rates
    from simulator.report.files import json_safe
    prof, raw = _read_profile(profile)
    res = fit_profile(prof, cv=True)
    d = fit_to_dict(res, prof, source="latsim fit")
    if as_json:
        out = {k: v for k, v in d.items() if k not in ("cv_residuals", "cv_capped")}
        out["achieved"] = physical_rates(res.c)
        out["cv_error"] = {k: {"n": n, "median": m, "p90": p, "max": x, "capped_median": cm,
                               "repeat_spread_median": sp}
                           for k, n, m, p, x, cm, sp in error_rows(res)}
        typer.echo(json.dumps(json_safe(out), indent=1))
    else:
        for line in fit_lines(res, prof):
            console.print(line, markup=False, highlight=False)
        t = Table(title="Leave-one-out relative error per row kind", title_justify="left")
        for col in ("rows", "n", "median", "p90", "max", "capped median", "repeat spread"):
            t.add_column(col, justify="left" if col == "rows" else "right")
        for kind, n, m, p, x, cm, sp in error_rows(res):
            t.add_row(kind, str(n), f"{m:.2%}", f"{p:.2%}", f"{x:.2%}", f"{cm:.2%}", f"{sp:.2%}")
        console.print(t)
        console.print("capped median: against each row capped by the rows holding more work; "
                      "repeat spread: the rows' own (p90 - p10) / 2 over their median, "
                      "the measurement noise a prediction cannot beat", markup=False,
                      highlight=False)
    if write:
        from simulator.report.files import StagedFile
        raw.setdefault("meta", {})["fit"] = json_safe(d)
        # Rewritten whole or not at all: a full disk must not cut the profile short.
        with StagedFile(profile, option=str(profile)) as staged:
            staged.path.write_text(json.dumps(raw, indent=1) + "\n")
        (err_console if as_json else console).print(f"wrote meta.fit to {profile}",
                                                    markup=False, highlight=False)


# -- shared: runs, scenarios, tables --------------------------------------------------------

def _one_server_scenario(scenario: Path, set_):
    """The scenario (after ``--set``) a recorded run is replayed under, and its folder:
    one replica, as a recorded run is one server."""
    from simulator.config.scenario import load_scenario
    if not scenario.exists():
        raise LatsimError("file not found", source=str(scenario), field="SCENARIO")
    sc, base = load_scenario(scenario, set_)
    if sc.cluster.replicas != 1:
        raise LatsimError("a recorded run is one server: the scenario must have one replica",
                          source=str(scenario), field="cluster.replicas",
                          value=sc.cluster.replicas, has_value=True)
    return sc, base


def load_cases(scenario: Path, runs: List[Path], label: Optional[str], set_=None,
               label_option: str = "--policy"):
    """The scenario and each run folder as ``RunCase`` s (the policy run that served each,
    or the one ``label`` names: the option ``label_option``), checked before any work;
    returns ``(cases, scenario, base_dir)``."""
    from simulator.cost.calibration import RunCase, match_policy, read_recorded_run
    from simulator.cost.calibration.settings import slot_check
    sc, base = _one_server_scenario(scenario, set_)
    seen = {}
    for r in runs:
        key = Path(r).resolve()
        if key in seen:
            raise LatsimError(f"the same run folder as --run {seen[key]}: a run given twice would "
                              "count twice in the calibration", source="--run", value=str(r),
                              has_value=True)
        seen[key] = str(r)
    cases = []
    for r in runs:
        run = read_recorded_run(r)
        lab, psc = match_policy(sc, run, str(scenario), label, label_option)
        note = slot_check(run, psc.engine)
        if note is not None:
            run.notes.append(note)
            err_console.print(f"warning: {run.name}: {note}", markup=False, highlight=False)
        cases.append(RunCase(run, lab, psc))
    return cases, sc, base


def latency_table(title: str, real: dict, sims: dict) -> Table:
    """Real vs each simulated column: P50 and P99 of TTFT, TPOT, ITL, E2E, with errors."""
    from simulator.cost.calibration import METRICS, compare
    t = Table(title=title, title_justify="left")
    t.add_column("metric")
    t.add_column("real ms", justify="right")
    for name in sims:
        t.add_column(f"{name} ms", justify="right")
        t.add_column("err", justify="right")
    errs = [compare(real, s) for s in sims.values()]
    for m in METRICS:
        for q, qn in (("median", "P50"), ("p99", "P99")):
            k = f"{q}_{m}_ms"
            row = [f"{qn} {m.upper()}", _num(real.get(k))]
            for e in errs:
                row += [_num(e[k]["sim"]), _pct(e[k]["rel_err"])]
            t.add_row(*row)
    return t


def step_table(title: str, cols: dict) -> Table:
    """Model / measured time per step kind (decode-only, prefill-only, mixed, and of
    those the steps with two or more chunks; median, p10, p90) for each model, and the
    total busy-time bias, also by quarter of the run's time."""
    t = Table(title=title, title_justify="left")
    t.add_column("steps")
    t.add_column("n", justify="right")
    for name in cols:
        t.add_column(f"{name} p50", justify="right")
        t.add_column("p10", justify="right")
        t.add_column("p90", justify="right")
    first = next(iter(cols.values()))
    for kind in ("decode", "prefill", "prefill_chunks", "mixed", "mixed_chunks", "multi"):
        if kind not in first:
            continue
        # "several": intervals over more than one step (steps the run did not time).
        row = [{"decode": "decode", "prefill": "prefill", "mixed": "mixed",
                "prefill_chunks": "  of them 2+ chunks", "mixed_chunks": "  of them 2+ chunks",
                "multi": "several"}[kind], str(first[kind]["n"])]
        for e in cols.values():
            v = e.get(kind) or {}
            row += [_num(v.get("median"), 3), _num(v.get("p10"), 3), _num(v.get("p90"), 3)]
        t.add_row(*row)
    row = ["busy bias", str(first["intervals"])]
    for e in cols.values():
        row += [_pct(e["busy_bias"]), "", ""]
    t.add_row(*row)
    # The same by quarter of the run: an engine warming up shows in the first one.
    quarters = first.get("busy_bias_by_quarter") or []
    d = 0 if quarters and quarters[-1]["to_s"] >= 20 else 1    # a short run: tenths
    for i, qt in enumerate(quarters):
        row = [f"  {qt['from_s']:.{d}f}-{qt['to_s']:.{d}f} s", str(qt["intervals"])]
        for e in cols.values():
            qs = e.get("busy_bias_by_quarter") or []
            row += [_pct(qs[i]["bias"]) if i < len(qs) else "", "", ""]
        t.add_row(*row)
    return t


def _finite_errors(errors: dict) -> int:
    return sum(1 for v in errors.values() if v.get("rel_err") is not None)


def _check_line(name: str, check: dict) -> str:
    if "conflicts" in check:
        return (f"{name}: {check['steps']} steps replayed by the scenario's policy, "
                f"{check['anchored_steps']} timed by the run's tokens, "
                f"{check['conflicts']} recorded times contradicting the replay; tokens of one "
                f"step arrive within {check['same_step_spread_ms_p50']:.3f} ms (median, "
                f"p90 {check['same_step_spread_ms_p90']:.3f} ms)")
    return (f"{name}: {check['steps']} steps from the step log (mismatches: "
            f"{check['prefill_seq_mismatches']} prefill, {check['decode_mismatches']} decode, "
            f"{check['first_token_mismatches']} first-token)")


def _replay_ok(check: dict) -> bool:
    if "conflicts" not in check:
        return True
    return check["conflicts"] <= max(3, 0.05 * check["anchored_steps"])


# -- latsim calibrate -------------------------------------------------------------------------

def refuse_summary_runs(runs: List[Path]) -> None:
    """A run of aggregates (inference-perf, vllm bench JSON) cannot be calibrated on:
    the coefficients are fitted to step or token times, and a mean or percentile of
    whole-request latencies mixes queueing, prefill and every decode step of the run, so
    no step cost follows from it. One-line exit-2 error naming the run and what it lacks."""
    from simulator.cost.calibration.aggregates import is_summary_run, read_summary_run
    for r in runs:
        if is_summary_run(r):
            rec = read_summary_run(r)
            raise LatsimError(f"{rec.what} run of aggregates: it records no step log "
                              "(iterations.csv) and no per-token or per-request times "
                              "(tokens.csv, requests.csv), only latency means and "
                              "percentiles, from which no step cost can be fitted; compare "
                              "with it by `latsim validate --run`", source=str(r),
                              field="--run")


@one_line_errors
def calibrate(
    scenario: Path = typer.Argument(..., help="scenario YAML describing the server (engine "
                                    "settings, model.cost with the profile to start from)"),
    run: List[Path] = typer.Option(..., "--run", help="recorded run folder (refbench or "
                                   "`latsim bench --out`); repeat to pool runs"),
    out: Optional[Path] = typer.Option(None, "--out", help="write the calibrated profile here "
                                       "(a new file; --force to replace one)"),
    force: bool = typer.Option(False, "--force", help="--out may name an existing file: it "
                               "is replaced"),
    facts_only: bool = typer.Option(False, "--facts-only", help="measure the engine facts "
                                    "only (bookkeeping, decode waves, step tail); keep the "
                                    "profile's fitted coefficients"),
    policy: Optional[str] = typer.Option(None, "--policy", help="the scenario's policy run "
                                         "(label) that served the runs, when it has several "
                                         "and a run does not record its own"),
    profile: Optional[Path] = typer.Option(None, "--profile", help="start from this profile "
                                           "instead of the scenario's model.cost.path (a "
                                           "latsim profile, or a refbench step-cost CSV, "
                                           "converted)"),
    no_sim: bool = typer.Option(False, "--no-sim", help="skip the before/after simulations"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="scenario override: a.b=value"),
) -> None:
    """Calibrate the step-cost model on a recorded serving run and write a profile."""
    from simulator.cost import load_profile, profile_search_dirs, resolve_profile_path
    from simulator.cost.calibration import (ReplayError, calibrate as run_calibration,
                                            simulate_run)
    from simulator.cost.fitted import FittedCostModel
    from simulator.cli.common import on_interrupt
    from simulator.report.files import StagedFile, check_out_file, json_safe
    if out is not None and out.suffix != ".json":
        raise LatsimError("must be a .json file", source="--out", value=str(out), has_value=True)
    if out is not None:
        # A profile is a result (a calibration can take minutes and a run may be gone):
        # replaced only when asked, and its folder checked before any work.
        check_out_file(out, force=force)
        on_interrupt(f"nothing written to {out}")
    refuse_summary_runs(run)
    cases, sc, base = load_cases(scenario, run, policy, set_)
    if profile is not None:
        if not profile.exists():
            raise LatsimError("file not found", source=str(profile), field="--profile")
        if profile.suffix == ".csv":
            from simulator.cost.convert import refbench_to_profile
            prof = refbench_to_profile(profile)
        else:
            prof = load_profile(profile)
        path = str(profile)
    else:
        path = getattr(sc.model.cost, "path", None)
        if path is None:
            raise LatsimError("calibration starts from a profile: model.cost needs a path "
                              "(or give --profile)", source=str(scenario), field="model.cost.path")
        prof = load_profile(resolve_profile_path(path, profile_search_dirs(base)))
    for k in cases:
        console.print(f"run {k.run.name}: {len(k.run)} requests, format {k.run.kind}, "
                      f"policy {k.scenario.engine.policy} ({k.label}), token times "
                      f"{k.run.token_clock}-side" + "".join(f"; {n}" for n in k.run.notes),
                      markup=False, highlight=False)
    try:
        cal = run_calibration(cases, prof, facts_only=facts_only, profile_source=str(path),
                              log=lambda s: console.print(s, markup=False, highlight=False))
    except ReplayError as e:
        raise NotMet(str(e)) from None
    rep = cal.report
    for name, how in rep["how"].items():
        console.print(f"{name}: {how}", markup=False, highlight=False, soft_wrap=True)
    if "refitted" in rep:
        moved = [f"{n} {v['before']:.4g} -> {v['after']:.4g}"
                 for n, v in rep["coefficients"].items() if n in rep["refitted"]]
        console.print("refitted: " + ("; ".join(moved) or "nothing"), markup=False,
                      highlight=False, soft_wrap=True)
        for n, why in rep["kept"].items():
            console.print(f"kept {n}: {why}", markup=False, highlight=False)
    ok_replay = True
    for k, rd, lg in zip(cases, rep["runs"], cal.logs):
        console.print(_check_line(k.run.name, lg.check), markup=False, highlight=False)
        ok_replay &= _replay_ok(lg.check)
        console.print(step_table(f"{k.run.name}: step time, model / measured",
                                 {"before": rd["step_errors_before"],
                                  "after": rd["step_errors_after"]}))
        if not no_sim:
            before = simulate_run(k.scenario, k.run, base_dir=base, profile=prof)
            after = simulate_run(k.scenario, k.run,
                                 cost_model=FittedCostModel(cal.profile, noise=False))
            console.print(latency_table(f"{k.run.name}: real vs simulated, before and after "
                                        f"calibration", k.run.real,
                                        {"before": before, "after": after}))
            rd["latency"] = {"before": before, "after": after, "real": k.run.real}
    if out is not None:
        prof_out = json_safe(cal.profile)
        # Staged and renamed over --out: never a 0-byte profile that then needs --force.
        with StagedFile(out) as staged:
            staged.path.write_text(json.dumps(prof_out, indent=1) + "\n")
        on_interrupt(f"the profile is written to {out}")
        console.print(f"wrote {out}", markup=False, highlight=False)
    if not ok_replay:
        raise NotMet("the replay could not follow the run (too many recorded times "
                     "contradict it): check the scenario's engine settings against the server")
    def worse_on(rd) -> bool:
        b, a = rd["step_errors_before"], rd["step_errors_after"]
        return (abs(a["busy_bias"]) > abs(b["busy_bias"]) + 0.005
                and a["median_abs"] > b["median_abs"] + 0.005)

    worse = [rd["run"] for rd in rep["runs"] if worse_on(rd)]
    if worse:
        raise NotMet(f"calibration made the model's step times worse on {', '.join(worse)}")


# -- latsim validate --run ---------------------------------------------------------------------

def validate_run(run: Path, scenario: Path, label: Optional[str], out: Optional[Path],
                 set_: Optional[List[str]] = None) -> None:
    """``latsim validate --run DIR SCENARIO``: real vs simulated P50/P99 for a recorded
    run, and the model's step time against the measured one per step kind."""
    from simulator.cost.calibration import ReplayError, validate_recorded
    from simulator.cost.calibration.aggregates import is_summary_run
    from simulator.report.files import check_out_dir, json_safe
    if is_summary_run(run):
        return validate_summary_run(run, scenario, label, out, set_)
    cases, _, base = load_cases(scenario, [run], label, set_, "--policies")
    if out is not None:
        check_out_dir(out, keep=True)     # one file per run: a repeat replaces its own
    k = cases[0]
    try:
        res = validate_recorded(k, base_dir=base)
    except ReplayError as e:
        raise NotMet(str(e)) from None
    console.print(f"{k.run.name}: {len(k.run)} requests, policy {k.scenario.engine.policy} "
                  f"({k.label}), cost model {res['cost_model'].get('kind')}"
                  + "".join(f"; {n}" for n in k.run.notes), markup=False, highlight=False)
    console.print(latency_table(f"{k.run.name}: real vs simulated", k.run.real,
                                {"sim": res["sim"]}))
    console.print(_check_line(k.run.name, res["replay_check"]), markup=False, highlight=False)
    console.print(step_table(f"{k.run.name}: where the error comes from (model / measured step "
                             f"time)", {"model": res["step_errors"]}))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        p = out / f"validation-{k.run.name}.json"
        from simulator.report.files import StagedFile
        with StagedFile(p) as staged:
            staged.path.write_text(json.dumps(json_safe(res), indent=2) + "\n")
        console.print(f"wrote {p}", markup=False, highlight=False)
    if not _finite_errors(res["errors"]):
        raise NotMet("no simulated percentile could be compared with the run's")


def _summary_scenario(scenario: Path, label: Optional[str], set_):
    """The scenario's one policy run (or the one ``label`` names) for a run of
    aggregates, checked as ``load_cases`` checks it: one replica."""
    from simulator.cost.calibration import match_policy
    sc, base = _one_server_scenario(scenario, set_)
    return match_policy(sc, None, str(scenario), label, "--policies")[1], base


def aggregate_table(title: str, judged: dict) -> Table:
    """Real vs simulated for each aggregate the recording holds (``compared_keys``)."""
    t = Table(title=title, title_justify="left")
    for c, j in (("metric", "left"), ("real ms", "right"), ("sim ms", "right"),
                 ("err", "right")):
        t.add_column(c, justify=j)
    for k, e in judged["errors"].items():
        st, m, _ = k.split("_")
        t.add_row(f"{st} {m.upper()}", _num(e["real"]), _num(e["sim"]), _pct(e["rel_err"]))
    return t


def _verdict(j: dict) -> str:
    rs, ss = j["real_saturated"], j["sim_saturated"]
    if rs and ss:
        return "saturated: the recording and latsim agree"
    if rs:
        return "saturated in the recording; latsim predicts a healthy server"
    if ss:
        return "latsim predicts saturation; the recording shows a healthy server"
    return "healthy: the recording and latsim agree"


def validate_summary_run(run: Path, scenario: Path, label: Optional[str],
                         out: Optional[Path], set_: Optional[List[str]] = None) -> None:
    """``latsim validate --run`` on a run of aggregates (an inference-perf folder or a
    ``vllm bench serve`` JSON: ``cost.calibration.aggregates``): the scenario simulated
    (an inference-perf run's traffic from its own config), its aggregates compared
    with the recording's, overall and per stage, and both saturation verdicts. Exit 1
    when the verdicts differ or nothing could be compared."""
    from simulator.cost.calibration.aggregates import (read_summary_run, simulate_summary,
                                                       with_run_workload)
    from simulator.report.files import check_out_dir, json_safe
    rec = read_summary_run(run)
    psc, base = _summary_scenario(scenario, label, set_)
    if out is not None:
        check_out_dir(out, keep=True)
    psc = with_run_workload(psc, rec)
    clock = ("inference-perf's (TPOT and ITL over every SSE line: about half the time "
             "per token; ITL percentiles not compared)" if rec.clock == "inference_perf"
             else "vllm bench serve's")
    src = (f"workload from {rec.config}" if psc.workload.kind == "inference_perf"
           and rec.config is not None else "workload from the scenario")
    console.print(f"{rec.name}: {rec.what} run of aggregates, {rec.overall.get('count', 0)} "
                  f"requests; {src}; clock {clock}" + "".join(f"; {n}" for n in rec.notes),
                  markup=False, highlight=False, soft_wrap=True)
    res = simulate_summary(psc, rec, base)
    parts = [("all stages", res["overall"])] + [(f"stage {k}", j)
                                                for k, j in enumerate(res["stages"])]
    for name, j in parts:
        console.print(aggregate_table(f"{rec.name}, {name}: real vs simulated", j))
        console.print(f"{name}: {_verdict(j)}", markup=False, highlight=False)
    if res.get("note"):
        console.print(res["note"], markup=False, highlight=False)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        p = out / f"validation-{rec.name}.json"
        from simulator.report.files import StagedFile
        with StagedFile(p) as staged:
            staged.path.write_text(json.dumps(json_safe({"run": str(rec.path),
                                                         "kind": rec.kind, **res}),
                                              indent=2) + "\n")
        console.print(f"wrote {p}", markup=False, highlight=False)
    off = [n for n, j in parts if j["real_saturated"] != j["sim_saturated"]]
    if off:
        raise NotMet(f"the saturation verdicts differ ({', '.join(off)}): latsim "
                     f"{'misses' if parts[0][1]['real_saturated'] else 'predicts'} an overload")
    if not _finite_errors(res["overall"]["errors"]):
        raise NotMet("no simulated aggregate could be compared with the run's")
