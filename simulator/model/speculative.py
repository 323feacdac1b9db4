"""Speculative decoding, as a what-if on the engine (``engine.speculative``).

Each decode step of a speculative engine has every running sequence propose ``k``
draft tokens (``method: draft``: ``k`` sequential decode steps of a small draft model;
``ngram``: prompt lookup on the host, whose cost is not modelled: it is negligible next
to a step) and the target model verify its last token and the ``k`` drafts in one
forward pass of ``k + 1`` tokens per sequence.

Acceptance follows the i.i.d. model of Leviathan, Kalman and Matias (2023), "Fast
Inference from Transformers via Speculative Decoding" (ICML; arXiv:2211.17192), eq. (1):
each draft token is accepted with probability ``a`` independently, the first rejection
ends the run, and the verify always yields one token of its own (the correction, or the
bonus token after ``k`` accepted drafts). The tokens a sequence emits per step are
``1 + (leading accepted drafts)``, at most ``k + 1``, so

    E[tokens per step] = (1 - a^(k+1)) / (1 - a)      (k + 1 when a = 1).

The count is drawn per sequence per step from a seeded generator (one per replica,
from the run's seed; no global state) and capped by the tokens the request still has to
produce: a sequence with ``r`` tokens to go proposes ``min(k, r - 1)`` drafts
(``rules.spec_lookahead``), whose KV slots the memory rules reserve.

Cost of a step (seconds): the target's verify (``cost.verify_time``: the physics model
of a step of ``k + 1`` query tokens per sequence, ``physics.verify_ms``; the batch is
priced at ``k + 1`` tokens a sequence, as an engine pads it to one shape), plus for
``draft`` the draft model's ``k`` decode steps at the batch's context and its prefill of
the step's prompt chunks, from a roofline model of the draft on the target's GPU
(``cost.roofline``). A profile cost model (``kind: profile``) interpolates measured
steps and has no verify step to price: speculative decoding needs ``fitted`` or
``roofline``. The draft model's weights and KV are not taken from the target's KV
capacity.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from simulator.cost.decodectx import decode_context
from simulator.errors import LatsimError

FIELD = "engine.speculative"


def expected_tokens(acceptance: float, k: int) -> float:
    """Mean tokens a sequence emits per verify step under i.i.d. acceptance
    (Leviathan et al. 2023, eq. 1): ``(1 - a^(k+1)) / (1 - a)``, ``k + 1`` at a = 1."""
    a = float(acceptance)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class SpecReplica:
    """One replica's speculative state: its acceptance draws and tallies."""

    def __init__(self, spec: "Speculative", rng: np.random.Generator) -> None:
        self.spec = spec
        self.k = spec.k
        self.rng = rng
        self.steps = 0          # verify steps the replica ran
        self.seq_steps = 0      # sequence-steps (a sequence in one verify step)
        self.tokens = 0         # tokens those sequence-steps emitted

    def draws(self, n: int) -> np.ndarray:
        """Tokens each of ``n`` sequences would emit this step, before the cap at what
        it has left: 1 + the leading accepted drafts, at most ``k + 1`` (a geometric
        count of trials up to the first rejection, truncated)."""
        a = self.spec.acceptance
        if a >= 1.0:
            return np.full(n, self.k + 1, dtype=np.int64)
        return np.minimum(self.rng.geometric(1.0 - a, size=n), self.k + 1)

    def step_time(self, cost, nd: int, ctx_max: int, ctx_sum: int, chunks) -> float:
        """Seconds of a step of ``nd`` verifying sequences and the prefill ``chunks``."""
        self.steps += 1
        return self.spec.step_time(cost, nd, ctx_max, ctx_sum, chunks)


class Speculative:
    """``engine.speculative`` bound to its cost: ``method``, ``k``, ``acceptance`` and
    the draft's cost model (``draft``, None for ``ngram``)."""

    def __init__(self, method: str, k: int, acceptance: float, draft=None,
                 draft_model: Optional[str] = None, seed: int = 0) -> None:
        self.method = method
        self.k = int(k)
        self.acceptance = float(acceptance)
        self.draft = draft
        self.draft_model = draft_model
        self._seed = np.random.SeedSequence(seed)
        self.replicas: list[SpecReplica] = []

    def for_replica(self, index: int) -> SpecReplica:
        """Replica ``index``'s state; its draws depend on the run's seed and the index
        only (adding replicas does not shift another's)."""
        ss = np.random.SeedSequence(entropy=self._seed.entropy, spawn_key=(index,))
        r = SpecReplica(self, np.random.default_rng(ss))
        self.replicas.append(r)
        return r

    def draft_time(self, nd: int, ctx_max: int, ctx_sum: int, chunks: Sequence) -> float:
        """Seconds of the draft model's work in a step: ``k`` decode steps of the
        ``nd`` sequences, and the prefill of the step's prompt chunks (its own KV)."""
        d = self.draft
        if d is None:
            return 0.0
        t = 0.0
        if nd:
            ctx0 = decode_context(d.padded, nd, ctx_max, ctx_sum)
            t += float(sum(d.decode_times(nd, ctx0, self.k)))
        if chunks:
            t += d.step_time(0, 0, 0, chunks)
        return t

    def step_time(self, cost, nd: int, ctx_max: int, ctx_sum: int, chunks) -> float:
        """Seconds of a step: the target's verify of ``k + 1`` tokens per sequence with
        the prefill ``chunks`` (``cost.verify_time``), plus the draft's work."""
        return (cost.verify_time(nd, self.k + 1, ctx_max, ctx_sum, chunks)
                + self.draft_time(nd, ctx_max, ctx_sum, chunks))

    def describe(self) -> dict:
        """The summary's ``speculative``: the settings, the i.i.d. expectation of tokens
        per step and what the run measured (``mean_tokens_per_step``: tokens emitted by
        verify steps / sequences in them; ``verify_steps``: engine steps that verified)."""
        seq_steps = sum(r.seq_steps for r in self.replicas)
        tokens = sum(r.tokens for r in self.replicas)
        out = {"method": self.method, "k": self.k, "acceptance": self.acceptance,
               "mean_tokens_per_step": tokens / seq_steps if seq_steps else None,
               "expected_tokens_per_step": expected_tokens(self.acceptance, self.k),
               "verify_steps": sum(r.steps for r in self.replicas),
               "sequence_steps": seq_steps, "tokens": tokens}
        if self.draft is not None:
            out["draft_model"] = self.draft_model
            out["draft_cost"] = self.draft.label
        return out


def draft_cost_model(draft_model: str, model_cost, target, base_dirs: Sequence = ()):
    """A roofline model of the draft on the target's GPU: a roofline target's GPU and
    TP (TP 1 where the draft's heads do not split that way); a measured profile's GPU
    (``meta.gpu`` or ``meta.hardware``) at TP 1."""
    from simulator.cost import catalog
    from simulator.cost.roofline.model import RooflineCostModel, model_arch
    arch = model_arch(draft_model, base_dirs)
    hw = model_cost.hardware()
    if hw is not None:
        spec, tp = catalog.gpu(hw[0]), hw[1]
        try:
            catalog.check_parallelism(arch, tp, 1)
        except LatsimError:
            tp = 1
        return RooflineCostModel(arch, spec, tp, 1)
    meta = (getattr(target, "profile", None) or {}).get("meta") or {}
    text = str(meta.get("gpu") or meta.get("hardware") or "")
    spec = catalog.gpu_in_text(text) if text else None
    if spec is None:
        raise LatsimError(f"the draft model is priced on the target's GPU, and the profile "
                          f"names none the catalogue knows (meta.gpu / meta.hardware "
                          f"{text!r})", field=f"{FIELD}.draft_model")
    return RooflineCostModel(arch, spec, 1, 1)


def build_speculative(cfg, model_cost, target, seed: int, base_dirs: Sequence = ()):
    """The run's ``Speculative`` for ``engine.speculative`` (None when off). ``target``
    is a built cost model of the scenario (it must price a verify step)."""
    if cfg is None:
        return None
    if not hasattr(target, "verify_time"):
        raise LatsimError(speculative_cost_error(getattr(model_cost, "kind", "?")), field=FIELD)
    draft = (draft_cost_model(cfg.draft_model, model_cost, target, base_dirs)
             if cfg.method == "draft" else None)
    return Speculative(cfg.method, cfg.k, cfg.acceptance, draft, cfg.draft_model, seed)


def speculative_cost_error(kind: str) -> str:
    return (f"needs a physics cost model (model.cost kind fitted or roofline) to price the "
            f"verify step of k+1 tokens per sequence; kind {kind!r} has none")
