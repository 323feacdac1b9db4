"""How long ``GET /health`` of ``latsim serve`` takes while a burst of streams runs.

Starts ``latsim serve --model tiny`` on a free loopback port in its own process (warmed
up by two requests), opens ``--streams`` streamed completions at once (raw sockets, one
asyncio client in another process, so the client's own work does not share the server's
GIL), and meanwhile a third process times ``GET /health`` on a kept-alive connection
every 20 ms. Prints the probe's median, p99 and max and how many streams completed; and,
from inside the server (``_as_server``), each event-loop iteration's CPU time (what a
``/health`` waits behind, less sensitive to other processes than the wall clock; on a
VM, time stolen by the host can still count) and its garbage collections by generation.
A wall-clock figure: it depends on the machine and its load (run it on a quiet one),
which is why it is here and not in the tests (``tests/test_serve_api.py`` and
``tests/test_serve_streams.py`` check the mechanisms structurally: /health answered
while the engine is held mid-step, the hand-over in slices, the admission gate, the
frozen start-up heap).

    python benchmarks/serve_health.py --streams 300 --max-tokens 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


async def _one(port: int, body: bytes) -> bool:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
            + body)
    data = b""
    while True:
        d = await r.read(65536)
        if not d:
            break
        data += d
    w.close()
    return b"[DONE]" in data


def _burst(port: int, n: int, prompt: int, max_tokens: int, out) -> None:
    body = json.dumps({"prompt": "w " * prompt, "max_tokens": max_tokens,
                       "stream": True}).encode()

    async def main():
        return await asyncio.gather(*(_one(port, body) for _ in range(n)))
    t0 = time.perf_counter()
    done = asyncio.run(main())
    out.put((sum(done), time.perf_counter() - t0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=300)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--serve-args", default="",
                    help="more `latsim serve` flags, e.g. '--threads 1'")
    a = ap.parse_args()
    from serveproc import get_when_up, serve_process, stop
    proc, port = serve_process({}, "--model", "tiny", "--max-num-seqs",
                               str(a.max_num_seqs), "--num-blocks", "4096",
                               *a.serve_args.split(), runner=[__file__, "--as-server"])
    try:
        assert get_when_up(port, "/health").status_code == 200
        # Warm: first calls import and allocate; a serving server is past them.
        import httpx
        for stream in (False, True):
            assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                              json={"prompt": "w w", "max_tokens": 4,
                                    "stream": stream}).status_code == 200
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGUSR1)
        q1, q2 = mp.Queue(), mp.Queue()
        burst = mp.Process(target=_burst, args=(port, a.streams, a.prompt, a.max_tokens, q1))
        burst.start()
        probe = mp.Process(target=_probe_until, args=(port, burst.pid, q2))
        probe.start()
        done, wall = q1.get()
        burst.join()
        times = q2.get()
        probe.join()
    finally:
        err = stop(proc)
    loop = [json.loads(ln.split(" ", 1)[1]) for ln in err.splitlines()
            if ln.startswith("LOOPSTATS ")]
    start = times[0][1] if times else 0.0
    worst = sorted(times, reverse=True)[:3]
    times = sorted(t for t, _ in times)
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    print(f"{a.streams} streams x {a.max_tokens} tokens: {done} completed in {wall:.2f} s; "
          f"/health x{len(times)}: median {statistics.median(times) * 1e3:.1f} ms, "
          f"p99 {p99 * 1e3:.1f} ms, max {times[-1] * 1e3:.1f} ms; worst at "
          + ", ".join(f"{(t0 - start):.1f} s ({t * 1e3:.0f} ms)" for t, t0 in worst)
          + " into the burst")
    if loop:
        it = loop[0]
        print(f"event loop: {it['iterations']} iterations busier than 0.1 ms CPU, "
              f"{it['cpu_s']:.2f} s CPU in all; per iteration CPU p50 {it['p50_ms']:.2f} ms, "
              f"p99 {it['p99_ms']:.1f} ms, max {it['max_ms']:.1f} ms (what a /health waits "
              f"behind on an idle box, whatever the load on this one); garbage "
              f"collections by generation (count, longest ms): "
              + ", ".join(f"{g}: {n} ({t:.1f})" for g, (n, t) in it["gc"].items()))


def _as_server(args: list) -> None:
    """``latsim serve ARGS`` with each event-loop iteration's CPU time recorded (the main
    thread's ``time.thread_time``: its own work, not the time other processes or the
    engine thread took the CPU or the GIL from it); printed to stderr at exit."""
    import atexit
    import os
    import signal
    from asyncio import base_events

    import gc
    cpu, gcs, gc_t0 = [], [], [0.0]
    run_once = base_events.BaseEventLoop._run_once

    def on_gc(phase, info):
        if phase == "start":
            gc_t0[0] = time.thread_time()
        else:
            gcs.append((info["generation"], time.thread_time() - gc_t0[0]))
    gc.callbacks.append(on_gc)

    def timed(self):
        c0 = time.thread_time()
        run_once(self)
        c = time.thread_time() - c0
        if c > 1e-4:
            cpu.append(c)

    def report():
        import numpy as np
        if cpu:
            ms = np.array(cpu) * 1e3

            sys.stderr.write("LOOPSTATS " + json.dumps(
                {"iterations": len(ms), "cpu_s": float(ms.sum() / 1e3),
                 "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                 "max_ms": float(ms.max()),
                 "gc": {g: [sum(1 for k, _ in gcs if k == g),
                            max([t * 1e3 for k, t in gcs if k == g] or [0.0])]
                        for g in (0, 1, 2)}}) + "\n")
    base_events.BaseEventLoop._run_once = timed
    atexit.register(report)
    # uvicorn ends on SIGTERM by raising it again once shut down (no atexit): report then.
    signal.signal(signal.SIGTERM, lambda *_: (report(), os._exit(0)))
    # Warmed up: count from here.
    signal.signal(signal.SIGUSR1, lambda *_: (cpu.clear(), gcs.clear()))
    from simulator.cli.main import main as cli
    sys.argv = ["latsim", *args]
    cli()


def _probe_until(port: int, pid: int, out) -> None:
    """Time ``GET /health`` every 20 ms until process ``pid`` (the burst) has exited."""
    import os

    import httpx
    times = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        c.get("/health")
        while True:
            try:
                os.kill(pid, 0)
            except OSError:
                break
            t0 = time.perf_counter()
            r = c.get("/health")
            times.append((time.perf_counter() - t0, t0))
            assert r.status_code == 200
            time.sleep(0.02)
    out.put(times)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--as-server"]:
        _as_server(sys.argv[2:])
    else:
        main()
