"""OpenAI's 400 for a request body that fails validation: the offending field as ``param``
(``messages[0].role``), as the router answers it and as a Batch API line records it."""

from __future__ import annotations

import re
from typing import Any

from serve_app.errors import ErrorInfo

_PARAM_PREFIX = re.compile(r"^(?:Value error, )?([a-z_]+(?:\.[a-z_]+)*): ")


def _param_of(error: dict[str, Any]) -> str | None:
    """Dotted field path of a validation error (messages[0].role), minus pydantic's type tags."""
    path = ""
    for part in error.get("loc", ())[1:]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif re.fullmatch(r"[a-z_][A-Za-z0-9_]*", part) and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    if path:
        return path
    match = _PARAM_PREFIX.match(str(error.get("msg", "")))
    return match.group(1) if match else None


# Union members pydantic puts in `loc`; model class names are skipped by their capital letter.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_info(errors: list[Any]) -> ErrorInfo:
    """The 400 for pydantic errors of a request body (``loc`` starting with "body")."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return ErrorInfo(f"Invalid JSON body: {first.get('msg')}", code="invalid_json")
    param = _param_of(first)
    message = _PARAM_PREFIX.sub("", str(first.get("msg", "invalid request")))
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return ErrorInfo(message, param=param, code="invalid_value")
