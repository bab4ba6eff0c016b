"""Storage of the OpenAI Batch API: SQLite for file and batch objects, a directory for bytes.

Default location ``$SERVE_APP_CACHE/batches`` (``$SERVE_APP_BATCH_DIR`` overrides). Progress of
a running batch is appended to ``<batch_id>.output.partial`` / ``.error.partial`` line by line,
so a restarted router resumes a batch without redoing or duplicating finished lines.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


def default_root() -> Path:
    if env := os.environ.get("SERVE_APP_BATCH_DIR"):
        return Path(env).expanduser().absolute()
    from serve_app.models import cache_dir

    return cache_dir() / "batches"


_last_stamp = [0]
_stamp_lock = threading.Lock()


def new_id(prefix: str) -> str:
    """Ids sort in creation order (a strictly increasing µs stamp first, then randomness), so
    objects created within one second still list newest first."""
    with _stamp_lock:
        _last_stamp[0] = max(time.time_ns() // 1000, _last_stamp[0] + 1)
        stamp = _last_stamp[0]
    return f"{prefix}-{stamp:014x}{secrets.token_hex(5)}"


class BatchStore:
    def __init__(self, root: Path | None = None) -> None:
        self.root = root or default_root()
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.root / "batches.sqlite3", check_same_thread=False)
        with self._db:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, created_at INTEGER, "
                "data TEXT)"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, created_at INTEGER, "
                "status TEXT, data TEXT)"
            )

    # Files ------------------------------------------------------------------------------

    def create_file(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        file_id = new_id("file")
        file: dict[str, Any] = {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        path = self.file_path(file_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(content)
        tmp.replace(path)
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO files VALUES (?, ?, ?)",
                (file["id"], file["created_at"], json.dumps(file)),
            )
        return file

    def file_path(self, file_id: str) -> Path:
        if not file_id.replace("-", "").isalnum():
            raise KeyError(file_id)
        return self.files_dir / file_id

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT data FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def file_content(self, file_id: str) -> bytes:
        return self.file_path(file_id).read_bytes()

    def delete_file(self, file_id: str) -> bool:
        with self._lock, self._db:
            deleted = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        if deleted:
            self.file_path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    # Batches ----------------------------------------------------------------------------

    def save_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO batches VALUES (?, ?, ?, ?)",
                (batch["id"], batch["created_at"], batch["status"], json.dumps(batch)),
            )
        return batch

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT data FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def update_batch(self, batch_id: str, **fields: Any) -> dict[str, Any]:
        batch = self.get_batch(batch_id)
        if batch is None:
            raise KeyError(batch_id)
        batch.update(fields)
        return self.save_batch(batch)

    def list_batches(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Newest first; ``after`` is the id of the last batch of the previous page."""
        query, params = "SELECT data FROM batches", []
        if after is not None and (cursor := self.get_batch(after)) is not None:
            query += " WHERE (created_at, id) < (?, ?)"
            params = [cursor["created_at"], cursor["id"]]
        query += " ORDER BY created_at DESC, id DESC LIMIT ?"
        with self._lock:
            rows = self._db.execute(query, [*params, limit + 1]).fetchall()
        batches = [dict(json.loads(r[0])) for r in rows]
        return batches[:limit], len(batches) > limit

    def active_batches(self) -> list[dict[str, Any]]:
        marks = ",".join("?" for _ in ACTIVE)
        with self._lock:
            rows = self._db.execute(
                f"SELECT data FROM batches WHERE status IN ({marks}) ORDER BY created_at", ACTIVE
            ).fetchall()
        return [dict(json.loads(r[0])) for r in rows]

    # Progress of a running batch ---------------------------------------------------------

    def partial_path(self, batch_id: str, kind: str) -> Path:
        return self.root / f"{batch_id}.{kind}.partial"

    def read_partial(self, batch_id: str, kind: str) -> list[dict[str, Any]]:
        """Complete lines only; a torn last line from a crash is dropped (and rewritten)."""
        path = self.partial_path(batch_id, kind)
        if not path.exists():
            return []
        lines = []
        for line in path.read_text().split("\n"):  # Not splitlines: U+2028 is no line end.
            try:
                lines.append(json.loads(line))
            except ValueError:
                break
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
        tmp.replace(path)
        return lines

    def append_partial(self, batch_id: str, kind: str, line: dict[str, Any]) -> None:
        with self._lock, self.partial_path(batch_id, kind).open("a") as handle:
            handle.write(json.dumps(line) + "\n")

    def finish_partial(self, batch_id: str, kind: str, purpose: str) -> str | None:
        """Turn a partial file into a stored file; its id, or None when it has no lines."""
        path = self.partial_path(batch_id, kind)
        content = path.read_bytes() if path.exists() else b""
        file_id = None
        if content:
            file_id = self.create_file(content, f"{batch_id}_{kind}.jsonl", purpose)["id"]
        path.unlink(missing_ok=True)
        return file_id
