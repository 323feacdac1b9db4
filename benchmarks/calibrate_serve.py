"""``latsim bench`` against ``latsim serve`` (tiny model, CPU, loopback), then ``latsim
calibrate`` on what bench wrote: how well the replay follows a run timed on this
machine's CPUs, and whether calibration moves the busy time toward the measured one.

A wall-clock figure: a loaded box stalls the client, whose token times then contradict
the replay (calibrate exits 1, "could not follow the run"), which is why this is here
and not in the tests. ``tests/test_calibrate.py`` calibrates a run recorded by this
script (``--record``: ``tests/data/tiny_serve_bench/``), and checks
live only what load cannot change (bench against serve writes a run calibrate reads).

    python benchmarks/calibrate_serve.py                      # prints the figures
    python benchmarks/calibrate_serve.py --record tests/data/tiny_serve_bench

The set-up (server flags, bench flags, the scenario and the starting guess) is the
test's own (``tests/test_calibrate.py``: ``SERVE_ARGS``, ``BENCH_ARGS``), so a
re-recording is what the test expects.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", type=Path, default=None,
                    help="copy the bench run (requests.csv, tokens.csv, summary.json) here")
    a = ap.parse_args()
    import httpx

    from serveproc import serve_process, stop
    from test_calibrate import BENCH_ARGS, SERVE_ARGS, _tiny_guess, _tiny_scenario, latsim
    tmp = Path(tempfile.mkdtemp(prefix="latsim-calserve-"))
    scen = _tiny_scenario(tmp / "tiny.yaml", _tiny_guess(tmp / "guess.json"))
    proc, port = serve_process({}, *SERVE_ARGS)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(3):      # first-call allocations, outside the recorded run
                c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 4})
        code, text = latsim("bench", "--url", url, *BENCH_ARGS, "--out", tmp / "bench")
    finally:
        stop(proc)
    if code != 0:
        sys.exit(f"bench failed:\n{text}")
    code, text = latsim("calibrate", scen, "--run", tmp / "bench", "--out", tmp / "cal.json")
    print(text)
    if code == 0:
        rep = json.loads((tmp / "cal.json").read_text())["meta"]["calibration"]["runs"][0]
        chk = rep["replay_check"]
        print(f"replay: {chk['conflicts']} of {chk['anchored_steps']} anchored steps "
              f"contradict the recorded times; busy bias "
              f"{rep['step_errors_before']['busy_bias']:+.3f} -> "
              f"{rep['step_errors_after']['busy_bias']:+.3f}; load average "
              f"{os.getloadavg()[0]:.1f}")
    if a.record is not None:
        if code != 0:
            sys.exit("not recorded: calibrate did not follow this run (a loaded box?)")
        a.record.mkdir(parents=True, exist_ok=True)
        for name in ("requests.csv", "tokens.csv", "summary.json"):
            shutil.copy(tmp / "bench" / name, a.record / name)
        print(f"recorded the run in {a.record}")
    shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
