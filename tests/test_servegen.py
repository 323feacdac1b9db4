"""ServeGen synthesis: arrival processes, token pmfs, bad input, and the real folders.

The statistical checks compare what was synthesised with what the input parameters
imply: per-window expected counts (rate x 600 s), per-client gap CVs (from the
fitted family and shape), and the aggregate dispersion of counts.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from simulator.errors import LatsimError
from simulator.config.registry import WORKLOADS
from simulator.config import plugins  # noqa: F401  (registers kind: servegen)
from simulator.workload.servegen import (ServeGenWorkload, build_servegen, client_ids, implied_cv,
                                         read_windows, window_arrivals)
from simulator.workload.traces import summarize_workload

HERE = Path(__file__).resolve().parent
MINI = HERE / "data" / "servegen_mini"
# The repository's data/servegen (data/servegen/README.md): deepseek-r1's 73 clients for one
# day; m-large's 162 clients cut to day 1. A missing file fails the test, never skips it.
SERVEGEN = HERE.parent / "data" / "servegen"


def sg(path=MINI, seed=0, **kw):
    return build_servegen(ServeGenWorkload(path=str(path), **kw), np.random.default_rng(seed), HERE)


# --------------------------------------------------------------------------- processes

def test_implied_cv():
    assert implied_cv("Gamma", 0.25) == pytest.approx(2.0)
    assert implied_cv("Weibull", 1.0) == pytest.approx(1.0)
    assert implied_cv("Weibull", 0.5) == pytest.approx(math.sqrt(5))  # Γ(5)/Γ(3)² - 1


@pytest.mark.parametrize("pattern,shape", [("Gamma", 0.25), ("Gamma", 3.0), ("Weibull", 0.5)])
def test_window_arrivals_rate_and_cv(pattern, shape):
    rng = np.random.default_rng(1)
    a = window_arrivals(pattern, shape, 50.0, 100.0, 4000.0, rng)
    assert a.min() >= 100.0 and a.max() < 4100.0 and np.all(np.diff(a) >= 0)
    assert len(a) / 4000.0 == pytest.approx(50.0, rel=0.05)
    gaps = np.diff(a)
    assert gaps.std() / gaps.mean() == pytest.approx(implied_cv(pattern, shape), rel=0.06)


def test_stationary_start_gives_unbiased_window_counts():
    # A bursty renewal process started at a renewal would put (cv^2 - 1)/2 = 4 extra
    # requests in every short window; the stationary start puts rate * length.
    rng = np.random.default_rng(2)
    counts = [len(window_arrivals("Gamma", 1 / 9, 2.0, 0.0, 5.0, rng)) for _ in range(6000)]
    assert np.mean(counts) == pytest.approx(10.0, rel=0.05)


# --------------------------------------------------------------------------- mini folder

def test_mini_folder_window_clients_and_lengths():
    wl = sg(window=[0, 7200])
    assert client_ids(MINI) == [10, 19, 35]
    assert wl.meta["client_ids"] == [10, 19, 35] and wl.meta["fallback_client"] == 35
    assert np.all(np.diff(wl.arrival_s) >= 0) and wl.arrival_s.min() >= 0 and wl.arrival_s.max() < 7200
    assert set(np.unique(wl.client)) == {1, 2}  # client 10 is idle
    assert len(wl) == pytest.approx(wl.meta["expected_requests"], rel=0.1)
    # pmfs by 6-hour... here hand-made periods: 0 s, 3600 s (empty: nearest is 0 s), 5400 s
    early = wl.arrival_s < 5400
    assert set(wl.prompt_tokens[early]) <= {100, 300, 1000}
    assert set(wl.output_tokens[early]) <= {50, 2000}
    assert set(wl.prompt_tokens[~early]) == {7} and set(wl.output_tokens[~early]) == {9}
    p = wl.prompt_tokens[early]
    assert np.mean(p == 100) == pytest.approx(0.5, abs=0.05)


def test_mini_deterministic_partial_window_and_scale():
    a, b = sg(window=[300, 1500], seed=5), sg(window=[300, 1500], seed=5)
    assert a.arrival_s.tolist() == b.arrival_s.tolist() and a.prompt_tokens.tolist() == b.prompt_tokens.tolist()
    assert a.arrival_s.max() < 1200
    rows35 = read_windows(MINI, 35, 0, 3)
    rows19 = read_windows(MINI, 19, 0, 3)
    want = sum(r[0] * s for rows in (rows35, rows19) for r, s in zip(rows, (300, 600, 300)))
    assert a.meta["expected_requests"] == pytest.approx(want)
    only19 = sg(window=[0, 7200], clients=[19], rate_scale=3.0)
    assert set(only19.client) == {0} and only19.meta["client_ids"] == [19]
    assert set(only19.prompt_tokens) <= {100, 300, 1000, 7}  # borrowed from client 35
    cls = sg(window=[0, 600], classes=[{"name": "hi", "share": 1}, {"name": "lo", "share": 1}])
    assert set(cls.priority) == {0, 1} and cls.class_names == ("hi", "lo")


def test_registry_and_validation():
    cfg = WORKLOADS.validate({"kind": "servegen", "path": "data/servegen_mini", "window": [0, 600]})
    assert len(WORKLOADS.build(cfg, np.random.default_rng(0), HERE)) > 0
    for bad in ({"window": [600, 600]}, {"window": [-1, 5]}, {"window": [0, 600], "rate_scale": 0},
                {"window": [0, 600], "client": [1]}):
        with pytest.raises(Exception):
            WORKLOADS.validate({"kind": "servegen", "path": "x", **bad})


@pytest.mark.parametrize("kw,pattern", [
    ({"path": "nowhere", "window": [0, 600]}, r"nowhere: ServeGen folder not found"),
    ({"window": [0, 600], "clients": [35, 99]}, r"field 'clients': no chunk-<client>-trace\.csv for client\(s\) \[99\]"),
    ({"window": [0, 7800]}, r"chunk-\d+-trace\.csv: field 'window': window ends after the data \(7200 s"),
    ({"window": [0, 600], "fallback_client": 19}, r"field 'fallback_client': client 19 has no dataset\.json"),
    ({"window": [0, 600], "clients": [10]}, r"field 'window': the chosen clients send no requests"),
])
def test_bad_input(kw, pattern):
    with pytest.raises(LatsimError, match=pattern):
        sg(**kw)


def test_bad_rows_name_file_and_line(tmp_path):
    shutil.copytree(MINI, tmp_path / "f")
    f = tmp_path / "f" / "chunk-19-trace.csv"
    lines = f.read_text().splitlines()
    lines[2] = "1200,0.3,5.8,Gamma,x,3.3"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(LatsimError, match=r"chunk-19-trace\.csv:3: expected window_start_s=1200"):
        sg(tmp_path / "f", window=[0, 1800])
    lines[2] = "1200,0.3,5.8,Lognormal,0.5,3.3"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(LatsimError, match=r"chunk-19-trace\.csv:3: column 'pattern'"):
        sg(tmp_path / "f", window=[0, 1800])
    (tmp_path / "f" / "chunk-35-dataset.json").write_text("{oops")
    with pytest.raises(LatsimError, match=r"chunk-35-dataset\.json: cannot read dataset JSON"):
        sg(tmp_path / "f", window=[0, 600])
    (tmp_path / "g").mkdir()
    with pytest.raises(LatsimError, match="no chunk-<client>-trace.csv files"):
        sg(tmp_path / "g", window=[0, 600])


# --------------------------------------------------------------------------- real folders

def _implied(folder: Path, window: tuple[float, float], width: float):
    """Expected counts per ``width`` bin and the asymptotic (renewal) count variance."""
    first, count = int(window[0] // 600), int(math.ceil(window[1] / 600)) - int(window[0] // 600)
    per = int(600 // width)
    mu, var = np.zeros(count * per), np.zeros(count * per)
    for c in client_ids(folder):
        for k, (rate, _cv, pattern, shape, _s) in enumerate(read_windows(folder, c, first, count)):
            if rate > 0:
                mu[k * per:(k + 1) * per] += rate * width
                var[k * per:(k + 1) * per] += rate * width * implied_cv(pattern, shape) ** 2
    return mu, var


def test_real_parameters_match_readme():
    # data/servegen/README.md, reason/deepseek-r1: 73 clients x 144 windows, aggregate mean 16.0 req/s,
    # peak/mean 2.66, min/mean 0.27; Gamma 2,589 / Weibull 522 fits.
    folder = SERVEGEN / "reason" / "deepseek-r1"
    ids = client_ids(folder)
    rows = {c: read_windows(folder, c, 0, 144) for c in ids}
    agg = np.array([sum(rows[c][k][0] for c in ids) for k in range(144)])
    pats = [r[2] for c in ids for r in rows[c]]
    assert len(ids) == 73
    assert agg.mean() == pytest.approx(16.0, abs=0.05)
    assert agg.max() / agg.mean() == pytest.approx(2.66, abs=0.005)
    assert agg.min() / agg.mean() == pytest.approx(0.27, abs=0.005)
    assert (pats.count("Gamma"), pats.count("Weibull")) == (2589, 522)


def test_real_deepseek_window_reproduces_rate_and_burstiness():
    folder = SERVEGEN / "reason" / "deepseek-r1"
    window = (21600.0, 43200.0)  # six hours, 360 minute bins
    wl = sg(folder, seed=0, window=list(window))
    mu, var = _implied(folder, window, 60.0)
    s = summarize_workload(wl)
    assert len(wl) == pytest.approx(mu.sum(), rel=0.03)
    assert s["mean_rate"] == pytest.approx(mu.sum() / 21600, rel=0.03)
    counts = np.bincount((wl.arrival_s // 60).astype(int), minlength=len(mu))[:len(mu)]
    disp = ((counts - mu) ** 2).mean() / mu.mean()  # about the windows' own means
    implied = var.sum() / mu.sum()  # superposed renewal processes, long-bin limit: sum r cv^2 / sum r
    assert implied > 10  # a bursty stretch: Poisson would give 1
    # Finite 60 s bins sit a little below the long-bin limit.
    assert 0.7 * implied < disp < 1.1 * implied, (disp, implied)
    assert wl.meta["fallback_client"] in (35, 48, 3)


def test_real_m_large_window_rate_client_cv_and_lengths():
    folder = SERVEGEN / "language" / "m-large"
    window = (36000.0, 36600.0)  # one 600 s window, ~200k requests
    wl = sg(folder, seed=1, window=list(window))
    assert len(wl) == pytest.approx(wl.meta["expected_requests"], rel=0.03)
    ids = wl.meta["client_ids"]
    checked = 0
    for i, c in enumerate(ids):
        rate, _cv, pattern, shape, _ = read_windows(folder, c, 60, 1)[0]
        t = wl.arrival_s[wl.client == i]
        # Sample CVs of very bursty clients converge slowly: check the well-sampled ones.
        if rate * 600 < 2000 or implied_cv(pattern, shape) > 2:
            continue
        gaps = np.diff(t)
        assert gaps.std() / gaps.mean() == pytest.approx(implied_cv(pattern, shape), rel=0.1), c
        checked += 1
    assert checked >= 8
    # Client 143's lengths (~11k requests) follow its pmf for the 6-hour period from 21600 s.
    sel = wl.client == ids.index(143)
    for col, got in (("input_tokens", wl.prompt_tokens[sel]), ("output_tokens", wl.output_tokens[sel])):
        assert got.mean() == pytest.approx(_pmf_mean(folder, 143, col), rel=0.03)


def _pmf_mean(folder: Path, client: int, column: str) -> float:
    import ast
    import json
    raw = json.loads((folder / f"chunk-{client}-dataset.json").read_text())["21600"][column]
    pmf = ast.literal_eval(raw)
    return sum(k * v for k, v in pmf.items()) / sum(pmf.values())


def test_class_system_prompts_are_prepended():
    """A class's shared system prompt lengthens its prompts and is marked shared
    (prefix caching then serves it from cache); the same seed, same draws otherwise."""
    classes = [{"name": "bot", "share": 1, "system_prompt_tokens": 500}, {"name": "api", "share": 1}]
    plain = sg(window=[0, 7200], classes=[{"name": "bot", "share": 1}, {"name": "api", "share": 1}])
    wl = sg(window=[0, 7200], classes=classes)
    bot = wl.priority == 0
    assert bot.any() and (~bot).any()
    assert (wl.prompt_tokens[bot] == plain.prompt_tokens[bot] + 500).all()
    assert (wl.prompt_tokens[~bot] == plain.prompt_tokens[~bot]).all()
    assert (wl.shared_prefix_tokens == np.where(bot, 500, 0)).all()
