"""A batch input file line by line: each line is a request to run or an error line.

Nothing about one line fails the others: malformed JSON, undecodable bytes, a wrong ``url``, a
duplicate ``custom_id``, a body the endpoint would reject (the same validation and
``check_limits`` as over HTTP) each become one error line naming the input line. Only problems
of the file as a whole (no requests, too many) fail a batch, in its ``errors``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from serve_app.config import AppConfig
from serve_app.errors import APIError, ErrorInfo
from serve_app.openai.charging import prompt_count, request_charge
from serve_app.openai.limits import check_limits
from serve_app.openai.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.openai.validation import validation_info

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_CUSTOM_ID = 512
Request = ChatCompletionRequest | CompletionRequest


@dataclass(frozen=True)
class Line:
    """A line that runs: its body stays raw JSON until it is sent (small in memory)."""

    number: int  # 1-based line of the input file.
    custom_id: str
    raw: bytes
    weight: int  # Engine sequences it holds at once: n × prompts.
    tokens: int


@dataclass(frozen=True)
class LineError:
    number: int
    custom_id: str | None
    info: ErrorInfo
    # True: the endpoint would have answered it so (a `response` with its status code);
    # False: the line is not a request at all (malformed, wrong url, duplicate id).
    answered: bool


def parse_request(endpoint: str, body: dict[str, Any]) -> Request:
    model = ChatCompletionRequest if endpoint == "/v1/chat/completions" else CompletionRequest
    return model.model_validate(body | {"stream": False})


def _body_error(endpoint: str, body: dict[str, Any], config: AppConfig) -> ErrorInfo | None:
    try:
        check_limits(parse_request(endpoint, body), config.security.limits)
    except ValidationError as exc:
        # `loc` as FastAPI reports a body's errors, so params read as over HTTP.
        errors = [dict(error) | {"loc": ("body", *error["loc"])} for error in exc.errors()]
        return validation_info(errors)
    except APIError as exc:
        return exc.info
    return None


def _malformed(number: int, message: str, code: str, custom_id: str | None = None) -> LineError:
    info = ErrorInfo(f"Line {number}: {message}", code=code)
    return LineError(number, custom_id, info, answered=False)


def scan(content: bytes, endpoint: str, config: AppConfig) -> Iterator[Line | LineError]:
    """Every non-blank line of ``content`` as a Line or a LineError, in input order."""
    seen: set[str] = set()
    unset = config.security.unset_max_tokens_charge
    for number, raw in enumerate(content.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        try:
            line = json.loads(raw.decode())
        except UnicodeDecodeError:
            yield _malformed(number, "not UTF-8 text.", "invalid_encoding")
            continue
        except ValueError as exc:
            yield _malformed(number, f"not valid JSON ({exc}).", "invalid_json")
            continue
        if not isinstance(line, dict):
            yield _malformed(number, "not a JSON object.", "invalid_request")
            continue
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
            message = f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters."
            yield _malformed(number, message, "invalid_custom_id")
            continue
        if custom_id in seen:
            yield _malformed(number, f"duplicate custom_id {custom_id!r}.", "duplicate_custom_id")
            continue
        seen.add(custom_id)
        if line.get("method", "POST") != "POST" or line.get("url") != endpoint:
            message = (
                f"method must be POST and url the batch's endpoint {endpoint} (got "
                f"{line.get('method', 'POST')} {line.get('url')})."
            )
            yield _malformed(number, message, "invalid_url", custom_id)
            continue
        body = line.get("body")
        if not isinstance(body, dict):
            yield _malformed(number, "body must be a JSON object.", "invalid_body", custom_id)
            continue
        if (error := _body_error(endpoint, body, config)) is not None:
            yield LineError(number, custom_id, error, answered=True)
            continue
        weight = prompt_count(endpoint, body) * max(1, int(body.get("n") or 1))
        tokens = request_charge(endpoint, body, unset)  # The rule the HTTP routes charge by.
        yield Line(number, custom_id, raw, weight, tokens)


@dataclass(frozen=True)
class Summary:
    total: int  # Non-blank lines (requests and error lines).
    tokens: int  # Enqueued tokens of the lines that will run.
    errors: list[dict[str, Any]]  # File-level problems: the batch fails with these.


def summarize(content: bytes, endpoint: str, config: AppConfig) -> Summary:
    total, tokens, limit = 0, 0, config.batch_api.max_lines
    for item in scan(content, endpoint, config):
        total += 1
        if total > limit:
            message = f"The input file has more than {limit} requests; split it (max_lines)."
            return Summary(total, tokens, [file_error("too_many_lines", message)])
        if isinstance(item, Line):
            tokens += item.tokens
    if total == 0:
        return Summary(0, 0, [file_error("empty_file", "The input file has no requests.")])
    return Summary(total, tokens, [])


def file_error(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message, "param": "input_file_id", "line": None}


# Lines of the output and error files (OpenAI's shape) ----------------------------------------


def record_id(batch_id: str, number: int) -> str:
    return f"batch_req-{batch_id.removeprefix('batch-')}-{number}"


def output_record(batch_id: str, line: Line, body: dict[str, Any]) -> dict[str, Any]:
    response = {"status_code": 200, "request_id": body.get("id"), "body": body}
    return {"id": record_id(batch_id, line.number), "custom_id": line.custom_id} | {
        "response": response,
        "error": None,
    }


def error_record(
    batch_id: str, number: int, custom_id: str | None, info: ErrorInfo, answered: bool
) -> dict[str, Any]:
    """An error-file line. ``error`` always names the code and the input ``line``; ``response``
    holds the endpoint's answer when there was one (a body it rejected, a failed request)."""
    response = None
    if answered:
        response = {"status_code": info.status, "request_id": None, "body": info.body()}
    code = info.code or info.type
    return {
        "id": record_id(batch_id, number),
        "custom_id": custom_id,
        "response": response,
        "error": {"code": code, "message": info.message, "line": number},
    }


EXPIRED = ErrorInfo(
    "This request could not be executed before the completion window expired.",
    code="batch_expired",
)
