"""The pre-encoded text events of a stream are byte for byte the models' own events."""

from __future__ import annotations

import json

import pytest

from serve_app.openai.chunks import TextEvents
from serve_app.openai.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from serve_app.openai.serving import sse

TEXTS = [
    " Paris",
    'say "hi" \\ back',
    "".join(chr(c) for c in range(32)) + "\x7f\x85\u2028\u2029",
    "日本語 😀 \ud7ff\ue000\uffff",
    "</script>\t\n",
]


def _chat(include_usage: bool) -> TextEvents:
    def model(index: int, text: str) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=DeltaMessage(content=text))
        return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m\u2028x", choices=[choice])

    def dump(chunk: ChatCompletionChunk) -> str:
        return chunk.model_dump_json(exclude=None if include_usage else {"usage"})

    return TextEvents(model, dump)  # type: ignore[arg-type]


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_text_events_are_the_models_dump(include_usage: bool) -> None:
    events = _chat(include_usage)
    for index in (0, 3):
        for text in TEXTS:
            choice = ChatChunkChoice(index=index, delta=DeltaMessage(content=text))
            chunk = ChatCompletionChunk(
                id="chatcmpl-1", created=7, model="m\u2028x", choices=[choice]
            )
            expected = sse(chunk.model_dump_json(exclude=None if include_usage else {"usage"}))
            assert events.event(index, text) == expected
            payload = json.loads(expected.removeprefix("data: "))
            assert payload["choices"][0]["delta"] == {"content": text}
            assert ("usage" in payload) is include_usage


def test_completion_text_events_are_the_models_dump() -> None:
    def model(index: int, text: str) -> CompletionResponse:
        choice = CompletionChoice(index=index, text=text)
        return CompletionResponse(id="cmpl-1", created=7, model="m", choices=[choice])

    events = TextEvents(model, lambda m: m.model_dump_json(exclude_none=False))
    for text in TEXTS:
        assert events.event(1, text) == sse(model(1, text).model_dump_json(exclude_none=False))


def test_a_template_without_its_text_is_refused() -> None:
    events = TextEvents(
        lambda i, text: CompletionResponse(id="x", created=1, model="m", choices=[]),
        lambda m: m.model_dump_json(),
    )
    with pytest.raises(ValueError, match="exactly once"):
        events.event(0, "a")
