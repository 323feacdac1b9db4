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
import re
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional


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
    """A validated request: prompt token ids, ``max_tokens``, streaming, priority, model."""

    ids: list
    max_tokens: int
    stream: bool
    priority: int
    model: str


def parse_request(body: Any, chat: bool, vocab: int, max_seq_len: int,
                  never_runs: Callable[[int, int], Optional[str]], model_name: str) -> Parsed:
    """Validate a request body; raises ``ApiError`` with the offending field.
    ``never_runs(prompt, max_tokens)``: why the engine could never run it (its
    ``EngineCore.never_runs``), or None."""
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
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
            if any(not 0 <= t < vocab for t in p):
                raise ApiError(f"token ids must be in [0, {vocab})", param="prompt")
            ids = list(p)
        else:
            raise ApiError("'prompt' must be a string or a list of token ids", param="prompt")
    if not ids:
        raise ApiError("the prompt is empty", param=field)
    n = len(ids)
    if n >= max_seq_len:      # tokenized up to ``cap``: it may be longer still
        raise ApiError(f"the prompt has {'at least ' if n == cap else ''}{n} tokens; the "
                       f"model's context of {max_seq_len} tokens must hold the prompt and "
                       f"max_tokens (>= 1)", param=field)
    mt = body.get("max_tokens", body.get("max_completion_tokens", 16))
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise ApiError("'max_tokens' must be an integer >= 1", param="max_tokens")
    if n + mt > max_seq_len:
        raise ApiError(f"prompt ({n} tokens) + max_tokens ({mt}) exceeds the model's "
                       f"context of {max_seq_len}: max_tokens can be at most "
                       f"{max_seq_len - n} for this prompt", param="max_tokens")
    why = never_runs(n, mt)
    if why is not None:
        raise ApiError(f"the request could never run on this server: {why}",
                       param="max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("'stream' must be a boolean", param="stream")
    prio = body.get("priority", 0)
    if not isinstance(prio, int) or isinstance(prio, bool) or prio < 0:
        raise ApiError("'priority' must be an integer >= 0", param="priority")
    model = body.get("model")
    # Echoed in every streamed chunk: an unbounded name would multiply into the response.
    if model is not None and (not isinstance(model, str) or len(model) > MAX_MODEL_NAME):
        raise ApiError(f"'model' must be a string of at most {MAX_MODEL_NAME} characters",
                       param="model")
    return Parsed(ids, mt, stream, prio, model or model_name)


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
