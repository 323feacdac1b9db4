"""The OpenAI-compatible request/response format of ``latsim serve``, without the web stack.

Request validation (``parse_request``, ``loads_body``), the toy tokenizer and the
JSON objects the server sends (streamed chunks, whole completions, errors). See
``real_engine.server`` for the tokenizer's rationale.

Every check here is bounded by the model's context, not by the body: a prompt is
tokenized only up to one token past the context and a token-id list is measured
before its items are looked at, so a body at the size limit costs the event loop
little more than its JSON parse.
"""
from __future__ import annotations

import itertools
import json
import math
import re
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from simulator.workload.classes import MAX_PRIORITY


class ApiError(Exception):
    """A request the server refuses: becomes an HTTP 4xx with an OpenAI-style JSON body."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def error_body(message: str, status: int = 400, param: Optional[str] = None) -> dict:
    """An OpenAI-style error object: ``{"error": {message, type, param, code}}``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# ``\S+`` splits exactly where ``str.split()`` does (both use Unicode whitespace).
_WORD = re.compile(r"\S+")
MAX_JSON_DEPTH = 32
MAX_MODEL_NAME = 256


def tokenize(text: str, vocab: int, limit: Optional[int] = None) -> list[int]:
    """Whitespace words to token ids, ``crc32(word) % vocab`` (deterministic, one per word).

    ``limit``: stop after that many tokens (a prompt known to be too long is not
    tokenized to its end). A lone surrogate (valid JSON, not valid UTF-8) is hashed
    as its code unit instead of failing the request.
    """
    words = (m.group() for m in _WORD.finditer(text)) if limit is not None else text.split()
    if limit is not None:
        words = itertools.islice(words, limit)
    return [zlib.crc32(w.encode("utf-8", "surrogatepass")) % vocab for w in words]


def loads_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH):
    """A request body parsed as JSON, or ``ApiError`` (400) with a one-line reason:
    not JSON, not UTF-8, or nested deeper than ``max_depth`` (arrays and objects)."""
    deep = f"request body is nested deeper than {max_depth} levels"
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise ApiError(deep) from None
    except UnicodeDecodeError:
        raise ApiError("request body is not valid UTF-8 JSON") from None
    except ValueError as e:
        why = (str(e).splitlines() or [""])[0][:120]
        raise ApiError(f"request body is not valid JSON: {why}") from None
    # Depth cannot exceed the number of brackets: only a body with many of them is walked.
    if raw.count(b"[") + raw.count(b"{") > max_depth and _deeper_than(obj, max_depth):
        raise ApiError(deep)
    return obj


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether ``obj`` nests arrays/objects more than ``limit`` deep (iterative: the
    check itself must not recurse)."""
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        o, d = stack.pop()
        if d > limit:
            return True
        for v in (o.values() if isinstance(o, dict) else o):
            if isinstance(v, (dict, list)):
                stack.append((v, d + 1))
    return False


def detokenize(tok: int) -> str:
    """A generated token id as text: ``" t<id>"``."""
    return f" t{tok}"


@dataclass
class Parsed:
    """A validated request: prompt token ids, ``max_tokens``, streaming, priority, model,
    and whether a streamed response ends with a usage chunk (``stream_options``)."""

    ids: list
    max_tokens: int
    stream: bool
    priority: int
    model: str
    include_usage: bool = False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v))


def _shown(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, (str, list, dict)) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _need(ok: bool, field: str, what: str, v: Any) -> None:
    if not ok:
        raise ApiError(f"'{field}' must be {what} (got {_shown(v)})", param=field)


# Sampling fields: validated as vLLM's SamplingParams does (type and range), then without
# effect: sampling is greedy (the weights are random, the text means nothing, and what a
# request costs does not depend on how its tokens are picked). (field, lo, hi, lo_open).
_SAMPLING_NUMS = (("temperature", 0.0, 2.0, False), ("top_p", 0.0, 1.0, True),
                  ("min_p", 0.0, 1.0, False), ("presence_penalty", -2.0, 2.0, False),
                  ("frequency_penalty", -2.0, 2.0, False),
                  ("repetition_penalty", 0.0, math.inf, True))
_INT64 = 1 << 63
# Fields with no implementation here: accepted only at the value that asks for nothing.
_UNSUPPORTED = {"echo": (False,), "logprobs": (False, 0), "top_logprobs": (0,),
                "suffix": ("",), "logit_bias": ({},), "tools": ([],),
                "response_format": ({"type": "text"},), "stop_token_ids": ([],)}


def _check_options(body: dict, max_tokens: int) -> bool:
    """Every optional field's type and range (``ApiError`` naming it); whether the
    stream ends with a usage chunk. A field this server cannot honour is refused unless
    it asks for nothing (the OpenAI default): answering as if it were honoured would be
    a wrong answer with a 200."""
    for f, lo, hi, lo_open in _SAMPLING_NUMS:
        v = body.get(f)
        if v is not None:
            ok = _is_num(v) and (v > lo if lo_open else v >= lo) and v <= hi
            span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi != math.inf else f"> {lo:g}"
            _need(ok, f, f"a number in {span}", v)
    for f in ("n", "best_of"):
        v = body.get(f)
        if v is None:
            continue
        _need(_is_int(v) and v >= 1, f, "an integer >= 1", v)
        if v != 1:
            raise ApiError(f"'{f}' = {v} is not supported: this server returns one choice "
                           f"per request (send {v} requests)", param=f)
    top_k = body.get("top_k")
    if top_k is not None:
        _need(_is_int(top_k) and (top_k in (-1, 0) or 1 <= top_k < _INT64), "top_k",
              "-1 or 0 (off) or an integer >= 1", top_k)
    seed = body.get("seed")
    if seed is not None:
        _need(_is_int(seed) and -_INT64 <= seed < _INT64, "seed", "a 64-bit integer", seed)
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        _need(_is_int(min_tokens) and 0 <= min_tokens <= max_tokens, "min_tokens",
              f"an integer in [0, max_tokens = {max_tokens}]", min_tokens)
    for f in ("ignore_eos", "skip_special_tokens"):
        if body.get(f) is not None:
            _need(isinstance(body[f], bool), f, "a boolean", body[f])
    user = body.get("user")
    if user is not None:
        _need(isinstance(user, str) and len(user) <= MAX_MODEL_NAME, "user",
              f"a string of at most {MAX_MODEL_NAME} characters", user)
    stop = body.get("stop")
    if stop is not None:
        _need(isinstance(stop, str) or (isinstance(stop, list)
                                       and all(isinstance(s, str) for s in stop)),
              "stop", "a string or a list of strings", stop)
        if stop not in ("", []):
            # Every request generates exactly max_tokens tokens (module docstring of
            # real_engine.server): a stop that is never honoured must not look honoured.
            raise ApiError("'stop' is not supported: this server always generates "
                           "max_tokens tokens", param="stop")
    for f, fine in _UNSUPPORTED.items():
        v = body.get(f)
        if v is not None and not any(type(v) is type(x) and v == x for x in fine):
            raise ApiError(f"'{f}' = {_shown(v)} is not supported by this server", param=f)
    opts = body.get("stream_options")
    if opts is None:
        return False
    _need(isinstance(opts, dict) and set(opts) <= {"include_usage", "continuous_usage_stats"},
          "stream_options", "an object with 'include_usage'", opts)
    if not body.get("stream"):
        raise ApiError("'stream_options' needs 'stream': true", param="stream_options")
    use = opts.get("include_usage", False)
    _need(isinstance(use, bool), "stream_options", "an object whose 'include_usage' is a "
          "boolean", opts)
    if opts.get("continuous_usage_stats"):
        raise ApiError("'stream_options.continuous_usage_stats' is not supported",
                       param="stream_options")
    return use


def parse_request(body: Any, chat: bool, vocab: int, max_seq_len: int,
                  never_runs: Callable[[int, int], Optional[str]], model_name: str) -> Parsed:
    """Validate a request body; raises ``ApiError`` with the offending field.
    ``never_runs(prompt, max_tokens)``: why the engine could never run it (its
    ``EngineCore.never_runs``), or None. Fields not listed here are ignored, as vLLM
    ignores them."""
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    # One token past the context is enough to know a prompt is too long.
    cap = max_seq_len
    if chat:
        field = "messages"
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError("'messages' must be a non-empty list", param="messages")
        if len(msgs) >= max_seq_len:       # every message is at least its role: one token
            raise ApiError(f"{len(msgs)} messages cannot fit the model's context of "
                           f"{max_seq_len} tokens", param="messages")
        parts = []
        for m in msgs:
            if (not isinstance(m, dict) or not isinstance(m.get("content", ""), str)
                    or not isinstance(m.get("role", "user"), str)):
                raise ApiError("each message must be an object with string 'role' and "
                               "'content'", param="messages")
            parts.append(f"{m.get('role', 'user')}: {m.get('content', '')}")
        ids = tokenize("\n".join(parts), vocab, cap)
    else:
        field = "prompt"
        if "prompt" not in body:
            raise ApiError("'prompt' is required", param="prompt")
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]                       # OpenAI allows a batch of one
        if isinstance(p, str):
            ids = tokenize(p, vocab, cap)
        elif isinstance(p, list) and len(p) >= max_seq_len:
            # Too long whatever its items are: refused before they are looked at.
            raise ApiError(f"the prompt has {len(p)} tokens; the model's context of "
                           f"{max_seq_len} tokens must hold the prompt and max_tokens (>= 1)",
                           param="prompt")
        elif isinstance(p, list) and all(_is_int(t) for t in p):
            if any(not 0 <= t < vocab for t in p):
                raise ApiError(f"token ids must be in [0, {vocab})", param="prompt")
            ids = list(p)
        elif isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
            raise ApiError(f"a batch of {len(p)} prompts is not supported: send one "
                           f"request per prompt", param="prompt")
        else:
            raise ApiError("'prompt' must be a string or a list of token ids", param="prompt")
    if not ids:
        raise ApiError("the prompt is empty", param=field)
    n = len(ids)
    if n >= max_seq_len:      # tokenized up to ``cap``: it may be longer still
        raise ApiError(f"the prompt has {'at least ' if n == cap else ''}{n} tokens; the "
                       f"model's context of {max_seq_len} tokens must hold the prompt and "
                       f"max_tokens (>= 1)", param=field)
    mt_field = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    mt = body.get(mt_field)
    mt = 16 if mt is None else mt          # OpenAI's default for completions
    if not _is_int(mt) or mt < 1:
        raise ApiError(f"'{mt_field}' must be an integer >= 1 (got {_shown(mt)})",
                       param=mt_field)
    if n + mt > max_seq_len:
        raise ApiError(f"prompt ({n} tokens) + max_tokens ({mt}) exceeds the model's "
                       f"context of {max_seq_len}: max_tokens can be at most "
                       f"{max_seq_len - n} for this prompt", param=mt_field)
    why = never_runs(n, mt)
    if why is not None:
        raise ApiError(f"the request could never run on this server: {why}",
                       param=mt_field)
    stream = body.get("stream", False)
    stream = False if stream is None else stream
    _need(isinstance(stream, bool), "stream", "a boolean", stream)
    prio = body.get("priority", 0)
    prio = 0 if prio is None else prio
    # The simulator's class range (a class per value, and a queue in the compiled loop),
    # far inside the int64 the policy kernels compute keys in: a request served here can
    # be simulated, and no value can overflow a kernel (2**63 once took the engine down).
    _need(_is_int(prio) and 0 <= prio <= MAX_PRIORITY, "priority",
          f"an integer in [0, {MAX_PRIORITY}]", prio)
    model = body.get("model")
    # Echoed in every streamed chunk: an unbounded name would multiply into the response.
    if model is not None and (not isinstance(model, str) or len(model) > MAX_MODEL_NAME):
        raise ApiError(f"'model' must be a string of at most {MAX_MODEL_NAME} characters",
                       param="model")
    include_usage = _check_options(body, mt)
    return Parsed(ids, mt, stream, prio, model or model_name, include_usage)


def chunk(cid: str, created: int, model: str, text: str, first: bool, last: bool,
          chat: bool) -> dict:
    """One streamed token: a ``text_completion`` or ``chat.completion.chunk`` object."""
    fin = "length" if last else None
    if chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"id": cid, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": fin}]}
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": fin}]}


def usage_chunk(cid: str, created: int, model: str, prompt_tokens: int,
                completion_tokens: int, chat: bool) -> dict:
    """The last streamed chunk when ``stream_options.include_usage`` asks for it: no
    choices, the request's ``usage`` (as OpenAI and vLLM send it)."""
    return {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def completion(cid: str, created: int, model: str, text: str, prompt_tokens: int,
               completion_tokens: int, chat: bool) -> dict:
    """A whole (non-streamed) response with its ``usage``."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": text},
               "finish_reason": "length"} if chat else
              {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
    return {"id": cid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
