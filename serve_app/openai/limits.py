"""The operator's bounds on one request's shape (``security.limits``), checked before any work.

A request beyond them is a 400 naming the exact ``param``, in OpenAI's wording.
"""

from __future__ import annotations

from serve_app.config.security import RequestLimits
from serve_app.errors import APIError
from serve_app.openai.protocol import ChatCompletionRequest, CompletionRequest


def _above(param: str, value: int, limit: int, what: str = "integer") -> APIError:
    kind = {"integer": "value", "array": "length", "string": "length"}[what]
    return APIError(
        f"Invalid '{param}': {what} above maximum {kind}. Expected a {kind} <= {limit}, "
        f"but got {value} instead.",
        param=param,
        code=f"{what}_above_max_{kind}",
    )


def _text_len(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # Content parts, prompts, or token ids (one char each).
        return sum(_text_len(getattr(part, "text", part)) for part in content)
    return 1 if isinstance(content, int) else 0


def check_limits(body: ChatCompletionRequest | CompletionRequest, limits: RequestLimits) -> None:
    """Reject requests beyond the operator's limits with 400 and the exact `param`."""
    if body.n > limits.max_n:
        raise _above("n", body.n, limits.max_n)
    cap = limits.max_tokens_cap
    for param in ("max_completion_tokens", "max_tokens"):
        value = getattr(body, param, None)
        if cap is not None and isinstance(value, int) and value > cap:
            raise _above(param, value, cap)
    if isinstance(body, ChatCompletionRequest):
        if len(body.messages) > limits.max_messages:
            raise _above("messages", len(body.messages), limits.max_messages, "array")
        tools = body.tools or []
        if len(tools) > limits.max_tools:
            raise _above("tools", len(tools), limits.max_tools, "array")
        param, chars = "messages", sum(_text_len(m.content) for m in body.messages)
    else:
        prompts = len(body.prompt_list())
        if prompts > limits.max_prompts:
            raise _above("prompt", prompts, limits.max_prompts, "array")
        param, chars = "prompt", _text_len(body.prompt)
    if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
        raise _above(param, chars, limits.max_prompt_chars, "string")
