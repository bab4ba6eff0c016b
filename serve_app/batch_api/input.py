"""Batch input files: which lines run, and which are rejected with their line number.

One bad line (malformed JSON, undecodable bytes, a wrong url, a duplicate custom_id) does not
refuse the whole file: it becomes a line of the batch's error file, with its ``custom_id``
when known, its line number and a code, and the other lines run. Only a file with no line that
can run is refused at create (400 naming the first problem).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from serve_app.errors import APIError


@dataclass
class BatchInput:
    lines: list[dict[str, Any]] = field(default_factory=list)  # The request lines that run.
    rejected: list[dict[str, Any]] = field(default_factory=list)  # line, custom_id, code, message
    numbers: dict[str, int] = field(default_factory=dict)  # custom_id -> its line in the file

    @property
    def total(self) -> int:
        return len(self.lines) + len(self.rejected)


def parse_input(content: bytes, endpoint: str) -> BatchInput:
    parsed, seen = BatchInput(), set[str]()
    # JSONL lines end at \n (str.splitlines would also split inside a string holding U+2028).
    for number, raw_bytes in enumerate(content.replace(b"\r\n", b"\n").split(b"\n"), start=1):
        if not raw_bytes.strip():
            continue
        line, custom_id, problem = _check(raw_bytes, endpoint, seen)
        if problem is None and custom_id is not None:
            seen.add(custom_id)
            parsed.lines.append(line)
            parsed.numbers[custom_id] = number
        elif problem is not None:
            code, message = problem
            parsed.rejected.append(
                {"line": number, "custom_id": custom_id, "code": code, "message": message}
            )
    if not parsed.lines:
        if not parsed.rejected:
            raise APIError("The input file has no requests.", param="input_file_id")
        first = parsed.rejected[0]
        raise APIError(
            f"No line of the input file can run; line {first['line']}: {first['message']}",
            param="input_file_id",
            code=first["code"],
        )
    return parsed


def _check(
    raw_bytes: bytes, endpoint: str, seen: set[str]
) -> tuple[dict[str, Any], str | None, tuple[str, str] | None]:
    """(line, its custom_id if any, (code, message) of its problem or None)."""
    try:
        line = json.loads(raw_bytes.decode())
    except UnicodeDecodeError:
        return {}, None, ("invalid_jsonl", "not UTF-8 text")
    except ValueError as exc:
        return {}, None, ("invalid_jsonl", f"not valid JSON: {exc}")
    if not isinstance(line, dict):
        return {}, None, ("invalid_line", "not an object with custom_id, method, url and body")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return line, None, ("invalid_line", "custom_id must be a non-empty string")
    if custom_id in seen:
        return line, custom_id, ("duplicate_id", f"duplicate custom_id {custom_id!r}")
    if not isinstance(line.get("body"), dict):
        return line, custom_id, ("invalid_line", "body must be an object")
    if line.get("method", "POST") != "POST" or line.get("url") != endpoint:
        message = (
            f"method must be POST and url must be the batch endpoint {endpoint} "
            f"(got {line.get('method')} {line.get('url')})"
        )
        return line, custom_id, ("invalid_url", message)
    return line, custom_id, None
