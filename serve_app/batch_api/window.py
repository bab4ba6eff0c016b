"""A batch's completion window: how long it may run before it ends ``expired``.

OpenAI accepts only ``24h``; shorter windows (``1h``, ``30m``, ``90s``) are our extension, for
jobs that are worthless after a deadline. What has not run by then is an error line with code
``batch_expired`` (OpenAI's), next to the lines that finished.
"""

from __future__ import annotations

import re
from typing import Any

from serve_app.errors import APIError

DEFAULT_WINDOW = "24h"
MAX_WINDOW_S = 24 * 3600
_WINDOW = re.compile(r"([1-9][0-9]{0,5})([smh])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def window_seconds(window: str) -> int:
    """Seconds in ``window`` (e.g. ``24h``, ``30m``, ``90s``); a 400 naming the rule if not."""
    match = _WINDOW.fullmatch(window)
    seconds = int(match[1]) * _UNIT_S[match[2]] if match else 0
    if not 1 <= seconds <= MAX_WINDOW_S:
        raise APIError(
            f"completion_window {window!r}: give a number and a unit, s, m or h, up to 24h "
            "(e.g. 24h, 1h, 30m).",
            param="completion_window",
            code="invalid_value",
        )
    return seconds


def expired_line(record_id: str, custom_id: str, window: str) -> dict[str, Any]:
    """The error-file line of a request the batch did not run within its window."""
    message = f"This request could not be executed before the completion window ({window}) ended."
    error = {"code": "batch_expired", "message": message}
    return {"id": record_id, "custom_id": custom_id, "response": None, "error": error}
