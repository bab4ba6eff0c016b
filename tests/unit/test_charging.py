"""Token charges against hand counts: every prompt, n × max_tokens per prompt, tools."""

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
        # Tools: their compact JSON / 4, rounded up.
        (
            CHAT,
            {"messages": [user("abcd")], "max_tokens": 1,
             "tools": [{"type": "function", "function": {"name": "f"}}]},
            1 + 1 + 12,  # '[{"type":"function","function":{"name":"f"}}]' is 45 chars.
        ),
        # An assistant turn's tool calls are part of the prompt.
        (
            CHAT,
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}], "max_tokens": 1},
            3 + 1,  # '[{"id":"1"}]' is 12 chars.
        ),
        # One string prompt; the completions default of 16.
        (COMP, {"prompt": "abcde"}, 2 + 16),
        # Four prompts: each pays its own n × max_tokens.
        (COMP, {"prompt": ["ab", "abcdef", "a", "abcdefgh"], "max_tokens": 10, "n": 2},
         (1 + 2 + 1 + 2) + 4 * 2 * 10),
        # Token ids: one prompt of 3 tokens; lists of token ids: two prompts of 3 and 1.
        (COMP, {"prompt": [1, 2, 3], "max_tokens": 4}, 3 + 4),
        (COMP, {"prompt": [[1, 2, 3], [4]]}, 4 + 2 * 16),
        # 1,024 prompts at max_tokens 1,000: a million, not a thousand.
        (COMP, {"prompt": ["x"] * 1024, "max_tokens": 1000}, 1024 + 1024 * 1000),
        # Completions have no max_completion_tokens and no tools.
        (COMP, {"prompt": "abcd", "max_completion_tokens": 99, "tools": ["x" * 400]}, 1 + 16),
        # Nonsense values fall back to the defaults (the request gets a 400 later anyway).
        (COMP, {"prompt": "x", "n": -4, "max_tokens": "9"}, 1 + 16),
        (COMP, {"prompt": "x", "n": True, "max_tokens": True}, 1 + 16),
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
    assert charge_of_body("/v1/models", b"", 1024) == 0


def test_huge_values_are_capped_not_overflowed() -> None:
    body = {"prompt": "x", "n": 10**30, "max_tokens": 10**30}
    assert request_charge(COMP, body, 1024) == 1 + 1024 * 10**9
