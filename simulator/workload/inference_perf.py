"""inference-perf traffic as a latsim workload (``kind: inference_perf``): the requests
that the Kubernetes SIG load generator (kubernetes-sigs/inference-perf) sends for a
``data.type: shared_prefix`` workload under ``load.type: constant`` (or ``poisson``)
stages, so that a run it recorded is replayed without a hand-made trace.

What the generator does, read from its source at commit
3b6f82a03d75212b06c5e0bdef7710b04c033300 (2025-11-07, the last before the trace load
generator of ad40050: the version whose resolved ``config.yaml`` the runs in
``data/vllm-h100-runs`` carry; files ``inference_perf/config.py``,
``datagen/shared_prefix_datagen.py``, ``loadgen/load_timer.py``,
``loadgen/load_generator.py``, ``apis/completion.py``, ``reportgen/base.py``):

- **Prompts.** ``num_groups`` system prompts of ``system_prompt_len`` random token ids,
  each with ``num_prompts_per_group`` questions of ``question_len`` random ids; the
  ids are decoded to text and joined as ``system + " " + question``. The
  ``num_groups x num_prompts_per_group`` prompts are shuffled once, and request ``j``
  of *every* stage sends prompt ``j mod (number of prompts)``. So a whole prompt
  repeats every ``num_groups x num_prompts_per_group`` requests (prefix caching then
  holds it all but the last partial block), and the requests of one group share
  their system prompt's blocks.
- **Keys it does not know are ignored.** The config is a pydantic model without
  ``extra='forbid'``, merged over its defaults: ``num_unique_system_prompts``,
  ``num_users_per_system_prompt`` and ``enable_multi_turn_chat`` (aliases and
  multi-turn added later, 4f57a0b and 4ec6bfd) are dropped, leaving the defaults 10
  and 10 (the recordings' ``results/config.yaml`` show exactly that). ``aliases:
  true`` reads the alias names as the later versions do; multi-turn chat is not
  modelled (refused).
- **Arrivals.** A constant stage of ``rate`` for ``duration`` s sends
  ``int(rate x duration)`` requests at gaps drawn exponential(1/rate) and then
  scaled so they sum to ``duration`` exactly: Poisson-like spacing, not even, with the
  last request at the stage's end. A ``poisson`` stage draws a Poisson count for each
  second and spaces that count the same way within the second.
- **Stages.** The generator waits until every request of a stage has finished
  (polling each second), sleeps ``load.interval`` (1 s by default), and starts the
  next stage's clock 1 s later. Arrivals here are fixed before the simulation, so the
  gap before a stage is ``stage_gap_s`` (default ``interval + 1`` s, the least the
  generator leaves after a drained stage) after the previous stage's end: where the
  simulated server has not drained by then, the stages overlap as the real ones
  did not.
- **Lengths.** The server sees the re-tokenised text: random ids decoded and
  encoded again come out longer (Llama-2's tokenizer: about 4.5% in the recordings).
  ``tokenizer_inflation`` scales both parts (the recorded ``prompt_len.mean`` over
  ``system_prompt_len + question_len``); 1 by default. Requests ask ``max_tokens =
  output_len`` with ``ignore_eos`` (as the recordings' server config), so each
  produces exactly ``output_len`` tokens.

Prefix identity: each prompt's blocks are named Mooncake-style (``hash_ids`` of
``hash_block_tokens``-token units, prefix-chained): the units wholly inside a system
prompt by the group, the rest by the prompt, so ``kv/prefixkeys`` shares exactly the
system prompt within a group and the whole prompt between repeats of it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import numpy as np
from pydantic import Field, model_validator

from simulator.config.registry import WORKLOADS
from simulator.config.strict import StrictModel
from simulator.errors import LatsimError, check_memory, read_text
from simulator.workload.base import Workload
from simulator.workload.lengths import MAX_TOKENS
from simulator.workload.synthetic import MAX_SPAN_S, WORKLOAD_BYTES_PER_REQUEST

MAX_CONFIG_BYTES = 1 << 20
MAX_PROMPTS = 1_000_000
#: The load generator's start offset: a stage's clock starts 1 s after it is set up
#: (``run_stage``: ``start_time = time.perf_counter() + 1``).
STAGE_START_OFFSET_S = 1.0


class SharedPrefix(StrictModel):
    """inference-perf's ``data.shared_prefix`` (its field names and defaults)."""

    num_groups: int = Field(10, ge=1, le=100_000)
    num_prompts_per_group: int = Field(10, ge=1, le=100_000)
    system_prompt_len: int = Field(100, ge=0, le=MAX_TOKENS)
    question_len: int = Field(50, ge=1, le=MAX_TOKENS)
    output_len: int = Field(50, ge=1, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _prompts(self):
        # Every prompt gets its own prefix ids: bounded like a trace's rows.
        if self.num_groups * self.num_prompts_per_group > MAX_PROMPTS:
            raise ValueError(f"num_groups x num_prompts_per_group is over {MAX_PROMPTS:,} "
                             "distinct prompts")
        return self


class DataSpec(StrictModel):
    type: Literal["shared_prefix"] = "shared_prefix"
    shared_prefix: SharedPrefix = Field(default_factory=SharedPrefix)


class Stage(StrictModel):
    rate: float = Field(..., gt=0, description="requests/s")
    duration: float = Field(..., gt=0, description="seconds")


class LoadSpec(StrictModel):
    type: Literal["constant", "poisson"] = "constant"
    interval: float = Field(1.0, ge=0, description="sleep between stages (s)")
    stages: list[Stage] = Field(..., min_length=1, max_length=1000)


class InferencePerfWorkload(StrictModel):
    """The requests inference-perf sends (module doc): its config file (``config``,
    relative to the scenario) or its ``data`` and ``load`` sections inline."""

    kind: Literal["inference_perf"] = "inference_perf"
    config: Optional[str] = Field(None, description="an inference-perf config (YAML or "
                                  "JSON: a run's results/config.yaml or its profile)")
    data: Optional[DataSpec] = None
    load: Optional[LoadSpec] = None
    aliases: bool = Field(False, description="read num_unique_system_prompts / "
                          "num_users_per_system_prompt as later inference-perf versions do "
                          "(the pinned one ignores them)")
    stage_gap_s: Optional[float] = Field(None, ge=0, description="from one stage's end to "
                                         "the next stage's clock (default: load.interval "
                                         "+ 1 s)")
    tokenizer_inflation: float = Field(1.0, ge=0.5, le=4.0, description="server tokens "
                                       "per generated token id (re-tokenised text)")
    hash_block_tokens: Optional[int] = Field(None, ge=1, description="prompt tokens per "
                                             "prefix hash id (default: the system prompt's "
                                             "length, at least 16)")

    @model_validator(mode="after")
    def _one_source(self):
        if self.config is None and (self.data is None or self.load is None):
            raise ValueError("give config (an inference-perf config file) or both data "
                             "and load")
        if self.config is not None and (self.data is not None or self.load is not None):
            raise ValueError("give config or data/load, not both")
        return self

    def expected_requests(self) -> float:
        if self.load is None:
            return 0.0
        return float(sum(int(s.rate * s.duration) for s in self.load.stages))


def _field(source: str, field: str, msg: str, value=None, has_value: bool = False):
    return LatsimError(msg, source=source, field=field, value=value, has_value=has_value)


def read_config(path: Path, aliases: bool = False) -> tuple[DataSpec, LoadSpec, list[str]]:
    """An inference-perf config file's ``data`` and ``load`` as the pinned version reads
    them: keys it does not know dropped (listed in the third value), the rest checked."""
    from pydantic import ValidationError

    from simulator.config.yamlfile import safe_yaml
    src = str(path)
    raw = safe_yaml(read_text(path, max_bytes=MAX_CONFIG_BYTES, what="inference-perf config",
                              field="workload.config"), src)
    if not isinstance(raw, dict):
        raise LatsimError("not an inference-perf config (a mapping with data and load)",
                          source=src)
    data, load = raw.get("data") or {}, raw.get("load")
    if not isinstance(data, dict):
        raise _field(src, "data", "must be a mapping", data, True)
    dtype = data.get("type", "mock")
    if dtype != "shared_prefix":
        raise _field(src, "data.type", "only shared_prefix is modelled", dtype, True)
    if not isinstance(load, dict) or not load.get("stages"):
        raise _field(src, "load.stages", "the stages (rate, duration) are needed")
    if load.get("sweep"):
        raise _field(src, "load.sweep", "a sweep's stages are found at run time; give the "
                     "stages it found")
    ignored = []
    sp = dict(data.get("shared_prefix") or {})
    if aliases:
        for old, new in (("num_unique_system_prompts", "num_groups"),
                         ("num_users_per_system_prompt", "num_prompts_per_group")):
            if old in sp:
                sp[new] = sp.pop(old)
        if sp.get("enable_multi_turn_chat"):
            raise _field(src, "data.shared_prefix.enable_multi_turn_chat",
                         "multi-turn chat is not modelled", True, True)
    keep_sp = set(SharedPrefix.model_fields)
    ignored += [f"data.shared_prefix.{k}" for k in sp if k not in keep_sp]
    keep_load = set(LoadSpec.model_fields)
    lspec = {k: v for k, v in load.items() if k in keep_load}
    try:
        d = DataSpec(type="shared_prefix",
                     shared_prefix={k: v for k, v in sp.items() if k in keep_sp})
        ld = LoadSpec.model_validate(
            {**lspec, "stages": [{k: v for k, v in s.items() if k in ("rate", "duration")}
                                 if isinstance(s, dict) else s for s in lspec["stages"]]})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        top = "load" if loc.startswith(("stages", "type", "interval")) else "data"
        raise _field(src, f"{top}.{loc}", err["msg"].removeprefix("Value error, "),
                     err.get("input"), True) from None
    return d, ld, ignored


def stage_arrivals(stage: Stage, kind: str, rng: np.random.Generator) -> np.ndarray:
    """One stage's send times from its start (s): ``int(rate x duration)`` requests,
    exponential gaps scaled to sum to ``duration`` (``ConstantLoadTimer``); ``poisson``:
    a Poisson count per second, spaced so within it (``PoissonLoadTimer``)."""
    n = int(stage.rate * stage.duration)
    if n == 0:
        return np.zeros(0)
    if kind == "constant":
        gaps = rng.exponential(1.0 / stage.rate, n)
        return np.cumsum(gaps * (stage.duration / gaps.sum()))
    out, sec = [], 0.0
    while sum(len(o) for o in out) < n:
        c = int(rng.poisson(stage.rate))
        if c >= 1:
            g = rng.exponential(1.0 / c, c)
            out.append(sec + np.cumsum(g / g.sum()))
        sec += 1.0
    return np.concatenate(out)[:n]


def build_inference_perf(cfg: InferencePerfWorkload, rng: np.random.Generator,
                         base_dir: Path) -> Workload:
    """The requests of ``cfg`` (module doc), drawn from ``rng`` in a fixed order: the
    prompt shuffle, then each stage's gaps."""
    ignored: list[str] = []
    source = "workload"
    if cfg.config is not None:
        path = Path(cfg.config).expanduser()
        path = path if path.is_absolute() else Path(base_dir) / path
        data, load, ignored = read_config(path, cfg.aliases)
        source = str(path)
    else:
        data, load = cfg.data, cfg.load
    sp = data.shared_prefix
    n_total = sum(int(s.rate * s.duration) for s in load.stages)
    check_memory(n_total * WORKLOAD_BYTES_PER_REQUEST * 4, f"drawing {n_total:,} requests",
                 field="workload")
    if n_total == 0:
        raise LatsimError("no stage sends a request (int(rate x duration) is 0 in each)",
                          source=source, field="load.stages")
    f = cfg.tokenizer_inflation
    sys_tok = int(round(sp.system_prompt_len * f))
    q_tok = max(1, int(round(sp.question_len * f)))
    n_prompts = sp.num_groups * sp.num_prompts_per_group
    # Prompts in generation order (group-major), then one shuffle for the whole run.
    order = rng.permutation(n_prompts)
    gap = cfg.stage_gap_s if cfg.stage_gap_s is not None else \
        load.interval + STAGE_START_OFFSET_S
    times, prompt_idx, stage_of = [], [], []
    start = 0.0
    for k, st in enumerate(load.stages):
        t = stage_arrivals(st, load.type, rng)
        times.append(start + t)
        prompt_idx.append(order[np.arange(len(t)) % n_prompts])
        stage_of.append(np.full(len(t), k))
        start += max(st.duration, float(t[-1]) if len(t) else 0.0) + gap
    arr = np.concatenate(times)
    if arr[-1] > MAX_SPAN_S:
        raise LatsimError(f"the stages span {arr[-1]:.3g} s, over the {MAX_SPAN_S:.0e} s "
                          "simulated time keeps microseconds apart at", source=source,
                          field="load.stages")
    pidx = np.concatenate(prompt_idx)
    n = len(arr)
    prompt = np.full(n, sys_tok + q_tok, dtype=np.int64)
    output = np.full(n, sp.output_len, dtype=np.int64)
    # Prefix hash ids: unit 0 .. (system units) named by the group, the rest by the prompt.
    hb = cfg.hash_block_tokens or max(sys_tok, 16)
    units = -(-(sys_tok + q_tok) // hb)
    sys_units = sys_tok // hb
    group = pidx // sp.num_prompts_per_group
    per_prompt = []
    for p in range(n_prompts):
        g = p // sp.num_prompts_per_group
        ids = [1 + g * units + u if u < sys_units else
               1 + sp.num_groups * units + p * units + u for u in range(units)]
        per_prompt.append(np.asarray(ids, dtype=np.int64))
    hash_ids = [per_prompt[p] for p in pidx.tolist()]
    meta = {"source": source, "format": "inference_perf", "hash_block_tokens": hb,
            "stage": np.concatenate(stage_of), "prompt_index": pidx, "group": group,
            "stages": [(s.rate, s.duration) for s in load.stages],
            "ignored_keys": ignored, "system_tokens": sys_tok, "question_tokens": q_tok}
    return Workload(arrival_s=arr, prompt_tokens=prompt, output_tokens=output,
                    priority=np.zeros(n, dtype=np.int64), hash_ids=hash_ids, meta=meta)


WORKLOADS.register("inference_perf", InferencePerfWorkload, build_inference_perf)
