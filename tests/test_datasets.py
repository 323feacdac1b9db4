"""The public data shipped in ``data/``: the registry (``simulator.datasets``), the index in
``data/README.md``, the files on disk and ``latsim data`` agree, and nothing the project
ships reads data from outside the repository."""
from __future__ import annotations

import json
import re

import pytest
import yaml
from typer.testing import CliRunner

from conftest import DATA, REPO
from simulator.datasets import DATA_DIR, DATASETS, NOT_DATA, markdown_table

BEGIN, END = "<!-- BEGIN latsim data --markdown -->", "<!-- END latsim data --markdown -->"


def test_registry_points_at_the_repository_data_folder():
    assert DATA_DIR == DATA
    names = [d.name for d in DATASETS]
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("ds", DATASETS, ids=lambda d: d.name)
def test_every_dataset_is_shipped_with_its_readme(ds):
    assert ds.exists(), f"data/{ds.path} is missing"
    assert ds.files() and ds.size_bytes() > 0, f"data/{ds.path} is empty"
    assert ds.readme and (DATA / ds.readme).is_file(), f"data/{ds.readme} is missing"
    assert ds.licence and ds.source and ds.what
    assert ds.extent == "whole" or ds.extent.startswith("slice: "), ds.extent


def test_readme_index_is_the_registry():
    text = (DATA / "README.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    block = text.split(BEGIN)[1].split(END)[0].strip()
    assert block == markdown_table(), ("data/README.md's index is out of date: paste "
                                       "`latsim data --markdown` between its markers")


def test_nothing_unlisted_is_shipped():
    owned = {f for d in DATASETS for f in d.files()}
    readmes = {DATA / d.readme for d in DATASETS}
    for f in sorted(p for p in DATA.rglob("*") if p.is_file()):
        rel = f.relative_to(DATA)
        if rel.parts[0] in NOT_DATA or f in readmes:
            continue
        assert f in owned, f"data/{rel} belongs to no dataset in simulator/datasets.py"
    # no file is counted twice
    assert sum(len(d.files()) for d in DATASETS) == len(owned)


def test_servegen_slices_are_as_documented():
    m_large = DATA / "servegen" / "language" / "m-large"
    traces = sorted(m_large.glob("chunk-*-trace.csv"))
    assert len(traces) == 162
    for p in traces:
        lines = p.read_text().splitlines()
        assert len(lines) == 144 and lines[-1].startswith("85800,"), p.name
    for c in (61, 143, 104, 34):
        keys = list(json.loads((m_large / f"chunk-{c}-dataset.json").read_text()))
        assert keys == ["0", "21600", "43200", "64800"], c
    assert sorted(p.name for p in m_large.glob("*-dataset.json")) == sorted(
        f"chunk-{c}-dataset.json" for c in (61, 143, 104, 34))
    r1 = DATA / "servegen" / "reason" / "deepseek-r1"
    assert len(list(r1.glob("chunk-*-trace.csv"))) == 73
    assert sorted(p.name for p in r1.glob("*-dataset.json")) == sorted(
        f"chunk-{c}-dataset.json" for c in (35, 48, 3))


def _scenario_data_paths(sc: dict):
    wl = sc.get("workload", {})
    if "path" in wl:
        yield wl["path"]
    if isinstance(wl.get("lengths_file"), dict):
        yield wl["lengths_file"]["path"]


def test_scenarios_read_shipped_data():
    used = 0
    for f in sorted((REPO / "scenarios").glob("*.yaml")):
        for rel in _scenario_data_paths(yaml.safe_load(f.read_text())):
            p = (f.parent / rel).resolve()
            assert p.is_relative_to(DATA), f"{f.name}: {rel} is outside data/"
            assert p.exists(), f"{f.name}: {rel} is missing"
            used += 1
    assert used >= 5


def test_nothing_reads_data_from_outside_the_repository():
    outside = re.compile(r"shared/data|\.\./shared|parents\[2\] / \"shared\"|"
                         r"parent / \"shared\"")
    files = [*(REPO / "scenarios").glob("*.yaml"), *(REPO / "notebooks").glob("*.py"),
             *(REPO / "tests").glob("*.py"), REPO / "README.md", REPO / "profiles" / "README.md",
             REPO / "tests" / "data" / "README.md"]
    for f in files:
        if f.name == "test_datasets.py":
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            assert not outside.search(line), f"{f.relative_to(REPO)}:{i}: {line.strip()}"


def test_latsim_data_lists_every_dataset():
    from simulator.cli.main import app
    r = CliRunner().invoke(app, ["data"])
    assert r.exit_code == 0, r.output
    for d in DATASETS:
        assert f"{d.name}  data/{d.path}  " in r.output and d.licence in r.output
        assert d.source in r.output
    assert "MISSING" not in r.output
    r = CliRunner().invoke(app, ["data", "--markdown"])
    assert r.exit_code == 0 and r.output.strip() == markdown_table()


def test_latsim_data_fails_on_a_missing_dataset(tmp_path):
    from simulator.cli.main import app
    from simulator.errors import LatsimError
    (tmp_path / "azure_llm_2023").mkdir()
    r = CliRunner().invoke(app, ["data", "--dir", str(tmp_path)])
    assert isinstance(r.exception, LatsimError) and "missing: azure-code" in str(r.exception)
    assert "MISSING" in r.output
