"""What one generation request costs against a key's tokens-per-minute budget, before any work.

The ingress middleware charges it from the raw body, before the route validates it: the charge
only has to be an honest upper-bound estimate that a client cannot shrink by the request's
shape (invalid requests get their 400 later, charged all the same).

    charge = Σ prompt tokens of every prompt
             + n × max_tokens × number of prompts
             + tool definitions (their JSON size / 4)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

CHARS_PER_TOKEN = 4  # ~4 characters per token on English text.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions.
_MAX_N = 1024  # Beyond any valid n; a larger one is a 400 anyway.
_MAX_BUDGET = 10**9


def request_charge(endpoint: str, body: Mapping[str, Any], unset_max_tokens_charge: int) -> int:
    """Tokens to charge for ``body`` sent to ``endpoint`` (``/v1/chat/completions`` or
    ``/v1/completions``; other endpoints cost nothing). ``unset_max_tokens_charge``: the
    completion budget of a chat without max_tokens, or a completion with max_tokens null
    (both run to the end of the context window)."""
    chat = endpoint.endswith("/chat/completions")
    if not (chat or endpoint.endswith("/completions")):
        return 0
    if chat:
        prompts = [_chat_tokens(body.get("messages"))]
        names: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
        default_budget = unset_max_tokens_charge
    else:
        prompts = _completion_prompts(body.get("prompt"))
        names = ("max_tokens",)
        # Unset is OpenAI's 16; an explicit null means "no limit" to the protocol model.
        unbounded = "max_tokens" in body and body["max_tokens"] is None
        default_budget = unset_max_tokens_charge if unbounded else COMPLETIONS_DEFAULT_MAX_TOKENS
    budget = next((body[k] for k in names if _positive_int(body.get(k))), default_budget)
    budget = min(budget, _MAX_BUDGET)
    n = min(body["n"], _MAX_N) if _positive_int(body.get("n")) else 1
    tools = _json_tokens(body["tools"]) if chat and body.get("tools") else 0
    return sum(prompts) + n * budget * len(prompts) + tools


def charge_of_body(endpoint: str, raw: bytes, unset_max_tokens_charge: int) -> int:
    """``request_charge`` of a raw JSON body; unparseable bodies cost nothing (they get a 400)."""
    if not (endpoint.endswith("/chat/completions") or endpoint.endswith("/completions")):
        return 0  # Not even parsed: /tokenize and the rest spend no engine tokens.
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # Bad JSON or UTF-8, or nested past the parser.
        return 0
    if not isinstance(body, dict):
        return 0
    return request_charge(endpoint, body, unset_max_tokens_charge)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _text_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _json_tokens(value: Any) -> int:
    return _text_tokens(json.dumps(value, separators=(",", ":")))


def _chat_tokens(messages: Any) -> int:
    """All messages form one prompt: their text, plus the tool calls they carry."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        total += _content_tokens(message.get("content"))
        if message.get("tool_calls"):
            total += _json_tokens(message["tool_calls"])
    return total


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return _text_tokens(content)
    if isinstance(content, list):  # Content parts.
        return sum(
            _text_tokens(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 0


def _completion_prompts(prompt: Any) -> list[int]:
    """Tokens of each prompt in OpenAI's four shapes: a string, strings, token ids, lists of
    token ids (anything else is one empty prompt: the route refuses it)."""
    if isinstance(prompt, str):
        return [_text_tokens(prompt)]
    if not isinstance(prompt, list) or not prompt:
        return [0]
    if all(isinstance(item, int) for item in prompt):
        return [len(prompt)]
    return [
        _text_tokens(item) if isinstance(item, str) else len(item) if isinstance(item, list) else 0
        for item in prompt
    ]
