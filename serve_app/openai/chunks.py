"""Pre-encoded SSE events for the streamed chunk that carries only text, one per token.

Almost every event of a stream is one choice with a few characters of new text and nothing
else. Building the pydantic chunk and dumping it costs more than the rest of the router's work
on that token; here the event is the chunk's own JSON (dumped once per stream and choice by the
same models, text left as a mark) with the text's JSON put in the mark's place: the bytes are
the same as the models' dump. Anything else (a finish reason, logprobs, tool calls, several
choices) goes through the models.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from pydantic import BaseModel

from serve_app.openai.serving import LINE_SEPARATORS

# A text no token decodes to (private-use characters): its JSON splits the template.
_MARK = "\ue000\ue001text\ue001\ue000"
_MARK_JSON = json.dumps(_MARK, ensure_ascii=False)


class TextEvents:
    """SSE events of text-only chunks of one stream, by choice index."""

    def __init__(
        self, chunk_with_text: Callable[[int, str], BaseModel], dump: Callable[[BaseModel], str]
    ) -> None:
        """``chunk_with_text(index, text)``: the stream's chunk model for one choice with only
        ``text``; ``dump(chunk)``: its JSON as the stream dumps it."""
        self._chunk_with_text = chunk_with_text
        self._dump = dump
        self._templates: dict[int, tuple[str, str]] = {}

    def event(self, index: int, text: str) -> str:
        """``data: <the chunk's JSON>`` for choice ``index`` with only ``text``."""
        template = self._templates.get(index)
        if template is None:
            template = self._templates[index] = self._template(index)
        head, tail = template
        return head + json.dumps(text, ensure_ascii=False).translate(LINE_SEPARATORS) + tail

    def _template(self, index: int) -> tuple[str, str]:
        payload = self._dump(self._chunk_with_text(index, _MARK))
        head, mark, tail = payload.partition(_MARK_JSON)
        if not mark or _MARK_JSON in tail:
            raise ValueError("the chunk's JSON does not hold its text exactly once")
        return "data: " + head.translate(LINE_SEPARATORS), tail.translate(LINE_SEPARATORS) + "\n\n"
