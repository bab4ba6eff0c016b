"""Workloads generated locally (no downloads), seeded: OpenAI chat bodies ready to send.

- ``random``: random prompt lengths from a word list, fixed output length (``ignore_eos``).
- ``contracts``: contract-clause summaries (the seed scenario's 100 clauses).
- ``sentiment``: product reviews → JSON via ``response_format`` ``json_schema``.
- ``longdoc``: long-document summarization (a few thousand prompt tokens).
- ``shared_prefix``: one long shared system prompt, different questions (prefix caching).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from loadtest.prefix_cache import CLAUSES, system_prompt

WORDS = [
    "the",
    "a",
    "model",
    "server",
    "request",
    "token",
    "batch",
    "cache",
    "engine",
    "latency",
    "river",
    "mountain",
    "city",
    "library",
    "robot",
    "ocean",
    "forest",
    "contract",
    "party",
    "notice",
    "payment",
    "clause",
    "market",
    "signal",
    "vector",
    "kernel",
    "graph",
    "memory",
    "thread",
    "queue",
    "stream",
    "window",
    "budget",
    "design",
    "review",
    "quality",
    "price",
    "order",
    "delivery",
]
PARTIES = ["Acme Corp", "Globex Ltd", "Initech", "Umbrella GmbH", "Stark Industries", "Wayne LLC"]
PRODUCTS = ["headphones", "coffee maker", "laptop stand", "running shoes", "desk lamp", "kettle"]
OPINIONS = {
    "positive": ["works perfectly", "exceeded my expectations", "great value", "sturdy and quiet"],
    "negative": ["broke after a week", "arrived damaged", "much louder than advertised", "refund"],
    "neutral": ["does the job", "about what I expected", "average build", "fine for the price"],
}
SENTIMENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["sentiment", "score"],
    "additionalProperties": False,
}


def _chat(model: str, user: str, max_tokens: int, system: str | None = None) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def random_lengths(
    model: str, count: int, max_tokens: int, seed: int, min_words: int = 16, max_words: int = 128
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
        body = _chat(model, f"#{i} Continue this text: {words}", max_tokens)
        out.append(body | {"ignore_eos": True})
    return out


def contract_clause(i: int, rng: random.Random) -> str:
    a, b = rng.sample(PARTIES, 2)
    kind = CLAUSES[i % len(CLAUSES)]
    days = rng.choice([10, 15, 30, 45, 60, 90])
    return (
        f"Section {i + 1} ({kind.title()}). {a} (the 'Provider') and {b} (the 'Client') agree "
        f"that, with respect to {kind}, either party shall give the other no less than {days} "
        f"days' written notice before exercising any right under this section; obligations "
        f"arising before such notice survive, and any dispute about {kind} shall first be "
        f"escalated to senior management for {rng.choice([5, 10, 20])} business days."
    )


def contracts(model: str, count: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        _chat(
            model,
            f"Summarize this contract clause in one sentence:\n\n{contract_clause(i, rng)}",
            max_tokens,
            system="You are a concise legal assistant.",
        )
        for i in range(count)
    ]


def sentiment(model: str, count: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        mood = rng.choice(list(OPINIONS))
        review = f"Review #{i}: the {rng.choice(PRODUCTS)} {rng.choice(OPINIONS[mood])}."
        body = _chat(model, f"Classify the sentiment of this review as JSON.\n{review}", max_tokens)
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "sentiment", "schema": SENTIMENT_SCHEMA, "strict": True},
        }
        out.append(body)
    return out


def longdoc(
    model: str, count: int, max_tokens: int, seed: int, clauses: int = 24
) -> list[dict[str, Any]]:
    """~``clauses`` × 75 prompt tokens each (24 → ~1.8k tokens, inside a 4k window)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        doc = "\n".join(contract_clause(j, rng) for j in range(clauses))
        out.append(_chat(model, f"Document {i}:\n{doc}\n\nSummarize the document.", max_tokens))
    return out


def shared_prefix(model: str, count: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    system = system_prompt()
    return [
        _chat(
            model,
            f"Question {i}: summarize the {rng.choice(CLAUSES)} clause in one sentence.",
            max_tokens,
            system=system,
        )
        for i in range(count)
    ]


WORKLOADS: dict[str, Callable[[str, int, int, int], list[dict[str, Any]]]] = {
    "random": random_lengths,
    "contracts": contracts,
    "sentiment": sentiment,
    "longdoc": longdoc,
    "shared_prefix": shared_prefix,
}


def build(name: str, model: str, count: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name](model, count, max_tokens, seed)
