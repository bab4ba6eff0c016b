"""Files of the Batch API: uploads streamed to disk in chunks, objects per tenant, reads in chunks.

Every file belongs to an owner (the API key's name, "" without keys); another owner gets 404
and never sees it listed. Blocking I/O: the coordinator calls these from threads.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from serve_app.batch_api.db import Database, durable_rename, new_id
from serve_app.errors import APIError

CHUNK_BYTES = 1024 * 1024
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


def not_found(kind: str, object_id: str) -> APIError:
    return APIError(f"No {kind} with id {object_id!r}.", status=404, code="not_found")


def _valid_id(object_id: str) -> bool:
    return 0 < len(object_id) <= 100 and object_id.replace("-", "").isalnum()


def file_object(
    file_id: str, filename: str, purpose: str, size: int, created_at: int
) -> dict[str, Any]:
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created_at,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


class FileStore:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.files_dir = db.root / "files"
        self.uploads_dir = db.root / "uploads"
        for folder in (self.files_dir, self.uploads_dir):
            folder.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if not _valid_id(file_id):
            raise not_found("file", file_id)
        return self.files_dir / file_id

    # Uploads: any coordinator replica can take the next chunk (state is on disk) -----------
    # A chunk is written at its offset, so a router can keep several in flight; the size is
    # the file's, and its last change the file's mtime: no database write per chunk.

    def start_upload(self, owner: str, filename: str) -> str:
        upload_id = new_id("upload")
        (self.uploads_dir / upload_id).touch()
        with self.db.transaction() as db:
            db.execute(
                "INSERT INTO uploads VALUES (?, ?, ?)",
                (upload_id, owner, filename[:255] or "upload.jsonl"),
            )
        return upload_id

    def _upload(self, owner: str, upload_id: str) -> str:
        row = (
            self.db.connection()
            .execute("SELECT filename FROM uploads WHERE id = ? AND owner = ?", (upload_id, owner))
            .fetchone()
        )
        if row is None or not _valid_id(upload_id):
            raise not_found("upload", upload_id)
        return str(row[0])

    def write_upload(
        self, owner: str, upload_id: str, offset: int, chunk: bytes, limit: int
    ) -> int:
        """Write ``chunk`` at ``offset``; past ``limit`` bytes the upload is dropped (413)."""
        self._upload(owner, upload_id)
        if offset < 0 or offset + len(chunk) > limit:
            self.abort_upload(owner, upload_id)
            raise APIError(
                f"File too large: the limit is {limit} bytes (batch_api.max_file_bytes); split "
                "the requests over several files.",
                status=413,
                code="file_too_large",
            )
        fd = os.open(self.uploads_dir / upload_id, os.O_WRONLY)
        try:
            os.pwrite(fd, chunk, offset)
        finally:
            os.close(fd)
        return offset + len(chunk)

    def finish_upload(self, owner: str, upload_id: str, purpose: str) -> dict[str, Any]:
        filename = self._upload(owner, upload_id)
        part = self.uploads_dir / upload_id
        size = part.stat().st_size
        file_id = new_id("file")
        durable_rename(part, self.path(file_id))
        obj = file_object(file_id, filename, purpose, size, int(time.time()))
        with self.db.transaction() as db:
            db.execute("DELETE FROM uploads WHERE id = ?", (upload_id,))
            self.insert(db, owner, obj)
        return obj

    def abort_upload(self, owner: str, upload_id: str) -> None:
        with self.db.transaction() as db:
            db.execute("DELETE FROM uploads WHERE id = ? AND owner = ?", (upload_id, owner))
        (self.uploads_dir / upload_id).unlink(missing_ok=True)

    def sweep_uploads(self, idle_s: float) -> int:
        """Drop uploads nobody wrote to for ``idle_s`` (a router died mid-upload)."""
        rows = self.db.connection().execute("SELECT id, owner FROM uploads").fetchall()
        stale = 0
        for upload_id, owner in rows:
            part = self.uploads_dir / upload_id
            if not part.exists() or part.stat().st_mtime < time.time() - idle_s:
                self.abort_upload(owner, upload_id)
                stale += 1
        return stale

    # File objects -----------------------------------------------------------------------

    @staticmethod
    def insert(db: Any, owner: str, obj: dict[str, Any]) -> None:
        db.execute(
            "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?)",
            (obj["id"], owner, obj["created_at"], json.dumps(obj)),
        )

    def get(self, owner: str, file_id: str) -> dict[str, Any]:
        row = (
            self.db.connection()
            .execute("SELECT data FROM files WHERE id = ? AND owner = ?", (file_id, owner))
            .fetchone()
        )
        if row is None:
            raise not_found("file", file_id)
        return dict(json.loads(row[0]))

    def list_files(
        self, owner: str, purpose: str | None, after: str | None, limit: int, order: str
    ) -> tuple[list[dict[str, Any]], bool]:
        """Newest first (``order`` desc) or oldest first; ``after``: the previous page's last id."""
        query, params = "SELECT data FROM files WHERE owner = ?", [owner]
        if purpose is not None:
            query += " AND json_extract(data, '$.purpose') = ?"
            params.append(purpose)
        if after is not None:
            query += " AND id < ?" if order == "desc" else " AND id > ?"
            params.append(after)
        query += f" ORDER BY id {'DESC' if order == 'desc' else 'ASC'} LIMIT ?"
        rows = self.db.connection().execute(query, [*params, limit + 1]).fetchall()
        found = [dict(json.loads(r[0])) for r in rows]
        return found[:limit], len(found) > limit

    def delete(self, owner: str, file_id: str) -> None:
        with self.db.transaction() as db:
            if (
                db.execute(
                    "SELECT 1 FROM files WHERE id = ? AND owner = ?", (file_id, owner)
                ).fetchone()
                is None
            ):
                raise not_found("file", file_id)
            marks = ",".join("?" for _ in ACTIVE)
            busy = db.execute(
                f"SELECT id FROM batches WHERE owner = ? AND status IN ({marks}) "
                "AND json_extract(data, '$.input_file_id') = ?",
                (owner, *ACTIVE, file_id),
            ).fetchone()
            if busy is not None:
                raise APIError(
                    f"File {file_id} is the input of batch {busy[0]}, which is still running; "
                    "cancel it or wait for it to end.",
                    status=409,
                    code="file_in_use",
                )
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.path(file_id).unlink(missing_ok=True)

    def chunks(self, file_id: str) -> Iterator[bytes]:
        """The file's bytes a chunk at a time (opened now: a later delete does not cut it)."""
        handle = self.path(file_id).open("rb")

        def read() -> Iterator[bytes]:
            with handle:
                while chunk := handle.read(CHUNK_BYTES):
                    yield chunk

        return read()

    @staticmethod
    def write_durably(lines: Iterable[str], final: Path) -> int:
        """Bytes written: ``lines`` as ``final``, fsynced with its directory; nothing at all
        (and 0) when there are none. A unique temporary name: writers never collide."""
        tmp = final.with_name(f"{final.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        size = 0
        with tmp.open("wb") as handle:
            for line in lines:
                size += handle.write(line.encode() + b"\n")
        if size:
            durable_rename(tmp, final)
        else:
            tmp.unlink()
        return size

    def content(self, file_id: str) -> bytes:
        return self.path(file_id).read_bytes()

    def sweep_tmp(self, older_than_s: float) -> None:
        """Leftovers of a crash mid-publish (``*.tmp``), once nobody can still be writing them."""
        cutoff = time.time() - older_than_s
        for tmp in self.files_dir.glob("*.tmp"):
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink(missing_ok=True)

    def drop_outputs(self, batch_id: str, keep: set[str]) -> None:
        """Output and error files of ``batch_id`` other than ``keep`` (the published ones):
        those of an earlier lease epoch whose publish a crash cut short."""
        for path in self.files_dir.glob(f"file-{batch_id.removeprefix('batch-')}-[oe]*"):
            if path.name not in keep and not path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
