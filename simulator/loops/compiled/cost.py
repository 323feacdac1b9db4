"""Step costs in the compiled loop: the cost model's own kernels, by kind.

A cost model arrives packed (``pack_cost``): its kind, the profile tables' constants and
arrays (``simulator.cost.table``: ``kind: profile``) and the physics model's constants
(``simulator.cost.physics``: ``kind: fitted`` and the models built like it). The loop
calls the same kernels the Python cost models call, with the same arguments, so each
step lasts exactly what it lasts in the SimPy model; the lookup and extrapolation counts
go to ``CL``.
"""
from __future__ import annotations

import numpy as np

from simulator.cost import physics as ph
from simulator.cost import table as T
from simulator.kernel import kernel as jit
from simulator.model.scheduling.epoch import step_ends

KIND_TABLE, KIND_PHYSICS = 0, 1


@jit
def step_time(KIND, CF, A, X, Y, N, TO, G, YB, BEY, PC, CL, nd, ctx_max, ctx_sum, chn, chp,
              chf, nch):
    """Seconds of a step (the cost model's ``step_time`` without noise); the arguments
    are ``pack_cost``'s, then the counters and the step."""
    if KIND[0] == KIND_TABLE:
        ms = T.step_ms(CF, A, X, Y, N, TO, G, YB, BEY, CL, nd, ctx_max, ctx_sum, chn, chp, chf,
                       nch)
    else:
        ms = ph.counted_step_ms(PC, CL, nd, ctx_max, ctx_sum, chn, chp, chf, nch)
    return ms / 1000.0


@jit
def decode_ends(KIND, CF, A, X, Y, N, TO, G, YB, BEY, PC, CL, nd, ctx0, k, now, ends, buf, z,
                f):
    """The ends of ``k`` decode-only steps from ``now`` (the cost model's
    ``decode_times``, summed by ``epoch.step_ends``) into ``ends[:k]``;
    ``buf``: scratch of at least ``k``; ``z``, ``f``: empty chunk arrays."""
    if KIND[0] == KIND_TABLE:
        T.decode_run_ms(CF, A, X, Y, N, TO, G, YB, BEY, CL, nd, ctx0, nd * ctx0, k, buf, z, f)
    else:
        ph.counted_decode_run_ms(PC, CL, nd, ctx0, k, buf)
    for j in range(k):
        buf[j] /= 1000.0
    step_ends(now, buf, k, ends)


def cost_kind(cost):
    """``KIND_TABLE`` or ``KIND_PHYSICS`` for a cost model the loop can run, else None:
    the kernels its class says it prices with (``StepCost.compiled_kernels``)."""
    return {"table": KIND_TABLE, "physics": KIND_PHYSICS}.get(
        getattr(type(cost), "compiled_kernels", None))


def pack_cost(cost) -> tuple:
    """A cost model (without noise) as the kernels' arguments: ``(KIND, CF, A, X, Y, N,
    TO, G, YB, BEY, PC)``, the profile tables' (``table``) or the physics constants
    (``PC``)."""
    kind = cost_kind(cost)
    if kind == KIND_TABLE:
        return (np.array([KIND_TABLE], dtype=np.int64), cost.CF) + tuple(cost.tables) + (
            np.zeros(1),)
    one = T.pack_table([1.0], [1.0], [1.0])
    empty = T.pack_tables(one, one, one)
    empty = empty + T.blended(empty, 2)
    return ((np.array([KIND_PHYSICS], dtype=np.int64), np.zeros(T.C_NCONST)) + empty
            + (cost.stepping_constants(),))
