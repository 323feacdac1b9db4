"""Every registered cost-model kind against the ``CostModel`` / ``StepCost`` contracts
(``simulator.cost.model``): a step's time is positive, bounded below by ``min_step_s``
and (unless the kind says why not) never decreases when work is added; ``decode_times``
is ``k`` calls of ``step_time``; a replica's memory is positive, its GPUs at least one
and its KV bytes per token the closed form of the architecture; without noise it runs
compiled, with noise it says why not. A kind registered without an example here fails,
so a new kind is checked too; a model that breaks a contract is caught (last test)."""
from __future__ import annotations

import numpy as np
import pytest

from simulator.config import plugins  # noqa: F401  (registers the built-in kinds)
from simulator.config.registry import COST_MODELS
from simulator.config.scenario import validate_scenario
from simulator.cost import build_cost_model, profile_search_dirs
from simulator.cost.model import CostModel, StepCost, compiled_reason, missing_methods

# One scenario per kind: (model section, what one cached token takes in bytes, GPUs).
# Llama-3-8B: 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 131,072 B;
# Llama-2-70B at TP4: 2 x 80 x 8 x 128 x 2 = 327,680 B, each GPU 2 of the 8 KV heads.
EXAMPLES = {
    "profile": ({"cost": {"kind": "profile"}}, 131_072, 131_072, 1),
    "fitted": ({"cost": {"kind": "fitted"}}, 131_072, 131_072, 1),
    "roofline": ({"name": "llama-2-70b", "cost": {"kind": "roofline", "gpu": "h100-80gb",
                                                  "tp": 4}}, 327_680, 327_680 / 4, 4),
}
BATCHES = (1, 2, 8, 32, 128, 256)
CONTEXTS = (1, 64, 512, 2048, 8192, 32000)
CHUNKS = (1, 16, 128, 512, 2048, 8192)


def _scenario(model: dict):
    return validate_scenario({"name": "contract", "seed": 1,
                              "workload": {"kind": "synthetic", "num_requests": 10},
                              "model": model})


def _built(sc, noise: bool = False):
    cfg = sc.model.cost.model_copy(update={"noise": True}) if noise else sc.model.cost
    return build_cost_model(cfg, np.random.default_rng(0), profile_search_dirs(None))


def _steps(cm) -> list[tuple[float, float, str]]:
    """(less work, more work, what grew) over a grid of steps."""
    t = lambda nd, ctx, ch: cm.step_time(nd, ctx, nd * ctx, ch)  # noqa: E731
    out = []
    for nd in BATCHES:
        row = [t(nd, c, []) for c in CONTEXTS]
        out += [(a, b, f"context of {nd} decodes") for a, b in zip(row, row[1:])]
    for c in CONTEXTS:
        row = [t(nd, c, []) for nd in BATCHES]
        out += [(a, b, f"decodes at context {c}") for a, b in zip(row, row[1:])]
    for nd in (0, 8):
        for prior in (0, 1000):
            row = [t(nd, 512, [(n, prior, True)]) for n in CHUNKS]
            out += [(a, b, f"chunk after {prior} with {nd} decodes") for a, b in zip(row, row[1:])]
            out += [(t(nd, 512, [(n, prior, True)]),
                     t(nd, 512, [(n, prior, True), (64, 0, True)]), "a second chunk")
                    for n in CHUNKS]
    return out


def check_step_contract(cm) -> list[str]:
    """What ``cm`` breaks of the ``StepCost`` contract (empty: nothing)."""
    broken = []
    if not isinstance(cm, StepCost):
        broken.append("not a StepCost")
    steps = _steps(cm)
    times = [x for s in steps for x in s[:2]]
    if not all(np.isfinite(x) and x > 0 for x in times):
        broken.append("a step time is not positive")
    if any(x < cm.min_step_s for x in times):
        broken.append("a step is shorter than min_step_s")
    if getattr(type(cm), "not_monotone", None) is None:
        # Exact: the physics adds non-negative terms, so more work is never cheaper.
        worse = [w for a, b, w in steps if b < a]
        if worse:
            broken.append(f"cheaper with more work: {worse[0]}")
    runs = cm.decode_times(16, 300.0, 6)
    one = [cm.step_time(16, 300 + j, 16 * (300 + j), []) for j in range(6)]
    if runs != one:     # the same kernel, the same arguments: bit for bit
        broken.append("decode_times is not step_time step by step")
    return broken


@pytest.fixture(scope="module")
def examples():
    return {k: _scenario(v[0]) for k, v in EXAMPLES.items()}


def test_every_registered_kind_has_an_example():
    assert set(COST_MODELS.names()) <= set(EXAMPLES), \
        f"add an example for {sorted(set(COST_MODELS.names()) - set(EXAMPLES))}"


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_the_config_declares_what_a_replica_needs(kind, examples):
    sc = examples[kind]
    cfg = sc.model.cost
    assert missing_methods(type(cfg)) == [] and isinstance(cfg, CostModel)
    _, bpt, bpt_gpu, gpus = EXAMPLES[kind]
    mem = cfg.memory(sc)
    assert mem.weight_bytes > 0 and mem.kv_blocks >= 1 and mem.gpus >= 1
    assert (mem.kv_bytes_per_token, mem.kv_bytes_per_token_per_gpu, mem.gpus) == (bpt, bpt_gpu, gpus)
    assert (cfg.gpus_per_replica() or sc.cluster.gpus_per_replica) == gpus
    assert cfg.capacity_line(sc, mem.kv_blocks).startswith(
        f"KV cache per replica: {mem.kv_blocks:,} blocks")


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_a_step_keeps_the_contract(kind, examples):
    cm = _built(examples[kind])
    assert check_step_contract(cm) == []
    reason = type(cm).not_monotone
    assert reason is None or len(reason) > 20       # a kind that is not says why
    assert compiled_reason(cm) is None
    # Runs compiled, so it names the kernels the compiled loop prices it with.
    assert type(cm).compiled_kernels in ("table", "physics")


@pytest.mark.parametrize("kind", sorted(k for k in EXAMPLES
                                        if "noise" in COST_MODELS.config_class(k).model_fields))
def test_a_noisy_model_says_why_it_does_not_run_compiled(kind, examples):
    assert compiled_reason(_built(examples[kind], noise=True)) == "cost noise"


def test_a_broken_model_fails_the_contract(examples):
    """A fitted model whose decodes get cheaper with context, and one that adds a
    negative constant, are both caught."""
    cm = _built(examples["fitted"])

    class Cheaper(type(cm)):
        def step_time(self, nd, ctx_max, ctx_sum, chunks):
            return super().step_time(nd, ctx_max, ctx_sum, chunks) / (1 + ctx_max)

    class Negative(type(cm)):
        def step_time(self, nd, ctx_max, ctx_sum, chunks):
            return super().step_time(nd, ctx_max, ctx_sum, chunks) - 1.0

    for bad, what in ((Cheaper, "cheaper with more work"), (Negative, "not positive")):
        cm.__class__ = bad
        assert any(what in b for b in check_step_contract(cm)), bad
