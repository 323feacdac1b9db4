"""The roofline's GEMMs compute whole output tiles (``physics.gemm_rows``), and the
weights stream at the GPU's memory technology's efficiency
(``roofline.defaults.weight_read_efficiency``): closed forms, and the steps Vidur's
A100 tables show."""
from __future__ import annotations

import numpy as np
import pytest

from simulator.cost import catalog
from simulator.cost import physics as ph
from simulator.cost.catalog import vidur
from simulator.cost.roofline import constants, defaults, derive


def test_gemm_rows_round_up_to_whole_tiles():
    """64-row tiles up to 64 tokens, 128-row tiles beyond; no tiles: the tokens
    themselves (so a fitted profile, which leaves ``gemm_tile`` at 0, is unchanged)."""
    c = ph.new_constants()
    assert [ph.gemm_rows(c, m) for m in (0.0, 1.0, 65.0, 300.0)] == [0.0, 1.0, 65.0, 300.0]
    c[ph.C_GEMM_TILE_SMALL], c[ph.C_GEMM_TILE] = 64.0, 128.0
    got = [ph.gemm_rows(c, m) for m in (0.0, 1.0, 64.0, 65.0, 128.0, 129.0, 8192.0)]
    assert got == [0.0, 64.0, 64.0, 128.0, 128.0, 256.0, 8192.0]


def test_linear_flops_are_those_of_the_padded_rows_and_weights_are_read_once():
    """Llama-2-70B on an A100: the FLOP time of 1 and of 64 tokens is the same (one
    64-row tile), so is that of 65 and 128 tokens (one 128-row tile), with the LM head's
    sampled rows padded alike; the weights' time does not depend on the tokens."""
    c = constants.build_constants(catalog.model("llama-2-70b"), catalog.gpu("a100-80gb"), 1)
    P = c[ph.C_PARAMS_LINEAR] + c[ph.C_PARAMS_REPL]
    lm = c[ph.C_VOCAB] * c[ph.C_DMODEL]
    rate = c[ph.C_PEAK_TFLOPS] * c[ph.C_E_GEMM] * 1e9
    for T, rows in ((1.0, 64.0), (64.0, 64.0), (65.0, 128.0), (128.0, 128.0), (200.0, 256.0)):
        t_w, t_f = ph.linear_times(c, T, 1.0)
        assert t_f == pytest.approx((2 * P * rows + 2 * lm * 64.0) / rate, rel=1e-12)
        assert t_w == ph.linear_times(c, 1.0, 1.0)[0]


def test_the_steps_of_vidur_a100_70b_gemms_at_64_and_128_tokens():
    """Vidur's A100 Llama-2-70B TP1 table (``data/vidur``; one of the fitted tables):
    a layer's four GEMMs take 1.125 ms at 64 tokens, 1.317 at 80 (x1.171), 1.297 at
    128 and 1.9375 at 144 (x1.494). The roofline steps at the same places: flat from
    80 to 128 tokens (one 128-row tile), x1.18 and x1.60 at the steps (within 10% of
    the measured ratios; a FLOP count of the tokens themselves rises smoothly)."""
    table = vidur.read_mlp("a100", "llama-2-70b")[1]
    tok = list(table.tokens)
    meas = {m: table.gemm_ms()[tok.index(m)] for m in (64, 80, 128, 144)}
    arch, spec = catalog.model("llama-2-70b"), catalog.gpu("a100-80gb")
    pred = dict(zip((64, 80, 128, 144), derive.vidur_gemm_ms(
        defaults.DEFAULTS, arch, spec, 1, np.array([64.0, 80.0, 128.0, 144.0]))))
    assert pred[80] == pred[128]
    for lo, hi in ((64, 80), (128, 144)):
        assert pred[hi] / pred[lo] == pytest.approx(meas[hi] / meas[lo], rel=0.10)


def test_weight_reads_follow_the_memory_technology():
    """Every catalogue GPU names a memory technology the table maps; the A100 (HBM2e)
    and H100 (HBM3) take their fitted values, the H200 and B200 (HBM3e) the reference
    H200's measured copy rate over its datasheet (4,282 of 4,800 GB/s), GDDR6 and HBM2
    HBM2e's, MI300X (HBM3) the H100's; an ``e_weights`` in the efficiencies stands for
    every technology."""
    eff = defaults.DEFAULTS
    assert all(g.memory_type in defaults.WEIGHT_READ for g in catalog.GPUS.values())
    want = {"a100-80gb": eff["e_weights_hbm2e"], "a100-40gb": eff["e_weights_hbm2e"],
            "l40s": eff["e_weights_hbm2e"], "l4": eff["e_weights_hbm2e"],
            "h100-80gb": eff["e_weights_hbm3"], "mi300x": eff["e_weights_hbm3"],
            "h100-pcie": eff["e_weights_hbm2e"],
            "h200": 4282 / 4800, "b200": 4282 / 4800}
    for name, e in want.items():
        c = constants.build_constants(catalog.model("llama-2-7b"), catalog.gpu(name), 1)
        # rel 1e-3: DEFAULTS hold four significant digits (0.8921 for 4282 / 4800).
        assert c[ph.C_E_WEIGHTS] == pytest.approx(e, rel=1e-3), name
    assert eff["e_weights_hbm2e"] < eff["e_weights_hbm3"]
    one = {**eff, "e_weights": 0.5}
    c = constants.build_constants(catalog.model("llama-2-7b"), catalog.gpu("a100-80gb"), 1, eff=one)
    assert c[ph.C_E_WEIGHTS] == 0.5
