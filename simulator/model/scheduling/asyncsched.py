"""Async scheduling (``engine.async_scheduling``), as vLLM v1's engine core does it.

vLLM v1 with async scheduling (on by default since the ``async_scheduling: None`` ->
True resolution in ``vllm/config/vllm.py``; the loop is
``EngineCore.step_with_batch_queue`` in ``vllm/v1/engine/core.py``, batch queue of
size 2) keeps two steps in flight: it schedules step N, submits it without waiting,
returns to its busy loop (which drains the input queue of new requests) and schedules
step N+1 at once, with placeholders for N's sampled tokens; only then does it block on
N's output, update the scheduler from it, and schedule N+2 - while N+1 runs. So the
decision for the step that starts at ``S_k`` is taken at ``S_{k-1}``, when step k-1
starts: a request that arrives during step j (after the decision at ``S_j``) is first
seen by the decision at ``S_{j+1}`` and runs in step j+2, one step later than under
synchronous scheduling. When the step the scheduler planned ahead is empty (nothing
was running), the engine blocks on the previous output, drains the input queue and
schedules at once: everything that has arrived is seen.

What it does not change: decodes (a running request's next step is planned with a
placeholder for its token, so it decodes every step as before), and the first token's
output (step N's outputs are processed as soon as N ends, while N+1 runs). The CPU
time of scheduling overlaps the GPU's step, which is what it is for; the step cost
models price a step's device time plus its host time as they do.

The rule is one kernel, ``sees``; the SimPy replica holds new arrivals in an inbox and
asks it at every decision (``loops.simpy.replica``); the compiled loop keeps an inbox
per replica and asks the same kernel (``loops.compiled.replica.see_arrivals``).
"""
from __future__ import annotations

from simulator.kernel import kernel


@kernel(inline=True)
def sees(enqueued, prev_decision, idle):
    """Whether the scheduling decision taken now sees a request that reached the
    replica at ``enqueued``: it arrived by the previous decision (``prev_decision``,
    when the step now ending started, i.e. when this step was planned), or the engine
    had nothing planned ahead (``idle``) and decides with everything that arrived."""
    return idle or enqueued <= prev_decision
