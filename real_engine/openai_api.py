"""The OpenAI-compatible request/response format of ``latsim serve``, without the web stack.

Request validation (``parse_request``), the toy tokenizer and the JSON objects
the server sends (streamed chunks, whole completions, errors). See
``real_engine.server`` for the tokenizer's rationale.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Optional

from simulator.model.kv.blocks import request_blocks


class ApiError(Exception):
    """A request the server refuses: becomes an HTTP 4xx with an OpenAI-style JSON body."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def error_body(message: str, status: int = 400, param: Optional[str] = None) -> dict:
    """An OpenAI-style error object: ``{"error": {message, type, param, code}}``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def tokenize(text: str, vocab: int) -> list[int]:
    """Whitespace words to token ids, ``crc32(word) % vocab`` (deterministic, one per word)."""
    return [zlib.crc32(w.encode("utf-8")) % vocab for w in text.split()]


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


def parse_request(body: Any, chat: bool, vocab: int, max_seq_len: int, block_size: int,
           num_blocks: int, model_name: str) -> Parsed:
    """Validate a request body; raises ``ApiError`` with the offending field."""
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError("'messages' must be a non-empty list", param="messages")
        parts = []
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("content", ""), str):
                raise ApiError("each message must be an object with string 'content'",
                               param="messages")
            parts.append(f"{m.get('role', 'user')}: {m.get('content', '')}")
        ids = tokenize("\n".join(parts), vocab)
    else:
        if "prompt" not in body:
            raise ApiError("'prompt' is required", param="prompt")
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]                       # OpenAI allows a batch of one
        if isinstance(p, str):
            ids = tokenize(p, vocab)
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
            if any(not 0 <= t < vocab for t in p):
                raise ApiError(f"token ids must be in [0, {vocab})", param="prompt")
            ids = list(p)
        else:
            raise ApiError("'prompt' must be a string or a list of token ids", param="prompt")
    if not ids:
        raise ApiError("the prompt is empty", param="prompt")
    mt = body.get("max_tokens", body.get("max_completion_tokens", 16))
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise ApiError("'max_tokens' must be an integer >= 1", param="max_tokens")
    if len(ids) + mt > max_seq_len:
        raise ApiError(f"prompt ({len(ids)} tokens) + max_tokens ({mt}) exceeds the model's "
                       f"context of {max_seq_len}", param="max_tokens")
    if request_blocks(len(ids), mt, block_size) > num_blocks:
        raise ApiError(f"request needs more KV blocks than the cache has ({num_blocks})",
                       param="max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("'stream' must be a boolean", param="stream")
    prio = body.get("priority", 0)
    if not isinstance(prio, int) or isinstance(prio, bool) or prio < 0:
        raise ApiError("'priority' must be an integer >= 0", param="priority")
    return Parsed(ids, mt, stream, prio, str(body.get("model") or model_name))


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
