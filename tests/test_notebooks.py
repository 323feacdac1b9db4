"""Every notebook runs top to bottom. The notebooks are jupytext percent scripts, so each
is run as plain Python (``MPLBACKEND=Agg``) from a scratch working directory, with its
outputs sent to a temporary folder; they must find the checkout themselves."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.py"))
HAS_TORCH = importlib.util.find_spec("torch") is not None
# PNGs each notebook writes (fidelity: one per policy, only when it can run the engine;
# fidelity_runs: latency and ITL CDFs for each of the two recorded H200 runs).
EXPECTED_PNGS = {"policy_comparison": 3, "latency_vs_load": 1, "fidelity": 3 if HAS_TORCH else 0,
                 "kv_pressure": 2, "hardware_whatif": 1, "fidelity_runs": 4,
                 "static_vs_continuous": 2, "edge": 1, "moe_ep": 1}


def test_every_notebook_is_known_and_a_percent_script():
    assert {p.stem for p in NOTEBOOKS} == set(EXPECTED_PNGS)
    for nb in NOTEBOOKS:
        text = nb.read_text()
        assert "format_name: percent" in text and "\n# %% [markdown]\n" in text, nb.name
        # Plots come from the project's API, not code copied into the notebook.
        assert "import matplotlib" not in text and "plots.plot_" in text, nb.name


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(nb, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "MPLBACKEND": "Agg", "LATSIM_NB_OUT": str(out)}
    env.pop("LATSIM_VALIDATE_DIR", None)
    r = subprocess.run([sys.executable, str(nb)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{nb.name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    pngs = sorted(out.rglob("*.png"))
    assert len(pngs) == EXPECTED_PNGS[nb.stem], (pngs, r.stdout[-3000:])
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)
    if nb.stem == "fidelity" and not HAS_TORCH:
        assert "SKIPPED" in r.stdout
