"""Token charges against hand counts: every prompt, n × max_tokens per prompt, tools.

The cases marked "old:" are ones the estimate before issue 19 got wrong (it charged n × the
budget once per request and ignored tools and tool calls)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from serve_app.openai.charging import charge_of_body, request_charge

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        # 8 chars = 2 tokens; n 3 × max_tokens 5 = 15.
        (CHAT, {"messages": [user("abcdefgh")], "max_tokens": 5, "n": 3}, 2 + 15),
        # Two messages: 9 chars → 3, 1 char → 1; max_completion_tokens wins over max_tokens.
        (
            CHAT,
            {"messages": [user("abcdefghi"), user("x")], "max_tokens": 50,
             "max_completion_tokens": 7},
            3 + 1 + 7,
        ),
        # Content parts count their text; unset max_tokens costs unset_max_tokens_charge.
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]},
         1 + 1024),
        # Tools: their compact JSON / 4, rounded up (old: ignored).
        (
            CHAT,
            {"messages": [user("abcd")], "max_tokens": 1,
             "tools": [{"type": "function", "function": {"name": "f"}}]},
            1 + 1 + 12,  # '[{"type":"function","function":{"name":"f"}}]' is 45 chars.
        ),
        # Tools are one prompt's, paid once however many choices (n 2 × 3).
        (
            CHAT,
            {"messages": [user("abcd"), {"role": "tool", "content": "abcde", "tool_call_id": "1"}],
             "max_completion_tokens": 3, "n": 2,
             "tools": [{"type": "function", "function": {"name": "f"}}]},
            1 + 2 + 2 * 3 + 12,
        ),
        # An assistant turn's tool calls are part of the prompt (old: ignored).
        (
            CHAT,
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}], "max_tokens": 1},
            3 + 1,  # '[{"id":"1"}]' is 12 chars.
        ),
        # One string prompt; the completions default of 16.
        (COMP, {"prompt": "abcde"}, 2 + 16),
        # max_tokens null runs to the end of the window: the unset charge (old: 16).
        (COMP, {"prompt": "abcde", "max_tokens": None}, 2 + 1024),
        (COMP, {"prompt": ["ab", "cd"], "max_tokens": None, "n": 2}, 2 + 2 * 2 * 1024),
        # Four prompts: each pays its own n × max_tokens (old: 6 + 2 × 10).
        (COMP, {"prompt": ["ab", "abcdef", "a", "abcdefgh"], "max_tokens": 10, "n": 2},
         (1 + 2 + 1 + 2) + 4 * 2 * 10),
        # Token ids: one prompt of 3 tokens; lists of token ids: two prompts of 3 and 1
        # (old: 4 + 16).
        (COMP, {"prompt": [1, 2, 3], "max_tokens": 4}, 3 + 4),
        (COMP, {"prompt": [[1, 2, 3], [4]]}, 4 + 2 * 16),
        # 1,024 prompts at max_tokens 1,000: a million, not a thousand (old: 2,024).
        (COMP, {"prompt": ["x"] * 1024, "max_tokens": 1000}, 1024 + 1024 * 1000),
        # Completions have no max_completion_tokens and no tools (old: charged 99).
        (COMP, {"prompt": "abcd", "max_completion_tokens": 99, "tools": ["x" * 400]}, 1 + 16),
        # Nonsense values fall back to the defaults (the request gets a 400 later anyway).
        (COMP, {"prompt": "x", "n": -4, "max_tokens": "9"}, 1 + 16),
        (COMP, {"prompt": "x", "n": True, "max_tokens": True}, 1 + 16),  # old: 1 + 1.
        (CHAT, {"messages": "hello", "max_tokens": 3}, 0 + 3),
        ("/v1/models", {"prompt": "x" * 100}, 0),
    ],
)  # fmt: skip
def test_charge_matches_hand_count(endpoint: str, body: dict[str, Any], expected: int) -> None:
    assert request_charge(endpoint, body, 1024) == expected
    assert charge_of_body(endpoint, json.dumps(body).encode(), 1024) == expected


def test_unparseable_bodies_cost_nothing() -> None:
    assert charge_of_body(COMP, b"{not json", 1024) == 0
    assert charge_of_body(COMP, b"[1, 2]", 1024) == 0
    assert charge_of_body(COMP, b'{"prompt": "\xff"}', 1024) == 0  # Not UTF-8.
    assert charge_of_body("/v1/models", b"", 1024) == 0
    # Deeper than json.loads goes: RecursionError, not ValueError (old: raised).
    deep = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert charge_of_body(CHAT, deep, 1024) == 0


def test_the_unset_chat_charge_is_the_operators() -> None:
    body = {"messages": [user("abcd")], "n": 3}
    assert request_charge(CHAT, body, 100) == 1 + 3 * 100
    assert request_charge(COMP, {"prompt": "abcd", "max_tokens": None}, 100) == 1 + 100


def test_huge_values_are_capped_not_overflowed() -> None:
    body = {"prompt": "x", "n": 10**30, "max_tokens": 10**30}
    assert request_charge(COMP, body, 1024) == 1 + 1024 * 10**9
