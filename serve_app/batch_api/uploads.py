"""Uploads arriving in parts: a router forwards an upload to the batch coordinator a few MiB at a
time, each part written at its offset, so neither process holds a whole file in memory.

Parts are written at their offset (a part sent twice lands on the same bytes), into
``<root>/uploads/<upload_id>``; ``BatchStore.adopt_file`` moves the finished upload into the
store. An upload its router abandoned (it died mid-upload) is swept after ``STALE_S``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

STALE_S = 24 * 3600.0


def _checked(upload_id: str) -> str:
    if not upload_id or not upload_id.replace("-", "").isalnum() or len(upload_id) > 100:
        raise KeyError(upload_id)
    return upload_id


class Uploads:
    def __init__(self, root: Path) -> None:
        self.dir = root / "uploads"
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, upload_id: str) -> Path:
        return self.dir / _checked(upload_id)

    def write(self, upload_id: str, offset: int, data: bytes) -> int:
        """Write one part at ``offset``; the upload's size so far."""
        path = self.path(upload_id)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, data, offset)
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def size(self, upload_id: str) -> int:
        path = self.path(upload_id)
        return path.stat().st_size if path.exists() else 0

    def discard(self, upload_id: str) -> None:
        self.path(upload_id).unlink(missing_ok=True)

    def sweep(self, now: float | None = None) -> int:
        """Drop uploads untouched for ``STALE_S`` (their router died); how many."""
        now = time.time() if now is None else now
        swept = 0
        for path in self.dir.iterdir():
            try:
                if now - path.stat().st_mtime > STALE_S:
                    path.unlink()
                    swept += 1
            except FileNotFoundError:
                pass
        return swept
