"""Ids of Batch API objects."""

from __future__ import annotations

import secrets
import threading
import time

_last_stamp = [0]
_stamp_lock = threading.Lock()


def new_id(prefix: str) -> str:
    """Ids sort in creation order (a strictly increasing µs stamp first, then randomness), so
    objects created within one second still list newest first."""
    with _stamp_lock:
        _last_stamp[0] = max(time.time_ns() // 1000, _last_stamp[0] + 1)
        stamp = _last_stamp[0]
    return f"{prefix}-{stamp:014x}{secrets.token_hex(5)}"
