"""``latsim serve`` in its own process, for tests that talk to it as a client would:
``serve_process`` starts it on a free port (returns the process and the port its banner
names), ``stop`` ends it (returns its stderr), ``get_when_up`` GETs once it answers.

A server in the test's own process shares its GIL with the client: a client timing token
frames sees them late by whatever the server's threads hold (tests/test_calibrate.py's
bench run: 3-10 token times out of step order in-process, 0-3 in a server process)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

READ_S = 30.0        # socket read safety net: only a broken server gets near it


def serve_process(extra_env: dict, *args: str, runner=None):
    """``latsim serve --port 0 ARGS`` in a subprocess; returns it and its banner's port.
    ``runner``: what Python runs instead of the CLI (a script and its first arguments,
    which must pass the rest to the CLI: ``benchmarks/serve_health.py`` instruments the
    server's event loop so)."""
    env = {k: v for k, v in os.environ.items() if k != "LATSIM_API_KEY"}
    env.update(PYTHONUNBUFFERED="1", **extra_env)
    run = runner or ["-c", "from simulator.cli.main import main; main()"]
    proc = subprocess.Popen([sys.executable, *run, "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    t_end = time.monotonic() + 120
    port = None
    while port is None:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, f"serve exited: {proc.stderr.read()}"
        assert time.monotonic() < t_end, "no banner from latsim serve"
        if line.startswith("latsim serve:"):
            port = int(line.rsplit(":", 1)[1].split("/")[0])
    return proc, port


def stop(proc) -> str:
    """End the server; its stderr."""
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def get_when_up(port: int, path: str, headers=None, bound: float = 60.0):
    """GET once the server accepts connections (it binds before the engine is built)."""
    t_end = time.monotonic() + bound
    while True:
        try:
            return httpx.get(f"http://127.0.0.1:{port}{path}", headers=headers, timeout=READ_S)
        except httpx.TransportError:
            assert time.monotonic() < t_end, f"nothing answers on port {port}"
            time.sleep(0.1)
