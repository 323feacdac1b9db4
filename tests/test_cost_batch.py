"""``latsim cost --steps`` and ``simulator.cost.step_ms``: many steps priced with the model
set up once give exactly what one ``latsim cost`` call per step gives (the same
``step_time`` of the same constants: equal floats, not close ones), and a bad row is one
line naming file, line, column and value, exit 2, with nothing on stdout."""
from __future__ import annotations

import csv
import io
import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import REPO

ROOF = ["--model", "llama-2-70b", "--gpu", "a100-80gb", "--tp", "4"]
REFBENCH = REPO / "profiles" / "h200-llama3-8b-refbench.json"
STEPS = [("4x512", ""), ("", "16@1024"), ("2x256", "8@2048"), ("1", "1@1"), ("", "64@4000")]


def _cost(*args):
    """One ``latsim cost`` as a fresh call would run it (the cached model dropped)."""
    from simulator.cli.main import app
    from simulator.cost import steps
    steps._cost_model.cache_clear()
    return CliRunner().invoke(app, ["cost", *map(str, args)], env={"COLUMNS": "200"})


def _single(flags, pre, dec) -> dict:
    args = [*flags, "--json"] + (["--prefill", pre] if pre else []) + (
        ["--decode", dec] if dec else [])
    r = _cost(*args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _error(r) -> str:
    """The LatsimError a command invoked in this process raised (``main`` prints it as
    the one line, exit 2: the subprocess cases check that)."""
    from simulator.errors import LatsimError
    assert isinstance(r.exception, LatsimError), r.output
    return str(r.exception)


def _csv(tmp_path, rows, header="id,prefill,decode"):
    p = tmp_path / "steps.csv"
    p.write_text(header + "\n" + "".join(",".join(r) + "\n" for r in rows))
    return p


def test_batch_prices_each_step_as_a_single_call(tmp_path):
    path = _csv(tmp_path, [(f"s{i}", a, b) for i, (a, b) in enumerate(STEPS)])
    r = _cost(*ROOF, "--steps", path, "--terms")
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [row["id"] for row in rows] == [f"s{i}" for i in range(len(STEPS))]
    assert list(rows[0]) == ["id", "prefill", "decode", "ms", "step_fits", "compute", "memory",
                             "communication", "overhead", "bound"]
    for row, (pre, dec) in zip(rows, STEPS):
        one = _single(ROOF, pre, dec)
        assert float(row["ms"]) == one["ms"]   # CSV floats are repr(): they read back exactly
        for k in ("compute", "memory", "communication", "overhead"):
            assert float(row[k]) == one["terms"][k]
        assert row["bound"] == one["detail"]["bound"]
        assert row["step_fits"] == str(one["memory"]["step_fits"])
        assert row["prefill"] == ("1x1" if pre == "1" else pre) and row["decode"] == dec


def test_measured_profile_batch_and_stdin_json_lines():
    lines = ('{"decode": [8, 1024], "tag": "a"}\n\n{"prefill": {"prompts": 2, "tokens": 300}}\n'
             '{"prefill": "512", "decode": {"batch": 4, "context": 700}}\n')
    r = subprocess.run([sys.executable, "-m", "simulator.cli", "cost", "--profile",
                        str(REFBENCH), "--steps", "-", "--json"], input=lines,
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    out = [json.loads(s) for s in r.stdout.splitlines()]
    assert [o.get("tag") for o in out] == ["a", None, None]
    assert [(o["prefill"], o["decode"]) for o in out] == [("", "8@1024"), ("2x300", ""),
                                                          ("1x512", "4@700")]
    for o in out:
        assert o["ms"] == _single(["--profile", REFBENCH], o["prefill"], o["decode"])["ms"]
        assert "step_fits" not in o   # a measured model has no memory plan


def test_step_ms_api_scalars_and_arrays():
    from simulator.cost import step_ms
    cfg = dict(model="llama-2-70b", gpu="a100-80gb", tp=4)
    one = [_single(ROOF, a, b)["ms"] for a, b in STEPS[:3]]
    assert step_ms(prefill="4x512", **cfg) == one[0]
    assert step_ms(decode=(16, 1024), **cfg) == one[1]
    assert step_ms(prefill=(2, 256), decode="8@2048", **cfg) == one[2]
    got = step_ms(prefill=(np.array([4, 0, 2]), np.array([512, 0, 256])),
                  decode=(np.array([0, 16, 8]), np.array([0, 1024, 2048])), **cfg)
    assert isinstance(got, np.ndarray) and got.shape == (3,)
    assert got.tolist() == one
    # one side an array, the other broadcast: decode 16@1024 in each of two steps
    both = step_ms(prefill=([4, 2], [512, 256]), decode=(16, 1024), **cfg)
    assert both.tolist() == [_single(ROOF, "4x512", "16@1024")["ms"],
                             _single(ROOF, "2x256", "16@1024")["ms"]]
    from simulator.errors import LatsimError
    with pytest.raises(LatsimError, match="step 1"):
        step_ms(prefill=([1, 1], [512, 10**7]), **cfg)   # beyond llama-2-70b's 4,096


@pytest.mark.parametrize("rows,header,want", [
    ([("a", "4x512", ""), ("b", "4y512", "")], "id,prefill,decode",
     "steps.csv:3: column 'prefill': must look like NxL (N prompts of L tokens, e.g. 4x512) "
     "(got '4y512')"),
    ([("a", "", "16@"), ], "id,prefill,decode",
     "steps.csv:2: column 'decode': must look like B@C"),
    ([("a", "", "16@9000")], "id,prefill,decode",
     "steps.csv:2: column 'decode': a context of 9,000 tokens exceeds llama-2-70b's longest"),
    ([("a", "", "")], "id,prefill,decode", "steps.csv:2: no step: give prefill and/or decode"),
    ([("a", "1")], "id,steps", "steps.csv:1: needs a header with a 'prefill' and/or a 'decode' "
     "column (NxL, B@C) (got 'id,steps')"),
    ([("a", "", "1@1", "x")], "id,prefill,decode", "steps.csv:2: more cells than the 3"),
    ([("a", "", "1@1"), ("b", "", "3000000@1")], "id,prefill,decode",   # activations > HBM
     "steps.csv:3: llama-2-70b on 4 x a100-80gb (TP4 PP1, bf16 weights) does not fit"),
])
def test_a_bad_row_is_one_line_and_nothing_is_written(tmp_path, rows, header, want):
    path = _csv(tmp_path, rows, header)
    r = subprocess.run([sys.executable, "-m", "simulator.cli", "cost", *ROOF, "--steps",
                        str(path)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("latsim: error: "), r.stderr
    assert want in lines[0].replace(str(tmp_path) + "/", "")


def test_bad_json_line_and_option_clashes(tmp_path):
    from simulator.cli.main import app
    r = CliRunner().invoke(app, ["cost", *ROOF, "--steps", "-"],
                           input='{"decode": "1@1"}\n[1, 2]\n')
    assert "<stdin>:2: not a JSON object (got '[1, 2]')" in _error(r)
    path = _csv(tmp_path, [("a", "4x512", "")])
    r = _cost(*ROOF, "--steps", path, "--decode", "1@1")
    assert "--decode: is for one step; with --steps" in _error(r)
    r = _cost(*ROOF, "--out", tmp_path / "o.csv")
    assert "--out: goes with --steps FILE" in _error(r)


def test_out_file_and_force(tmp_path):
    path = _csv(tmp_path, [("a", "4x512", ""), ("b", "", "16@1024")])
    out = tmp_path / "priced.csv"
    assert _cost(*ROOF, "--steps", path, "--out", out).exit_code == 0
    first = out.read_text()
    assert first.splitlines()[0] == "id,prefill,decode,ms,step_fits"
    assert len(first.splitlines()) == 3
    r = _cost(*ROOF, "--steps", path, "--out", out)
    assert "exists" in _error(r)
    assert _cost(*ROOF, "--steps", path, "--out", out, "--force").exit_code == 0
    assert out.read_text() == first


def test_expert_and_data_parallel_options_price_what_the_config_prices():
    """``latsim cost --ep/--dp`` builds the roofline a ``model.cost`` with ``ep``/``dp``
    builds (the same step time, to the bit), and its refusals name the option."""
    from simulator.cost.roofline.model import RooflineCostModel
    mix = ["--model", "mixtral-8x7b", "--gpu", "h100-sxm"]
    for tp, dp, ep in ((8, 1, 8), (4, 2, 8)):
        got = _single([*mix, "--tp", tp, "--dp", dp, "--ep", ep], "", "64@1024")
        want = RooflineCostModel("mixtral-8x7b", "h100-sxm", tp, ep=ep, dp=dp)
        assert got["ms"] == want.step_time(64, 1024, 64 * 1024, []) * 1000.0
        assert (got["cost_model"]["ep"], got["cost_model"]["dp"]) == (ep, dp)
    for extra, flag in ((["--tp", 8, "--ep", 3], "--ep"), (["--tp", 2, "--dp", 2], "--ep"),
                        (["--tp", 8, "--ep", 0], "--ep")):
        msg = _error(_cost(*mix, *extra, "--decode", "8@100"))
        assert msg.startswith(f"{flag}:") and "\n" not in msg, msg
    msg = _error(_cost("--model", "llama-3-8b", "--gpu", "h100-sxm", "--tp", 2, "--ep", 2,
                       "--decode", "8@100"))
    assert msg.startswith("--ep:") and "dense" in msg
