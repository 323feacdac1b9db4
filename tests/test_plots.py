"""The plots: each function draws the panels, labels and series it promises (checked on
the figure's axes, not pixels); ``plot_run`` and ``latsim report`` write PNGs next to
the results and fail on one line for missing folders."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import REPO
from simulator.report import plots
from simulator.errors import LatsimError

POLICIES = ["fifo", "chunked"]


def _labelled_lines(ax) -> list:
    return [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A two-policy, two-replica, three-class run written as `latsim run --out` does."""
    from simulator.config.scenario import load_scenario
    from simulator.report.files import write_run
    from simulator.report.output import run_outputs, series_table
    from simulator.loops.simulate import simulate

    sc, base = load_scenario(REPO / "scenarios" / "policies-compare.yaml",
                             ["workload.num_requests=240", "cluster.replicas=2",
                              "workload.arrival.rate=8"])
    outs, tables, series = {}, {}, {}
    for p in POLICIES:
        res = simulate(sc, None, base_dir=base, policy=p)
        tables[p], outs[p] = run_outputs(res)
        series[p] = series_table(res)
    d = tmp_path_factory.mktemp("run")
    write_run(d, sc, outs, tables, series)
    return d


@pytest.fixture(scope="module")
def results(run_dir):
    return plots.load_results(run_dir)


def sweep_table(knee_at=(6.0, 8.0)) -> pd.DataFrame:
    """A `latsim sweep`-shaped table: point, rate, engine.policy, seed, metrics; P99 TTFT
    jumps 10x at each policy's ``knee_at`` load."""
    rows = []
    for k, (pol, knee) in enumerate(zip(POLICIES, knee_at)):
        for i, rate in enumerate([2.0, 4.0, 6.0, 8.0, 10.0]):
            for seed in (1, 2):
                jump = 10.0 if rate >= knee else 1.0 + 0.1 * i
                rows.append({"point": k * 5 + i, "rate": rate, "engine.policy": pol,
                             "seed": seed, "median_ttft_ms": 50.0 * jump,
                             "p99_ttft_ms": 200.0 * jump + seed, "median_tpot_ms": 20.0 + i,
                             "p99_tpot_ms": 30.0 + 2 * i, "run.engine_steps": 1000 + seed * i,
                             "P0:p99_ttft_ms": 1.0, "offered_rate": rate * 0.97})
    return pd.DataFrame(rows)


def test_load_results_reads_every_policy(run_dir, results):
    assert results.policies == POLICIES
    for p, run in results.items():
        assert {"ttft", "tpot", "e2el", "t_queue", "class"} <= set(run.requests.columns)
        assert set(run.timeseries["replica"]) == {0, 1}
        assert run.summary["policy"] == p
    assert results.path == run_dir


def test_load_results_single_run_and_errors(tmp_path, results):
    results["chunked"].requests.to_csv(tmp_path / "requests.csv", index=False)
    (tmp_path / "summary.json").write_text(json.dumps({"policy": "chunked", "overall": {}}))
    single = plots.load_results(tmp_path)
    assert single.policies == ["chunked"] and single["chunked"].timeseries is None
    with pytest.raises(LatsimError, match="results folder not found"):
        plots.load_results(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LatsimError, match="no requests.csv"):
        plots.load_results(empty)


def test_read_requests_derives_latencies(tmp_path, results):
    df = results["fifo"].requests.drop(columns=["ttft", "tpot", "e2el"])
    df.to_csv(tmp_path / "r.csv", index=False)
    back = plots.read_requests(tmp_path / "r.csv")
    assert np.allclose(back["e2el"], results["fifo"].requests["e2el"], equal_nan=True)
    pd.DataFrame({"a": [1]}).to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(LatsimError, match="not a per-request table"):
        plots.read_requests(tmp_path / "bad.csv")


def test_latency_cdfs_panels(results):
    fig = plots.plot_latency_cdfs(results)
    axes = fig.axes
    assert len(axes) == 4 * 3  # all requests + classes P0, P1, P2; TTFT, TPOT, E2E
    titles = [ax.get_title() for ax in axes]
    assert titles[:3] == ["TTFT: all requests", "TPOT: all requests", "E2E latency: all requests"]
    assert titles[3] == "TTFT: class P0" and titles[-1] == "E2E latency: class P2"
    for ax in axes:
        assert len(_labelled_lines(ax)) == len(POLICIES)  # one CDF per policy
        assert ax.get_yscale() == "logit" and "requests" in ax.get_ylabel()
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert all("P50" in t and "P99" in t for t in labels)
        assert len(ax.collections) == 2 * len(POLICIES)  # P50 and P99 markers
    assert [ax.get_xlabel() for ax in axes[:2]] == ["TTFT (ms)", "TPOT (ms)"]
    assert axes[2].get_xlabel() in ("E2E latency (s)", "E2E latency (ms)")
    assert "P50" in fig.get_suptitle() and "P99" in fig.get_suptitle()
    assert len(plots.plot_latency_cdfs(results, by_class=False).axes) == 3


def test_breakdown_at_is_the_window_mean():
    n = 1000
    e2e = np.arange(1, n + 1, dtype=float)
    df = pd.DataFrame({"t_net": 0.0 * e2e, "t_queue": 0.5 * e2e, "t_prefill": 0.1 * e2e,
                       "t_decode": 0.4 * e2e, "t_stream": 0.0 * e2e, "e2el": e2e,
                       "finished": True})
    b = plots.breakdown_at(df, 0.99)
    # Ranks within 0.99 +- 0.005: the 985th..994th values (0-based 985..994 -> 986..995).
    assert b["n"] == 10
    assert b["e2el"] == pytest.approx(np.mean(e2e[985:995]))
    assert b[list(plots.STAGES)].sum() == pytest.approx(b["e2el"])
    assert b["t_queue"] == pytest.approx(0.5 * b["e2el"])
    small = plots.breakdown_at(df.head(20), 0.5)  # window too small: 10 nearest ranks
    assert small["n"] == 10 and small["e2el"] == pytest.approx(np.mean(e2e[5:15]))


def test_breakdown_panels(results):
    fig = plots.plot_breakdown(results)
    top_p50, top_p99, zoom_p50, zoom_p99 = fig.axes
    assert "P50" in top_p50.get_title() and "P99" in top_p99.get_title()
    assert "T_decode" in zoom_p50.get_title()
    for ax in (top_p50, top_p99):
        assert len(ax.patches) == 5 * len(POLICIES)  # five stages stacked per policy
        assert [t.get_text() for t in ax.get_yticklabels()] == POLICIES[::-1]
        assert ax.get_xlabel() in ("time (s)", "time (ms)")
    for ax in (zoom_p50, zoom_p99):
        assert len(ax.patches) == 4 * len(POLICIES)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert [t.split(" ")[0] for t in legend] == ["T_net", "T_queue", "T_prefill", "T_decode",
                                                 "T_stream"]


def test_timeseries_panels(results):
    fig = plots.plot_timeseries(results)
    assert len(fig.axes) == 3 * 2  # queue, batch, KV x two replicas
    ylabels = {ax.get_ylabel() for ax in fig.axes}
    assert ylabels == {"queue length (requests)", "running batch (requests)",
                       "KV cache reserved (%)"}
    assert {ax.get_title().split(": ")[1] for ax in fig.axes} == {"replica 0", "replica 1"}
    for ax in fig.axes:
        assert len(_labelled_lines(ax)) == len(POLICIES)
    assert fig.axes[-1].get_xlabel() == "simulated time (s)"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == POLICIES
    one = plots.plot_timeseries({"fifo": results["fifo"]}, max_replicas=1)
    assert len(one.axes) == 3 and "policy fifo" in one.get_suptitle()


def test_find_knee():
    x = [1, 2, 3, 4, 5]
    assert plots.find_knee(x, [10, 12, 20, 31, 100], 3.0) == 4
    assert plots.find_knee(x[::-1], [100, 31, 20, 12, 10], 3.0) == 4  # order-free
    assert plots.find_knee(x, [10, 11, 12, 13, 14]) is None
    assert plots.find_knee(x, [10, 11, np.nan, 13, 14]) == 3  # nothing finished: past it
    assert plots.find_knee([], []) is None


def test_load_curve_panels_and_knees():
    df = sweep_table()
    assert plots.sweep_axes(df) == ("rate", "engine.policy", [])
    assert plots.load_knees(df, "rate") == {"fifo": 6.0, "chunked": 8.0}
    fig = plots.plot_load_curve(df, "rate", "engine.policy")
    ttft, tpot = fig.axes
    assert ttft.get_ylabel() == "TTFT (ms)" and tpot.get_ylabel() == "TPOT (ms)"
    assert ttft.get_xlabel() == tpot.get_xlabel() == "offered load (req/s)"
    assert ttft.get_yscale() == "log"
    for ax in (ttft, tpot):
        lines = _labelled_lines(ax)
        assert sorted(ln.get_label() for ln in lines) == sorted(
            f"{p} {q}" for p in POLICIES for q in ("P50", "P99"))
        knees = [ln for ln in ax.get_lines() if ln.get_label() == "_knee"]
        assert sorted(ln.get_xdata()[0] for ln in knees) == [6.0, 8.0]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "fifo: knee 6 req/s" in legend and "chunked: knee 8 req/s" in legend
    assert len(ttft.collections) >= 2  # the knee stars (plus the seeds' bands)
    assert "knee" in fig.get_suptitle()
    with pytest.raises(LatsimError, match="no column"):
        plots.plot_load_curve(df, "workload.arrival.rate")


def test_sweep_axes_variants():
    df = sweep_table().drop(columns=["point"]).rename(columns={"rate": "workload.arrival.rate"})
    assert plots.sweep_axes(df) == ("workload.arrival.rate", "engine.policy", [])
    df["cluster.replicas"] = np.where(df["seed"] == 1, 1, 2)
    x, group, extra = plots.sweep_axes(df)
    assert (x, group, extra) == ("workload.arrival.rate", "engine.policy", ["cluster.replicas"])
    with pytest.raises(LatsimError, match="no varying numeric parameter"):
        plots.sweep_axes(df[df["workload.arrival.rate"] == 2.0].drop(columns="cluster.replicas"))


def test_plot_sweep_joins_extra_parameters_into_groups(tmp_path):
    df = sweep_table()
    df.insert(2, "cluster.replicas", np.where(df["seed"] == 1, 1, 2))
    df.to_csv(tmp_path / "results.csv", index=False)
    (tmp_path / "sweep.yaml").write_text("grid: {}\n")
    out = plots.plot_sweep(tmp_path / "results.csv")
    assert out == tmp_path / "load_curve.png" and out.read_bytes()[:4] == b"\x89PNG"


def test_fidelity_panels_and_errors(results):
    real = results["chunked"].requests
    sim = real.copy()
    for c in ("ttft", "tpot", "e2el"):
        sim[c] = sim[c] * 1.1
    err = plots.fidelity_errors(real, sim)
    assert list(err["metric"]) == ["TTFT", "TTFT", "TPOT", "TPOT", "E2E latency",
                                   "E2E latency"]
    assert np.allclose(err["error_pct"], 10.0)
    fig = plots.plot_fidelity(real, sim, title="Fidelity test")
    *cdfs, bars = fig.axes
    assert [ax.get_title() for ax in cdfs] == ["TTFT: real vs sim", "TPOT: real vs sim",
                                               "E2E latency: real vs sim"]
    for ax in cdfs:
        assert [ln.get_label().split(":")[0] for ln in _labelled_lines(ax)] == ["real", "sim"]
    assert len(bars.patches) == 6  # P50 and P99 of three metrics
    assert "%" in bars.get_ylabel()
    assert [t.get_text() for t in bars.get_xticklabels()] == ["TTFT", "TPOT", "E2E latency"]
    assert fig.get_suptitle() == "Fidelity test"


def test_plot_run_writes_pngs_next_to_results(tmp_path, run_dir, results):
    written = plots.plot_run(run_dir)
    assert [p.name for p in written] == ["latency_cdfs.png", "breakdown.png", "timeseries.png"]
    for p in written:
        assert p.parent == run_dir and p.read_bytes()[:4] == b"\x89PNG"
    # A sweep folder and a validate folder.
    sweep_table().to_csv(tmp_path / "results.csv", index=False)
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({"grid": {"rate": [2, 4]}}))
    v = tmp_path / "validate"
    v.mkdir()
    results["fifo"].requests.to_csv(v / "real-fifo.csv", index=False)
    results["chunked"].requests.to_csv(v / "sim-fifo.csv", index=False)
    written = plots.plot_run(tmp_path)
    assert written == [tmp_path / "load_curve.png", v / "fidelity-fifo.png"]
    assert all(p.exists() for p in written)


def test_plot_run_errors(tmp_path):
    with pytest.raises(LatsimError, match="results folder not found"):
        plots.plot_run(tmp_path / "missing")
    with pytest.raises(LatsimError, match="nothing to plot"):
        plots.plot_run(tmp_path)
    (tmp_path / "results.csv").write_text("a,b\n1,2\n")  # not a sweep without sweep.yaml
    with pytest.raises(LatsimError, match="nothing to plot"):
        plots.plot_run(tmp_path)


def test_report_command(tmp_path, capsys):
    from simulator.cli.report import report

    sweep_table().to_csv(tmp_path / "sweep.csv", index=False)
    report(tmp_path)
    assert capsys.readouterr().out.split() == [str(tmp_path / "load_curve.png")]
    report(tmp_path / "sweep.csv")
    assert capsys.readouterr().out.split() == [str(tmp_path / "load_curve.png")]
    with pytest.raises(LatsimError, match="results folder not found"):
        report(tmp_path / "missing")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(LatsimError, match="expected a results folder"):
        report(tmp_path / "x.txt")


def test_latsim_report_cli_one_line_error(tmp_path):
    """`latsim report` of a missing folder: one line on stderr, exit 2."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "simulator.cli", "report", str(tmp_path / "no")],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "results folder not found" in r.stderr
