"""Measure the engine's step costs into a ``latsim-profile/1`` JSON (profiles/README.md).

Each row times one full engine step -- ``EngineCore.execute(plan)``: building
the packed step on the host, copying it to the device, the forward, the LM head
and argmax of the sampled rows, and the copy of the ids to the host -- on a
state built for the row (``install_running``). It is the code path ``step()``
runs, CUDA graphs included, so the profile describes the engine that serves.
Rows: prefill (one chunk that completes its prompt, after ``prior`` cached
tokens), decode (``batch`` sequences each attending to ``context`` tokens), and
mixed (a decode batch plus one prefill chunk).

Timing: warm-up runs first (they also capture CUDA graphs), then ``repeats``
timed runs; on CUDA the device is synchronized before each run and CUDA events
bracket it (the step ends with a device-to-host copy, so nothing is pending at
its end); on the CPU ``perf_counter`` brackets it. Rows report the median and
p10/p90/mean/min in ms. The KV cache is filled with random values first.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from simulator.model.kv.blocks import request_blocks
from simulator.model.kv.space import KVRules
from simulator.model.policies.priority_aging import DEFAULT_AGING_S
from simulator.model.scheduling import StepPlan, make_policy

from real_engine.engine import EngineCore
from real_engine.model import ModelConfig, Transformer, build_model, resolve_config

FORMAT = "latsim-profile/1"
DECODE_BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def build_engine(model: str | ModelConfig | Transformer = "tiny", device: str = "cpu", *,
                 policy: str = "chunked", dtype: Optional[torch.dtype] = None, seed: int = 0,
                 num_blocks: Optional[int] = None, cuda_graphs: Optional[bool] = None,
                 graph_max_batch: int = 64, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, chunk_size: Optional[int] = None,
                 aging_s: float = DEFAULT_AGING_S, threads: Optional[int] = None,
                 kv_rules: Optional[KVRules] = None,
                 swap_blocks: Optional[int] = None) -> EngineCore:
    """A model (preset, config, checkpoint dir, or built) behind a policy by name.

    ``threads`` sets torch's CPU threads (process-wide); profile and serve with
    the same value. CUDA graphs default to on for CUDA devices. ``kv_rules`` and
    ``swap_blocks``: KV memory (default ``KVRules()``: paged, recompute, no prefix
    caching; see ``EngineCore``).
    """
    if threads:
        torch.set_num_threads(threads)
    m = model if isinstance(model, Transformer) else build_model(model, device, dtype, seed)
    pol = make_policy(policy, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, chunk_size=chunk_size,
                      aging_s=aging_s)
    return EngineCore(m, pol, num_blocks=num_blocks, cuda_graphs=cuda_graphs,
                      kv_rules=kv_rules or KVRules(), swap_blocks=swap_blocks,
                      graph_max_batch=graph_max_batch, seed=seed)


@dataclass
class Grid:
    """What to measure. ``mixed`` rows are (batch, context, chunk, prior);
    ``eager_decode`` rows (batch, context) time decode steps with CUDA graphs off
    (what the decodes of a mixed step cost); only measured where graphs are on."""

    prefill_chunks: tuple
    prefill_priors: tuple
    decode_batches: tuple
    decode_contexts: tuple
    mixed: tuple = ()
    repeats: int = 10
    warmup: int = 3
    eager_decode: tuple = ()

    def max_blocks(self, block_size: int = 16) -> int:
        """KV blocks the largest row needs: its requests (``row_requests``, as
        ``setup_state`` installs them) each reserve prompt + output."""
        def need(**row) -> int:
            return sum(request_blocks(p, o, block_size) for p, o, _, _ in row_requests(**row))
        rows = ([dict(chunk=c, prior=p, final=f) for c in self.prefill_chunks
                 for p in self.prefill_priors for f in (True, False)]
                + [dict(batch=b, context=x) for b in self.decode_batches
                   for x in self.decode_contexts]
                + [dict(batch=b, context=x) for b, x in self.eager_decode]
                + [dict(batch=b, context=x, chunk=c, prior=p) for b, x, c, p in self.mixed])
        return max(need(**r) for r in rows)


def default_grid(cfg: ModelConfig, device: str, quick: bool = False) -> Grid:
    """A grid scaled to the model and device: tiny/small on a CPU in minutes, an 8B
    model on an H200 in a few minutes."""
    dev = torch.device(device).type
    if dev == "cuda":
        if quick:
            return Grid((1, 64, 512, 2048), (0, 2048), (1, 8, 12, 32, 64), (256, 2048),
                        ((8, 1024, 128, 0), (32, 1024, 512, 0)), repeats=5, warmup=2)
        # Steps with a prefill chunk run eager (no graph), so mixed steps get a grid
        # of their own: chunked prefill serves mostly those.
        mixed = tuple((b, 1024, c, 0) for b in (1, 8, 32, 64) for c in (64, 256, 512)) + \
            ((16, 2048, 256, 1024), (48, 512, 512, 3072))
        return Grid((1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), (0, 1024, 3072),
                    DECODE_BATCHES, (128, 512, 1024, 2048, 4096), mixed,
                    repeats=10, warmup=3,
                    eager_decode=tuple((b, x) for x in (512, 2048) for b in (1, 4, 8, 16, 32, 64)))
    big = cfg.d_model >= 1024 or cfg.n_layers > 8
    if quick or big:
        # Quick, or a large model on a CPU: a coarse grid, few repeats.
        return Grid((1, 16, 64, 256), (0, 256), (1, 4, 12, 32), (32, 256),
                    ((4, 128, 64, 0), (12, 256, 64, 128)), repeats=3, warmup=1,
                    eager_decode=((4, 256),))
    if cfg.d_model <= 128:   # tiny
        return Grid((1, 16, 32, 64, 128, 256, 512), (0, 512), DECODE_BATCHES, (16, 128, 512),
                    ((8, 128, 32, 0), (8, 128, 128, 0), (32, 128, 64, 0), (32, 512, 128, 256)),
                    repeats=7, warmup=2)
    return Grid((1, 16, 32, 64, 128, 256, 512, 1024), (0, 1024), DECODE_BATCHES,
                (128, 512, 1024),
                ((8, 512, 64, 0), (8, 512, 256, 0), (32, 512, 64, 0), (32, 512, 256, 1024)),
                repeats=5, warmup=2)


# -- timing -----------------------------------------------------------------------

def _stats(ms: list) -> dict:
    a = np.asarray(ms, dtype=np.float64)
    r = lambda v: round(float(v), 4)  # noqa: E731
    return {"ms": r(np.median(a)), "p10": r(np.percentile(a, 10)), "p90": r(np.percentile(a, 90)),
            "mean": r(a.mean()), "min": r(a.min()), "n": int(a.size)}


def time_plan(engine: EngineCore, plan: StepPlan, repeats: int, warmup: int) -> dict:
    """Time ``engine.execute(plan)``: warm-up runs, then ``repeats`` timed ones."""
    cuda = engine.device.type == "cuda"
    for _ in range(warmup):
        engine.execute(plan)
    ms = []
    graphed = False
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            _, graphed = engine.execute(plan)
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            _, graphed = engine.execute(plan)
            ms.append((time.perf_counter() - t0) * 1e3)
    out = _stats(ms)
    out["graphed"] = graphed
    return out


def setup_state(engine: EngineCore, batch: int = 0, context: int = 0, chunk: int = 0,
                prior: int = 0, final: bool = True) -> StepPlan:
    """Fresh state for a row: ``batch`` decoders attending to ``context`` tokens
    each, and one request whose ``chunk`` completes its prompt after ``prior`` (or,
    with ``final=False``, leaves one prompt token for later: no LM head, no sample)."""
    engine.clear()
    for r, (p, o, done, gen) in enumerate(row_requests(batch, context, chunk, prior, final)):
        engine.install_running(r, p, o, prefilled=done, generated=gen)
    prefill = ((batch, chunk),) if chunk else ()
    return StepPlan(decode=tuple(range(batch)), prefill=prefill)


def row_requests(batch: int = 0, context: int = 0, chunk: int = 0, prior: int = 0,
                 final: bool = True) -> list:
    """The requests of a profile row's state (``setup_state``), each ``(prompt,
    output, prefilled, generated)``: ``batch`` decoders, then the chunk's request."""
    # A decoder's prompt is context-1 plus its first sampled token: the decode input
    # sits at position context-1 and attends to `context` entries.
    out = [(context - 1, 2, context - 1, 1)] * batch
    if chunk:
        out.append((prior + chunk + (0 if final else 1), 1, prior, 0))
    return out


def time_step_components(engine: EngineCore, batch: int = 32, context: int = 256,
                         steps: int = 20) -> dict:
    """Medians (ms) of the parts of real ``EngineCore.step()`` calls.

    ``decode``: ``steps`` steps of ``batch`` decoders (graphed where the engine
    graphs): schedule (policy), prepare (host step + copies), issue (launching
    the forward), sync (waiting for the ids), apply (bookkeeping), total.
    ``smallest``: a one-token prefill, eager: its prepare + issue is the fixed
    host cost of an eager step (``host_overhead_ms``); on a CPU, where issuing
    is computing, its total is used instead.
    """
    def run(n_steps):
        rows = []
        for _ in range(n_steps):
            r = engine.step()
            t = {k: v * 1e3 for k, v in r.timings.items()}
            t["total"] = r.wall_s * 1e3
            rows.append(t)
        return {k: round(float(np.median([r.get(k, 0.0) for r in rows])), 4) for k in rows[0]}

    engine.clear()
    for r in range(batch):
        engine.install_running(r, context - 1, steps + 5, prefilled=context - 1, generated=1)
    engine.step()   # warm-up (captures the graph bucket if any)
    decode = run(steps)
    use = engine.use_graphs
    engine.use_graphs = False
    rows = []
    try:
        for i in range(steps):
            engine.clear()
            engine.add_request(10_000 + i, 1, 1)
            rows.append(engine.step())
    finally:
        engine.use_graphs = use
        engine.clear()
    t = rows[2:] or rows
    med = lambda k: float(np.median([r.timings[k] for r in t])) * 1e3  # noqa: E731
    smallest = {k: round(med(k), 4) for k in ("schedule", "prepare", "issue", "sync", "apply")}
    smallest["total"] = round(float(np.median([r.wall_s for r in t])) * 1e3, 4)
    cuda = engine.device.type == "cuda"
    host = smallest["prepare"] + smallest["issue"] if cuda else smallest["total"]
    return {"decode": decode, "decode_batch": batch, "decode_context": context,
            "smallest": smallest, "host_overhead_ms": round(host, 4),
            "bookkeeping_ms": round(decode["schedule"] + decode["apply"], 4)}


# -- the profile ---------------------------------------------------------------------

def hardware_name(device: str) -> str:
    """A human-readable name of the device the profile ran on."""
    dev = torch.device(device)
    cores = os.cpu_count()
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        return f"{p.name} {p.total_memory / 2**30:.0f} GiB ({p.multi_processor_count} SMs), " \
               f"{cores} host cores"
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {cores} cores, torch threads {torch.get_num_threads()}"


def hardware_slug(device: str) -> str:
    """Short name for file names: 'h200' for an NVIDIA H200, 'cpu' on the CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(dev).lower().replace("nvidia", "").strip()
    return (name.split() or ["gpu"])[0]


def run_profile(model: str | ModelConfig = "tiny", device: str = "cpu",
                out: Optional[str | os.PathLike] = None, quick: bool = False,
                repeats: Optional[int] = None, warmup: Optional[int] = None, *,
                engine: Optional[EngineCore] = None, grid: Optional[Grid] = None,
                seed: int = 0, cuda_graphs: Optional[bool] = None,
                time_budget_s: Optional[float] = None,
                log: Callable[[str], None] = lambda s: print(s, flush=True)) -> dict:
    """Profile ``model`` on ``device``; returns the profile dict and writes it to ``out``.

    ``out``: a ``.json`` path, or a directory (file ``<hardware>-<model>.json``), or
    None (not written). ``engine``: reuse a built engine (its model must be
    ``model``); otherwise one is built with enough KV blocks for the grid.
    ``time_budget_s``: rows left when it runs out are skipped (noted in meta).

    Long, as one timed session: the grid's row kinds (prefill, partial prefill, decode,
    eager decode, mixed) share the warmed engine, the clock budget and the log, and
    are measured in one fixed order so that profiles from different machines compare.
    """
    t_start = time.perf_counter()
    cfg = engine.model.cfg if engine is not None else resolve_config(model)
    grid = grid or default_grid(cfg, device, quick)
    if repeats:
        grid.repeats = repeats
    if warmup is not None:
        grid.warmup = warmup
    if engine is None:
        engine = build_engine(model, device, seed=seed, cuda_graphs=cuda_graphs,
                              num_blocks=grid.max_blocks() + 64)
    elif engine.cache.num_blocks < grid.max_blocks():
        raise ValueError(f"engine has {engine.cache.num_blocks} KV blocks, the grid needs "
                         f"{grid.max_blocks()}")
    engine.cache.randomize_(seed)
    deadline = t_start + time_budget_s if time_budget_s else None
    skipped = 0

    def measure(kind: str, row: dict, plan: StepPlan) -> Optional[dict]:
        nonlocal skipped
        if deadline and time.perf_counter() > deadline:
            skipped += 1
            return None
        r = time_plan(engine, plan, grid.repeats, grid.warmup)
        graphed = r.pop("graphed")
        row = {**row, **r}
        keys = {k: v for k, v in row.items() if k in ("chunk", "prior", "batch", "context")}
        log(f"  {kind:7s} {json.dumps(keys)} {row['ms']:.3f} ms{' (graph)' if graphed else ''}")
        return row

    prefill, decode, mixed = [], [], []
    log(f"profile {cfg.name} on {device}: prefill")
    for p in grid.prefill_priors:
        for c in grid.prefill_chunks:
            r = measure("prefill", {"chunk": c, "prior": p}, setup_state(engine, chunk=c, prior=p))
            if r:
                prefill.append(r)
    # A chunk that does not complete its prompt skips the LM head and the sample; chunked
    # prefill runs many such chunks, so measure them too (at no cached prefix).
    partial = []
    for c in grid.prefill_chunks:
        r = measure("partial", {"chunk": c, "prior": 0},
                    setup_state(engine, chunk=c, prior=0, final=False))
        if r:
            partial.append(r)
    log("decode")
    for x in grid.decode_contexts:
        for b in grid.decode_batches:
            r = measure("decode", {"batch": b, "context": x}, setup_state(engine, b, x))
            if r:
                decode.append(r)
    log("mixed")
    for b, x, c, p in grid.mixed:
        r = measure("mixed", {"batch": b, "context": x, "chunk": c, "prior": p},
                    setup_state(engine, b, x, c, p))
        if r:
            mixed.append(r)
    eager = []
    if engine.use_graphs and grid.eager_decode:
        log("decode, eager (graphs off: as inside a mixed step)")
        engine.use_graphs = False
        try:
            for b, x in grid.eager_decode:
                r = measure("eager", {"batch": b, "context": x}, setup_state(engine, b, x))
                if r:
                    eager.append(r)
        finally:
            engine.use_graphs = True
    comp = time_step_components(engine, batch=min(32, max(grid.decode_batches)),
                                context=min(grid.decode_contexts))
    log(f"step components: {json.dumps(comp)}")
    # The fixed cost of an eager step: the cheapest prefill-only step measured (on a GPU
    # that is host launch time; on a CPU all work is host work).
    host_ms = min((r["ms"] for r in prefill), default=comp["host_overhead_ms"])
    engine.clear()
    eng = engine.model
    timer = ("CUDA events after a synchronize" if engine.device.type == "cuda"
             else "perf_counter")
    notes = (f"real_engine: token-packed forward, paged KV (block 16), greedy argmax of "
             f"sampled rows copied to host each step. Each row times EngineCore.execute "
             f"(host step build + copies + forward + LM head + argmax + copy to host); "
             f"{timer}, {grid.warmup} warm-up, {grid.repeats} repeats. Prefill rows: one "
             f"chunk that completes its prompt (samples its first token). Decode context = KV entries "
             f"each sequence attends to, the new token included."
             + (f" {skipped} rows skipped: time budget ran out." if skipped else ""))
    graphs = engine.graphs is not None and engine.use_graphs
    prof = {
        "format": FORMAT,
        "meta": {"hardware": hardware_name(device), "source": "real_engine profile",
                 "model": cfg.shape_dict(),
                 "dtype": {torch.bfloat16: "bf16", torch.float16: "fp16",
                           torch.float32: "fp32"}.get(eng.dtype, str(eng.dtype)),
                 "torch": torch.__version__, "date": _dt.date.today().isoformat(),
                 "threads": torch.get_num_threads(),
                 "wall_s": round(time.perf_counter() - t_start, 1), "notes": notes},
        "engine": {"decode_attention": "paged", "kv_block_size": engine.cache.block_size,
                   "cuda_graphs": bool(engine.use_graphs and engine.graphs.capture),
                   "host_overhead_ms": round(host_ms, 4),
                   "eager_steps": "any step with a prefill chunk, and decode steps beyond the "
                                  "graph buckets" if engine.use_graphs else "all",
                   "bookkeeping_ms": comp["bookkeeping_ms"],
                   # None without graphs: the profile loader refuses anything but a list
                   # of batch sizes there (``False`` was written on CPU, then refused).
                   "graph_batch_buckets": list(engine.graphs.batch_buckets) if graphs else None,
                   "graph_page_buckets": graphs and "pages of 64 tokens: 4, 6, 8, 12, 16, 24, "
                                                    "... (x1.5, x1.33)",
                   "step_components": comp},
        "prefill": prefill, "decode": decode, "mixed": mixed,
    }
    if eager:
        prof["decode_eager"] = eager
    if partial:
        prof["prefill_partial"] = partial
    if out is not None:
        path = Path(out)
        if path.suffix != ".json":
            path = path / f"{hardware_slug(device)}-{cfg.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        from simulator.report.files import StagedFile
        with StagedFile(path) as staged:     # whole or not at all: never a 0-byte profile
            staged.path.write_text(json.dumps(prof, indent=1) + "\n")
        log(f"wrote {path} ({time.perf_counter() - t_start:.1f} s)")
    return prof
