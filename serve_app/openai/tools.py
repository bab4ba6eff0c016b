"""Tool calls in Qwen2.5's (hermes) format: ``<tool_call>{"name": …, "arguments": …}</tool_call>``.

Three modes: ``auto`` parses what the model wrote; a named ``tool_choice`` and ``required`` were
constrained by structured output (the text *is* the arguments / the list of calls).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from serve_app.openai.protocol import FunctionCallOut, ToolCallOut
from serve_app.openai.protocol.structured import NamedToolChoice, ToolChoice

_START, _END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _call(name: str, arguments: Any) -> ToolCallOut:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCallOut(
        id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCallOut(name=name, arguments=text)
    )


def _from_json(payload: str) -> ToolCallOut | None:
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    return _call(data["name"], data.get("arguments", data.get("parameters", {})))


def parse_auto(text: str) -> tuple[str | None, list[ToolCallOut]]:
    """Split model text into content and the tool calls it wrote."""
    calls: list[ToolCallOut] = []
    for match in _BLOCK.finditer(text):
        call = _from_json(match.group(1))
        if call is None:
            return text, []  # Not a well-formed call: hand the text back untouched.
        calls.append(call)
    if not calls:
        return text, []
    content = _BLOCK.sub("", text).strip()
    return content or None, calls


def parse_forced(text: str, choice: ToolChoice) -> list[ToolCallOut]:
    """Calls from output constrained by a named tool_choice (arguments) or required (a list)."""
    if isinstance(choice, NamedToolChoice):
        return [_call(choice.function.name, text)]
    return [_call(item["name"], item.get("arguments", {})) for item in _complete_items(text)]


def _complete_items(text: str) -> list[dict[str, Any]]:
    """The items of a JSON array that are complete, also when max_tokens cut the array short
    (the grammar does not bound how many calls a model lists)."""
    decoder, items = json.JSONDecoder(), []
    index = text.find("[") + 1
    while index > 0:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        try:
            item, index = decoder.raw_decode(text, index)
        except ValueError:
            break  # The closing "]" or a call cut off mid-way.
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            items.append(item)
    return items


class ToolStream:
    """Per-choice streaming state: turns text deltas into content and tool-call deltas."""

    def __init__(self, choice: ToolChoice | None) -> None:
        self.choice = choice
        self.buffer = ""
        self.calls = 0
        self._named_id: str | None = None

    def feed(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        if isinstance(self.choice, NamedToolChoice):
            # Arguments stream as they are generated, OpenAI-style.
            if self._named_id is None:
                self._named_id = f"call_{uuid.uuid4().hex[:24]}"
                self.calls = 1
                first = {
                    "index": 0,
                    "id": self._named_id,
                    "type": "function",
                    "function": {"name": self.choice.function.name, "arguments": text},
                }
                return None, [first]
            return None, [{"index": 0, "function": {"arguments": text}}] if text else []
        self.buffer += text
        if self.choice == "required":
            return None, []
        return self._drain_auto()

    def _drain_auto(self) -> tuple[str | None, list[dict[str, Any]]]:
        content, deltas = "", []
        while True:
            start = self.buffer.find(_START)
            if start < 0:
                # Hold back a tail that may be the beginning of "<tool_call>".
                keep = next(
                    (k for k in range(len(_START) - 1, 0, -1) if self.buffer.endswith(_START[:k])),
                    0,
                )
                cut = len(self.buffer) - keep
                content, self.buffer = content + self.buffer[:cut], self.buffer[cut:]
                break
            end = self.buffer.find(_END, start)
            if end < 0:
                content, self.buffer = content + self.buffer[:start], self.buffer[start:]
                break
            call = _from_json(self.buffer[start + len(_START) : end].strip())
            block_end = end + len(_END)
            if call is None:
                content += self.buffer[:block_end]
            else:
                content += self.buffer[:start]
                deltas.append(self._delta(call))
            self.buffer = self.buffer[block_end:]
        return content or None, deltas

    def finish(self) -> tuple[str | None, list[dict[str, Any]]]:
        """Flush at the end of the choice: complete calls, or leftover text as content."""
        rest, self.buffer = self.buffer, ""
        if isinstance(self.choice, NamedToolChoice):
            return None, []
        if self.choice == "required":
            return (
                (None, [self._delta(c) for c in parse_forced(rest, "required")])
                if rest
                else (None, [])
            )
        content, calls = parse_auto(rest)
        return content, [self._delta(call) for call in calls]

    def _delta(self, call: ToolCallOut) -> dict[str, Any]:
        index, self.calls = self.calls, self.calls + 1
        return {"index": index, **call.model_dump()}
