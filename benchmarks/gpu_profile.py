"""Profile real_engine on one GPU (an H200 for llama3-8b) and check its decode speed.

Run once on the rented machine:

    python3 benchmarks/gpu_profile.py                       # llama3-8b, cuda, -> profiles/
    python3 benchmarks/gpu_profile.py --model tiny --device cpu --out /tmp/p   # CPU check

Sections (each time-boxed; a failure is reported and the next section runs):

1. env: torch, device, memory bandwidth (device-to-device copy) -> the decode
   floor = weight bytes / bandwidth (one read of the weights per decode step);
2. build: the model (random bf16 weights, made on the device) and the engine;
3. decode check: decode steps at batch 1/8/32 (context 1024), eager and CUDA
   graph, their ratio to the floor, and graph-vs-eager logits agreement;
4. profile: the full grid through ``real_engine.profile.run_profile`` (graphs
   on unless the check failed) -> ``<out>/<gpu>-<model>.json``;
5. summary, also written to ``<out>/<gpu>-<model>.log``.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from real_engine.kv import to_device  # noqa: E402
from real_engine.model import resolve_config  # noqa: E402
from real_engine.profile import (build_engine, default_grid, hardware_name,  # noqa: E402
                                 hardware_slug, run_profile, setup_state, time_plan)

LINES: list[str] = []


def say(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    LINES.append(line)
    print(line, flush=True)


class SectionTimeout(Exception):
    pass


@contextmanager
def section(name: str, limit_s: float, results: dict):
    """Run a block with a wall-clock limit (SIGALRM); record ok / error / timeout."""
    def on_alarm(signum, frame):
        raise SectionTimeout(f"{name}: over {limit_s:.0f} s")

    say(f"== {name} (limit {limit_s:.0f} s)")
    t0 = time.perf_counter()
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, limit_s))
    try:
        yield
        results[name] = "ok"
    except BaseException as e:  # noqa: BLE001 - report everything, keep going
        if isinstance(e, KeyboardInterrupt):
            raise
        results[name] = f"FAILED: {type(e).__name__}: {e}"
        say(f"!! {name} failed: {type(e).__name__}: {e}")
        for ln in traceback.format_exc().splitlines()[-8:]:
            say("   " + ln)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        say(f"-- {name}: {time.perf_counter() - t0:.1f} s")


def bandwidth_gbs(device: str) -> float:
    """Device memory bandwidth from a large copy, counting bytes read plus written."""
    n = (1 << 30) if device.startswith("cuda") else (64 << 20)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    x.random_()   # not zeros (zeros can be served faster than real data)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    reps = 10
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            y.copy_(x)
        b.record()
        b.synchronize()
        s = a.elapsed_time(b) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            y.copy_(x)
        s = time.perf_counter() - t0
    return 2 * n * reps / s / 1e9


def kernel_breakdown(eng, batch: int = 1, context: int = 1024) -> dict:
    """GPU kernels of one eager decode step (the graph replays the same kernels):
    how many, their summed device time, and the heaviest, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    plan = setup_state(eng, batch, context)
    use = eng.use_graphs
    eng.use_graphs = False
    try:
        for _ in range(3):
            eng.execute(plan)
        cuda = eng.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            eng.execute(plan)
    finally:
        eng.use_graphs = use
        eng.clear()
    rows = []
    for e in prof.key_averages():
        if cuda:
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0.0)
        else:   # (a CPU run lists ops, not kernels: only to exercise this code)
            t = e.self_cpu_time_total
        if t > 0:
            rows.append((e.key, e.count, t / 1e3))
    rows.sort(key=lambda r: -r[2])
    total_ms = sum(r[2] for r in rows)
    n = sum(r[1] for r in rows)
    gemm_ms = sum(r[2] for r in rows if any(w in r[0].lower() for w in ("gemm", "gemv", "cutlass",
                                                                        "sm90", "xmma")))
    say(f"eager decode batch {batch} ctx {context}: {n} kernels, {total_ms:.2f} ms of kernel "
        f"time ({gemm_ms:.2f} ms in GEMM-like kernels)")
    for name, cnt, ms in rows[:12]:
        say(f"   {ms:7.3f} ms {cnt:5d}x  {name[:90]}")
    return {"batch": batch, "context": context, "kernels": n, "kernel_ms": round(total_ms, 3),
            "gemm_ms": round(gemm_ms, 3),
            "top": [(k[:90], c, round(t, 3)) for k, c, t in rows[:12]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="profiles")
    ap.add_argument("--quick", action="store_true", help="small grid, few repeats")
    ap.add_argument("--budget-s", type=float, default=270.0, help="total time budget")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                    help="decode CUDA graphs (on a CPU, 'on' runs the padded graph path "
                         "eagerly: a check of its logic)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    left = lambda: args.budget_s - (time.perf_counter() - t_start)  # noqa: E731
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {}
    info: dict = {"model": args.model, "device": args.device}
    cuda = args.device.startswith("cuda")
    ctx = {}

    with section("env", 60, res):
        say(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
            f"cuda available {torch.cuda.is_available()}")
        if cuda and not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch sees no GPU")
        info["hardware"] = hardware_name(args.device)
        say(f"hardware: {info['hardware']}")
        cfg = resolve_config(args.model)
        bw = bandwidth_gbs(args.device)
        elem = 2 if cuda else 4
        wbytes = cfg.num_params() * elem
        info.update(bandwidth_gbs=round(bw, 1), weight_gb=round(wbytes / 1e9, 2),
                    floor_ms=round(wbytes / (bw * 1e9) * 1e3, 3))
        if cuda:
            info["floor_ms_4300gbs"] = round(wbytes / 4.3e12 * 1e3, 3)
        say(f"copy bandwidth {bw:.0f} GB/s; weights {wbytes / 1e9:.2f} GB; "
            f"decode floor {info['floor_ms']:.2f} ms (one read of the weights)")

    with section("build", 120, res):
        cfg = resolve_config(args.model)
        grid = default_grid(cfg, args.device, args.quick)
        t0 = time.perf_counter()
        # Room for the grid and for the decode check (32 sequences of 1024 tokens).
        eng = build_engine(args.model, args.device,
                           num_blocks=max(grid.max_blocks(), 32 * 65) + 64,
                           cuda_graphs={"auto": None, "on": True, "off": False}[args.graphs])
        if cuda:
            torch.cuda.synchronize()
        ctx.update(engine=eng, grid=grid)
        say(f"model {cfg.name} ({cfg.num_params() / 1e9:.2f} B params, {eng.model.dtype}) and "
            f"{eng.cache.num_blocks} KV blocks ready in {time.perf_counter() - t0:.1f} s; "
            f"cuda graphs {'on' if eng.use_graphs else 'off'}"
            f"{'' if not eng.graphs or eng.graphs.capture else ' (emulated: padded, eager)'}")
        if cuda:
            say(f"GPU memory allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB")

    eng = ctx.get("engine")
    if eng is not None:
        with section("decode check", min(90, max(10, left() - 120)), res):
            eng.cache.randomize_(0)
            checks = {}
            for b in (1, 8, 32):
                row = {}
                plan = setup_state(eng, b, 1024)
                if eng.graphs is not None:
                    row["graph_ms"] = time_plan(eng, plan, 10, 3)["ms"]
                    if b == 8:
                        # Graph logits vs eager logits on the same state.
                        h = eng.host_step(plan)
                        eng.graphs.run(h)
                        bk = eng.graphs.bucket(b, h.num_pages)
                        g_logits = eng.graphs.logits(*bk)[:b].float()
                        with torch.no_grad():
                            e_logits = eng.model.logits(eng.model(
                                to_device(h, eng.cache, sample_all=True), eng.cache)).float()
                        err = ((g_logits - e_logits).norm() / e_logits.norm()).item()
                        agree = (g_logits.argmax(-1) == e_logits.argmax(-1)).float().mean().item()
                        row.update(graph_vs_eager_rel_err=round(err, 5), argmax_agree=agree)
                        if not err < 2e-2:
                            eng.use_graphs = False
                            say(f"!! graph logits differ from eager (rel err {err:.3g}): "
                                f"graphs disabled for the profile")
                use = eng.use_graphs
                eng.use_graphs = False
                row["eager_ms"] = time_plan(eng, plan, 5, 2)["ms"]
                eng.use_graphs = use
                best = row.get("graph_ms", row["eager_ms"])
                if "floor_ms" in info:
                    row["ratio_to_floor"] = round(best / info["floor_ms"], 2)
                checks[b] = row
                say(f"decode batch {b:2d} ctx 1024: {json.dumps(row)}")
            if eng.use_graphs:
                # Padded bucket: 5 rows -> 8, uneven contexts -> a larger block bucket.
                eng.clear()
                for r, c in enumerate((100, 517, 1024, 33, 2000)):
                    eng.install_running(r, c - 1, 2, prefilled=c - 1, generated=1)
                from simulator.model.scheduling import StepPlan
                h = eng.host_step(StepPlan(decode=tuple(range(5))))
                ids = eng.graphs.run(h).cpu()
                g_logits = eng.graphs.logits(*eng.graphs.bucket(5, h.num_pages))[:5].float()
                with torch.no_grad():
                    e_logits = eng.model.logits(eng.model(
                        to_device(h, eng.cache, sample_all=True), eng.cache)).float()
                err = ((g_logits - e_logits).norm() / e_logits.norm()).item()
                checks["padded5"] = {"rel_err": round(err, 5),
                                     "argmax_agree": (ids == e_logits.argmax(-1).cpu()).float()
                                     .mean().item()}
                say(f"padded graph check (batch 5, uneven contexts): {checks['padded5']}")
                if not err < 2e-2:
                    eng.use_graphs = False
                    say("!! padded graph differs from eager: graphs disabled for the profile")
            info["decode_check"] = checks
            eng.clear()

        budget = max(20.0, left() - 25)
        with section("profile", budget + 15, res):
            path = out / f"{hardware_slug(args.device)}-{cfg.name}.json"
            prof = run_profile(cfg.name, args.device, out=path, engine=eng, grid=ctx["grid"],
                               time_budget_s=budget, log=say)
            info["profile"] = str(path)
            info["profile_rows"] = {k: len(prof.get(k, ()))
                                    for k in ("prefill", "decode", "mixed", "decode_eager")}
            info["host_overhead_ms"] = prof["engine"]["host_overhead_ms"]
            info["cuda_graphs"] = prof["engine"]["cuda_graphs"]

        if cuda and left() > 20:
            with section("kernel breakdown", min(40, left() - 5), res):
                info["kernels"] = kernel_breakdown(eng)

    say("== summary")
    say(f"sections: {json.dumps(res)}")
    for k in ("hardware", "bandwidth_gbs", "weight_gb", "floor_ms", "floor_ms_4300gbs"):
        if k in info:
            say(f"{k}: {info[k]}")
    for b, row in (info.get("decode_check") or {}).items():
        say(f"decode batch {b}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    if "kernels" in info:
        kb = info["kernels"]
        say(f"decode step kernels: {kb['kernels']}, {kb['kernel_ms']} ms summed "
            f"({kb['gemm_ms']} ms GEMM-like)")
    for k in ("profile", "profile_rows", "cuda_graphs", "host_overhead_ms"):
        if k in info:
            say(f"{k}: {info[k]}")
    say(f"total {time.perf_counter() - t_start:.1f} s")
    slug = info.get("hardware") and hardware_slug(args.device) or "unknown"
    log_path = out / f"{slug}-{args.model.replace('/', '_')}.log"
    log_path.write_text("\n".join(LINES) + "\n" + json.dumps(info, indent=1, default=str) + "\n")
    print(f"log: {log_path}", flush=True)
    return 0 if all(v == "ok" for v in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
