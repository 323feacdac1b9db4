"""The serving engine's front end (its API server process) as a stage of a request's
path, in physical terms: what happens between the request's last byte reaching the
server and the engine core seeing it, and between the engine core producing a token and
its SSE frame leaving the server.

vLLM v1 (``vllm serve``) runs an API server process (uvicorn/FastAPI, ``AsyncLLM``)
beside the engine-core process; the two talk over ZeroMQ with msgspec-encoded messages
(``vllm/v1/engine/core_client.py``, ``vllm/v1/engine/core.py``). Request side: the API
server parses the HTTP request and validates it, renders the chat template and tokenises
the prompt (``vllm/v1/engine/processor.py``, a Hugging Face fast tokenizer), then sends
one ``EngineCoreRequest`` over ZMQ to the engine core. Response side: every engine step
the core sends its outputs over ZMQ; the API server's output handler detokenises each new
token (``vllm/v1/engine/detokenizer.py``, incremental) and the request's streaming
generator serialises one ``chat.completion.chunk`` as one SSE frame.

Where it sits in the breakdown ``E2E = T_net + T_queue + T_prefill + T_decode +
T_stream``: the request side is part of ``T_net`` (after the gateway, before the request
is enqueued at the replica: ``network.NetworkTiming.send_time``), the response side part
of ``T_stream`` (added to each token's delivery, after the frame's transmit time: the
stream timing's ``one_way``). Both are computed here, once, for every loop.

The API server is one process with one asyncio event loop, and each engine step's
outputs reach it as one message: ``AsyncLLM``'s output handler runs
``OutputProcessor.process_outputs`` over the step's outputs (in slices of
``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE``, yielding between slices), which puts each request's
``RequestOutput`` on its queue; then each request's generator runs in turn and writes
its SSE frame. The engine core lists a step's outputs in scheduling order, running
requests first and the ones it admitted in that step last (the scheduler's
``num_scheduled_tokens`` order, which ``update_from_output`` follows). So a request's
*first* token leaves after the API server has handled every other output of that step
(``first_token_s``: the outputs ahead of it times ``output_ms_per_token``) and each
later token after its own (in ``response_s``). The first token's wait is added to
its delivery (TTFT) on the plain stream path (``loops.simpy.apply``); a rich client
stream (``wire.clientstream``) sees the per-token part only. Later tokens' waits for
the outputs ahead of them are not modelled: they shift a request's frames by about
the same amount (its place in the list changes only when an older request ends), so
they move neither its ITL nor, its place being near the front by its last token
(older requests end first), its E2E by more than a few outputs' handling.
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from simulator.config.strict import StrictModel
from simulator.kernel import kernel

# -- constants, each with its source -------------------------------------------------
# Hugging Face fast tokenizers (Rust, called from Python), one sequence, one thread:
# 1.1 s for a ~1M-token (4 MB) document (C. Xu, "3.3x Faster HuggingFace Tokenizers for
# Single Sequence", charlesxu.io/parallel-tokenizer) = 1.1 us/token; tokenizers 0.21
# (Python) encodes GPT-2 BPE at 2.5-2.7 MiB/s (B. Vanik, IREE tokenizer comparison,
# 2026-02-21), ~4 bytes/token = 1.4-1.6 us/token. We take 1.5 us per prompt token.
TOKENIZE_US_PER_TOKEN = 1.5
# Per request, fixed: HTTP parsing and request validation, the chat template and the
# tokenizer call's own set-up. A 131-token chat prompt took 1.3-2.8 ms to encode in a
# server calling HF tokenizers (tenstorrent/tt-inference-server#2173: "10 us/token" at
# low ISL), of which ~0.2 ms is the per-token part above: ~1.1 ms fixed; we take 1.0 ms.
REQUEST_FIXED_MS = 1.0
# One ZeroMQ hop between two processes on one host, small message: 40 us for a 1-byte
# message, ZeroMQ's own share 15 us (ZeroMQ performance notes, as quoted by
# tutorialspoint's "ZeroMQ - Performance Considerations"); msgspec encoding of a request
# or a step's outputs is a few us on top. We take 0.04 ms each way.
IPC_HOP_MS = 0.04
# Response side, per output token, all of the API server's work on it: detokenising,
# its RequestOutput, its generator's turn, the chunk's JSON and its SSE write. In
# vllm-project/vllm#12287 (njhill, 2025-01-22; V1 front end, 400 concurrent requests)
# one API server process delivered 1,211,959 output tokens in 84.70 s, 14,308.94
# tokens/s (output chunks of 256, with #12298's coalescing). That process cannot be busy
# more than 100% of the time, so its work per output token, every per-request cost of
# the process included, is at most 1 / 14,308.94 s = 0.0699 ms: an upper bound, taken as
# the value. The same comment says throughput rose further, to 80 req/s, with the
# chunking off, so that run was not at the process's limit either: the bound is loose
# (80 req/s at that run's 202 output tokens per request is ~16,160 tokens/s, 0.062 ms).
# The comment we read does not name the model or the GPU (not verified here). (vLLM v0
# measured 0.106 ms per sequence per step inside its engine loop, vllm-project/vllm#6913.)
OUTPUT_MS_PER_TOKEN = round(1000.0 / 14_308.94, 4)


class FrontendConfig(StrictModel):
    """``engine.frontend``: the API server's costs (module doc; defaults: vLLM v1's,
    each from the source named beside its constant)."""

    request_ms: float = Field(REQUEST_FIXED_MS, ge=0, le=60_000,
                              description="per request: HTTP, validation, chat template")
    tokenize_us_per_token: float = Field(TOKENIZE_US_PER_TOKEN, ge=0, le=1e6,
                                         description="tokenising the prompt, per token")
    ipc_ms: float = Field(IPC_HOP_MS, ge=0, le=60_000,
                          description="one hop API server <-> engine core (ZMQ)")
    output_ms_per_token: float = Field(OUTPUT_MS_PER_TOKEN, ge=0, le=60_000,
                                       description="per output token: detokenise, "
                                       "serialise, one SSE frame")


@dataclass(frozen=True)
class FrontendTiming:
    """The front end's delays (seconds): request side, before the engine core sees the
    request (``request_s``); response side, added to every token's delivery
    (``response_s``), and to a first token the outputs ahead of it in its step
    (``first_token_s``)."""

    fixed_s: float = 0.0
    per_prompt_token_s: float = 0.0
    response_s: float = 0.0
    per_output_s: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> "FrontendTiming":
        """From ``engine.frontend`` (None: no front end, every delay 0)."""
        if cfg is None:
            return cls()
        return cls(fixed_s=(cfg.request_ms + cfg.ipc_ms) / 1000.0,
                   per_prompt_token_s=cfg.tokenize_us_per_token / 1e6,
                   response_s=(cfg.ipc_ms + cfg.output_ms_per_token) / 1000.0,
                   per_output_s=cfg.output_ms_per_token / 1000.0)

    def request_s(self, prompt_tokens: int) -> float:
        """From the request's arrival at the server to the engine core having it."""
        return self.fixed_s + prompt_tokens * self.per_prompt_token_s

    def first_token_s(self, ahead: int) -> float:
        """What a request's first token waits beyond ``response_s``: the API server
        handling the ``ahead`` outputs listed before it in the step that produced it
        (module doc; ``first_token_wait_s``)."""
        return first_token_wait_s(self.per_output_s, ahead)


@kernel(inline=True)
def first_token_wait_s(per_output_s, ahead):
    """The first-token rule, for every executor: a first token leaves after the API
    server has handled the ``ahead`` outputs listed before it in its step, each
    ``per_output_s``. ``ahead``: every decoder of the step (those whose last token it
    was included) and the prefills completed before it in the step (they join the
    decoding list as they complete)."""
    return ahead * per_output_s
