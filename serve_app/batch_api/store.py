"""Storage of the OpenAI Batch API: SQLite for file and batch objects, a directory for bytes.

Default location ``$SERVE_APP_CACHE/batches`` (``$SERVE_APP_BATCH_DIR`` overrides). Progress of
a running batch is appended to ``<batch_id>.output.partial`` / ``.error.partial`` line by line,
so a restarted coordinator resumes a batch without redoing or duplicating finished lines.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from serve_app.batch_api.ids import new_id
from serve_app.batch_api.leases import ACTIVE, BatchLeases, LeaseLost
from serve_app.batch_api.partials import PartialFiles

__all__ = ["ACTIVE", "BatchStore", "LeaseLost", "new_id"]
COPY_CHUNK = 1024 * 1024


def default_root() -> Path:
    if env := os.environ.get("SERVE_APP_BATCH_DIR"):
        return Path(env).expanduser().absolute()
    from serve_app.models import cache_dir

    return cache_dir() / "batches"


class BatchStore(PartialFiles):
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
            for table in ("files", "batches"):  # Stores from before owners: one tenant, "".
                columns = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
                if "owner" not in columns:
                    self._db.execute(
                        f"ALTER TABLE {table} ADD COLUMN owner TEXT NOT NULL DEFAULT ''"
                    )
                if table == "batches" and "queued_tokens" not in columns:
                    self._db.execute(
                        "ALTER TABLE batches ADD COLUMN queued_tokens INTEGER NOT NULL DEFAULT 0"
                    )
        self.leases = BatchLeases(self._db, self._lock)

    # Files ------------------------------------------------------------------------------

    def create_file(
        self, content: bytes, filename: str, purpose: str, owner: str = ""
    ) -> dict[str, Any]:
        """``owner``: the API key name it belongs to (only that key sees it; "" without keys)."""
        return self.create_file_from(io.BytesIO(content), filename, purpose, owner)

    def create_file_from(
        self,
        source: BinaryIO,
        filename: str,
        purpose: str,
        owner: str = "",
        *,
        file_id: str | None = None,
    ) -> dict[str, Any]:
        """Copy ``source`` in chunks (an upload spooled to disk never passes through memory
        whole), make it durable, then record it: a crash leaves no row without its file.
        ``file_id``: replace that file (a batch's output, published again after a crash)."""
        file_id = file_id or new_id("file")
        tmp = self.file_path(file_id).with_suffix(".tmp")
        with tmp.open("wb") as out:
            shutil.copyfileobj(source, out, COPY_CHUNK)
        return self.adopt_file(tmp, filename, purpose, owner, file_id=file_id)

    def adopt_file(
        self,
        source: Path,
        filename: str,
        purpose: str,
        owner: str = "",
        *,
        file_id: str | None = None,
    ) -> dict[str, Any]:
        """Move ``source`` (a file on the store's own disk, e.g. a finished upload) into the
        store: made durable and renamed first, then recorded, so a crash leaves no row
        without its file."""
        file_id = file_id or new_id("file")
        path = self.file_path(file_id)
        with source.open("rb+") as out:
            size = os.fstat(out.fileno()).st_size
            os.fsync(out.fileno())
        source.replace(path)
        _fsync_dir(path.parent)  # The rename itself survives a power cut.
        file: dict[str, Any] = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO files (id, created_at, data, owner) VALUES (?, ?, ?, ?)",
                (file["id"], file["created_at"], json.dumps(file), owner),
            )
        return file

    def file_path(self, file_id: str) -> Path:
        if not file_id.replace("-", "").isalnum():
            raise KeyError(file_id)
        return self.files_dir / file_id

    def get_file(self, file_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """The file, if it exists and (``owner`` given) belongs to ``owner``."""
        query, params = _owned("SELECT data FROM files WHERE id = ?", [file_id], owner)
        with self._lock:
            row = self._db.execute(query, params).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def file_content(self, file_id: str) -> bytes:
        return self.file_path(file_id).read_bytes()

    def delete_file(self, file_id: str, owner: str | None = None) -> bool:
        query, params = _owned("DELETE FROM files WHERE id = ?", [file_id], owner)
        with self._lock, self._db:
            deleted = self._db.execute(query, params).rowcount
        if deleted:
            self.file_path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    # Batches ----------------------------------------------------------------------------

    def save_batch(self, batch: dict[str, Any], owner: str = "") -> dict[str, Any]:
        """Insert (owned by ``owner``) or update; an update keeps the batch's owner."""
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO batches (id, created_at, status, data, owner) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET status = excluded.status, data = excluded.data",
                (batch["id"], batch["created_at"], batch["status"], json.dumps(batch), owner),
            )
        return batch

    def create_batch_within(
        self,
        batch: dict[str, Any],
        owner: str,
        tokens: int,
        limit: int | None,
        *,
        holder: str = "",
        lease_s: float = 0.0,
    ) -> int | None:
        """Insert a new batch charged ``tokens`` unless ``owner``'s unfinished batches plus it
        would pass ``limit``: then nothing is stored and the tokens enqueued are returned.
        One immediate transaction, so concurrent creates (other processes too) cannot both
        slip under the limit. ``holder`` gets its lease for ``lease_s``."""
        marks = ",".join("?" for _ in ACTIVE)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                enqueued = self._db.execute(
                    "SELECT COALESCE(SUM(queued_tokens), 0) FROM batches "
                    f"WHERE owner = ? AND status IN ({marks})",
                    (owner, *ACTIVE),
                ).fetchone()[0]
                if limit is not None and enqueued + tokens > limit:
                    self._db.execute("ROLLBACK")
                    return int(enqueued)
                self._db.execute(
                    "INSERT INTO batches (id, created_at, status, data, owner, queued_tokens, "
                    "holder, lease_until) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (batch["id"], batch["created_at"], batch["status"], json.dumps(batch),
                     owner, tokens, holder, self.leases.until(lease_s) if holder else 0.0),
                )  # fmt: skip
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return None

    def get_batch(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """The batch, if it exists and (``owner`` given) belongs to ``owner``."""
        query, params = _owned("SELECT data FROM batches WHERE id = ?", [batch_id], owner)
        with self._lock:
            row = self._db.execute(query, params).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def batch_owner(self, batch_id: str) -> str:
        with self._lock:
            row = self._db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return "" if row is None else str(row[0])

    def update_batch(
        self,
        batch_id: str,
        *,
        holder: str | None = None,
        expect: tuple[str, ...] | None = None,
        **fields: Any,
    ) -> dict[str, Any] | None:
        """Set ``fields`` in one immediate transaction (no update from another process is
        lost). ``holder``: only under its lease (LeaseLost otherwise). ``expect``: only from
        one of these statuses (None otherwise)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if holder is not None:
                    self.leases.check(batch_id, holder)
                row = self._db.execute(
                    "SELECT data FROM batches WHERE id = ?", (batch_id,)
                ).fetchone()
                if row is None:
                    raise KeyError(batch_id)
                batch = dict(json.loads(row[0]))
                if expect is not None and batch["status"] not in expect:
                    self._db.execute("ROLLBACK")
                    return None
                batch.update(fields)
                self._db.execute(
                    "UPDATE batches SET status = ?, data = ? WHERE id = ?",
                    (batch["status"], json.dumps(batch), batch_id),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return batch

    def list_batches(
        self, after: str | None, limit: int, owner: str | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        """Newest first (``owner``'s only, when given); ``after`` is the id of the last batch
        of the previous page."""
        query, params = "SELECT data FROM batches WHERE 1", []
        if after is not None and (cursor := self.get_batch(after, owner)) is not None:
            query += " AND (created_at, id) < (?, ?)"
            params = [cursor["created_at"], cursor["id"]]
        query, params = _owned(query, params, owner)
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _owned(query: str, params: list[Any], owner: str | None) -> tuple[str, list[Any]]:
    """``query`` narrowed to rows of ``owner``; None: any owner (the service's own lookups)."""
    if owner is None:
        return query, params
    return f"{query} AND owner = ?", [*params, owner]
