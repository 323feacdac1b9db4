"""Issue 28's broken rows, each as its repro: a profile of another model checked wherever
the scenario is run from, a disconnected client's finished request counted as cancelled,
a plug-in order key honoured, and ``bench`` sending each request's priority."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from simulator.config.scenario import load_scenario
from simulator.errors import LatsimError

LATSIM = [sys.executable, "-m", "simulator.cli"]
QUICKSTART = REPO / "scenarios" / "quickstart.yaml"


def latsim(*args, cwd=REPO):
    return subprocess.run([*LATSIM, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


# -- 1. a measured profile of another model -----------------------------------------------

@pytest.mark.parametrize("where", ["repo", "scenarios", "elsewhere"])
def test_a_profile_of_another_model_is_refused_from_any_working_directory(where, tmp_path,
                                                                          monkeypatch):
    # quickstart's cost.path is '../profiles/...', relative to the scenario file: from the
    # repository root it named nothing there and the check returned without looking.
    monkeypatch.chdir({"repo": REPO, "scenarios": REPO / "scenarios",
                       "elsewhere": tmp_path}[where])
    with pytest.raises(LatsimError) as e:
        load_scenario(QUICKSTART, ["model.name=llama-2-70b"])
    msg = str(e.value)
    assert "field 'model.cost.path'" in msg and "n_layers 80" in msg and "has 32" in msg
    # The profile's own model is accepted from the same place.
    sc, _ = load_scenario(QUICKSTART, ["model.name=llama-3-8b"])
    assert sc.model.shape.n_layers == 32


def test_a_missing_profile_is_refused_by_the_model_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LatsimError) as e:
        load_scenario(QUICKSTART, ["model.name=llama-3-8b", "model.cost.path=nope.json"])
    msg = str(e.value)
    assert "field 'model.cost.path'" in msg and "not found" in msg and "nope.json" in msg
    assert "\n" not in msg


def test_run_from_the_repository_root_refuses_another_models_profile(tmp_path):
    out = tmp_path / "x"
    r = latsim("run", "scenarios/quickstart.yaml", "--set", "model.name=llama-2-70b",
               "--out", out)
    assert r.returncode == 2, r.stdout[-500:]
    assert r.stderr.startswith("latsim: error: ") and r.stderr.count("\n") == 1
    assert "model.cost.path" in r.stderr and "n_layers 80" in r.stderr
    assert not out.exists()          # refused before any work
