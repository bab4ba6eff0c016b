"""The Batch API's store, in the domain's verbs; each verb is one atomic SQLite transaction.

``create`` checks the key's enqueued-token limit and inserts in one step. ``claim`` leases
waiting batches to one coordinator (owner id, expiry, epoch); ``renew`` is its heartbeat;
``record`` adds finished lines only while the lease is still held (a coordinator that lost its
lease can never write into a batch another one runs); ``publish`` writes the output and error
files durably, then records them, ends the batch and drops its recorded lines in one step, so
a crash at any point resumes without running a recorded line again. Blocking: call from threads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from serve_app.batch_api.db import Database, default_root
from serve_app.batch_api.files import ACTIVE, FileStore, file_object, not_found
from serve_app.errors import APIError

# Where each way of ending records its time on the batch object.
STAMPS = {end: f"{end}_at" for end in ("completed", "expired", "cancelled", "failed")}


class LeaseLost(Exception):
    """This coordinator no longer owns the batch (its lease expired and another took it)."""


def public(batch: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI batch object, without this store's private keys."""
    return {key: value for key, value in batch.items() if not key.startswith("_")}


class BatchStore:
    def __init__(self, root: Path | None = None) -> None:
        self.db = Database(root or default_root())
        self.files = FileStore(self.db)

    # What clients do --------------------------------------------------------------------

    def create(
        self, owner: str, batch: dict[str, Any], tokens: int, limit: int | None
    ) -> dict[str, Any]:
        """Insert a new batch, unless the key's unfinished batches plus this one would exceed
        ``limit`` enqueued tokens (429 with the numbers)."""
        marks = ",".join("?" for _ in ACTIVE)
        with self.db.transaction() as db:
            enqueued, running = db.execute(
                f"SELECT COALESCE(SUM(tokens), 0), COUNT(*) FROM batches WHERE owner = ? "
                f"AND status IN ({marks})",
                (owner, *ACTIVE),
            ).fetchone()
            if limit is not None and enqueued + tokens > limit:
                raise APIError(
                    f"Enqueued token limit reached for this key: the batch needs {tokens} "
                    f"tokens and {enqueued} of its {limit} are already enqueued in {running} "
                    "unfinished batches. Wait for them to finish, or split the file.",
                    status=429,
                    type="tokens",
                    code="token_limit_exceeded",
                )
            values = (batch["id"], owner, batch["created_at"], batch["status"], tokens)
            insert = "INSERT INTO batches VALUES (?, ?, ?, ?, ?, NULL, NULL, 0, ?)"
            db.execute(insert, (*values, json.dumps(batch)))
        return public(batch)

    def get(self, owner: str | None, batch_id: str) -> dict[str, Any]:
        query, params = "SELECT data FROM batches WHERE id = ?", [batch_id]
        if owner is not None:
            query, params = query + " AND owner = ?", [batch_id, owner]
        row = self.db.connection().execute(query, params).fetchone()
        if row is None:
            raise not_found("batch", batch_id)
        return dict(json.loads(row[0]))

    def list_batches(
        self, owner: str, after: str | None, limit: int
    ) -> tuple[list[dict[str, Any]], bool]:
        """Newest first; ``after``: the last id of the previous page (ids sort by creation)."""
        query, params = "SELECT data FROM batches WHERE owner = ?", [owner]
        if after is not None:
            query, params = query + " AND id < ?", [owner, after]
        rows = self.db.connection().execute(
            query + " ORDER BY id DESC LIMIT ?", [*params, limit + 1]
        )
        found = [public(json.loads(row[0])) for row in rows.fetchall()]
        return found[:limit], len(found) > limit

    def request_cancel(self, owner: str, batch_id: str) -> dict[str, Any]:
        with self.db.transaction() as db:
            batch = self._read(db, batch_id, owner)
            if batch["status"] not in ("validating", "in_progress"):
                raise APIError(
                    f"Cannot cancel a batch that is {batch['status']}.", code="invalid_state"
                )
            return public(self._write(db, batch, status="cancelling", cancelling_at=_now()))

    # What coordinators do ---------------------------------------------------------------

    def claim(
        self, owner_id: str, lease_s: float, most: int, running: Collection[str] = ()
    ) -> list[tuple[dict[str, Any], int]]:
        """Lease up to ``most`` unfinished batches nobody holds (or whose owner stopped
        renewing), oldest first: [(batch, lease epoch)]. Never one of ``running`` (the
        caller's own runs: a lease it renewed late is still its run, not a second one)."""
        if most <= 0:
            return []
        now = time.time()
        marks = ",".join("?" for _ in ACTIVE)
        mine = ",".join("?" for _ in running)
        not_mine = f"AND id NOT IN ({mine}) " if running else ""
        with self.db.transaction() as db:
            rows = db.execute(
                f"SELECT data, lease_epoch, owner FROM batches WHERE status IN ({marks}) AND "
                f"(lease_owner IS NULL OR lease_expires < ?) {not_mine}"
                "ORDER BY created_at, id LIMIT ?",
                (*ACTIVE, now, *running, most),
            ).fetchall()
            claimed = []
            for data, epoch, owner in rows:
                batch = json.loads(data) | {"_owner": owner}  # Its lines' tenant.
                db.execute(
                    "UPDATE batches SET lease_owner = ?, lease_expires = ?, lease_epoch = ? "
                    "WHERE id = ?",
                    (owner_id, now + lease_s, epoch + 1, batch["id"]),
                )
                claimed.append((batch, epoch + 1))
        return claimed

    def renew(self, owner_id: str, lease_s: float, batch_ids: list[str]) -> dict[str, str]:
        """Extend this owner's leases; the status of each batch it still holds."""
        if not batch_ids:
            return {}
        marks = ",".join("?" for _ in batch_ids)
        with self.db.transaction() as db:
            db.execute(
                f"UPDATE batches SET lease_expires = ? WHERE lease_owner = ? AND id IN ({marks})",
                (time.time() + lease_s, owner_id, *batch_ids),
            )
            rows = db.execute(
                f"SELECT id, status FROM batches WHERE lease_owner = ? AND id IN ({marks})",
                (owner_id, *batch_ids),
            ).fetchall()
        return {batch_id: status for batch_id, status in rows}

    def release(self, owner_id: str, batch_id: str) -> None:
        """Give a lease back at once (a stopping coordinator), so another takes over now."""
        with self.db.transaction() as db:
            db.execute(
                "UPDATE batches SET lease_owner = NULL, lease_expires = NULL "
                "WHERE id = ? AND lease_owner = ?",
                (batch_id, owner_id),
            )

    def begin(self, owner_id: str, batch_id: str) -> dict[str, Any]:
        with self.db.transaction() as db:
            batch = self._held(db, owner_id, batch_id)
            if batch["status"] == "validating":
                batch = self._write(db, batch, status="in_progress", in_progress_at=_now())
            return batch

    def done_lines(self, batch_id: str) -> set[int]:
        rows = self.db.connection().execute(
            "SELECT line FROM results WHERE batch_id = ?", (batch_id,)
        )
        return {line for (line,) in rows.fetchall()}

    def record(
        self, owner_id: str, batch_id: str, results: list[tuple[int, bool, dict[str, Any]]]
    ) -> dict[str, int]:
        """Add finished lines (input line, ok, output/error record) while the lease is held;
        a line already recorded keeps its first result. Returns the request counts."""
        with self.db.transaction() as db:
            batch = self._held(db, owner_id, batch_id)
            db.executemany(
                "INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                [(batch_id, line, int(ok), json.dumps(rec)) for line, ok, rec in results],
            )
            counts = self._counts(db, batch)
            self._write(db, batch, request_counts=counts)
        return counts

    def fail(self, owner_id: str, batch_id: str, errors: list[dict[str, Any]]) -> dict[str, Any]:
        """End a batch that cannot run at all (file-level problems), errors on the object."""
        with self.db.transaction() as db:
            batch = self._held(db, owner_id, batch_id)
            fields = {"errors": {"object": "list", "data": errors}, "failed_at": _now()}
            batch = self._write(db, batch, status="failed", **fields)
            self._end(db, batch_id)
            return public(batch)

    def finalize(self, owner_id: str, batch_id: str, status: str) -> dict[str, Any]:
        """Mark the batch as being published (``finalizing`` unless it is being cancelled),
        remembering where it ends, so a takeover mid-publish ends it the same way."""
        with self.db.transaction() as db:
            batch = self._held(db, owner_id, batch_id)
            fields: dict[str, Any] = {"_ends_as": status}
            if batch["status"] != "cancelling":
                fields |= {"status": "finalizing", "finalizing_at": _now()}
            return self._write(db, batch, **fields)

    def publish(self, owner_id: str, batch_id: str, epoch: int) -> dict[str, Any]:
        """Write the output and error files (fsynced, with their directory), then in one step
        record them on the batch, end it and drop its recorded lines."""
        batch = self.get(None, batch_id)
        status = batch.get("_ends_as") or "completed"
        owner = self._owner(batch_id)
        written: dict[bool, dict[str, Any]] = {}
        for ok, suffix, name in ((True, "o", "output"), (False, "e", "errors")):
            file_id = f"file-{batch_id.removeprefix('batch-')}-{suffix}{epoch}"
            size = self._write_results(batch_id, ok, self.files.path(file_id))
            if size:
                filename = f"{batch_id}_{name}.jsonl"
                written[ok] = file_object(file_id, filename, "batch_output", size, _now())
        try:
            batch = self._publish(owner_id, batch_id, owner, status, written)
        except LeaseLost:  # Another owner publishes: what this one wrote is nobody's file.
            for obj in written.values():
                self.files.path(obj["id"]).unlink(missing_ok=True)
            raise
        # Files an owner wrote before a crash cut its publish short: never recorded, never read.
        self.files.drop_outputs(batch_id, keep={obj["id"] for obj in written.values()})
        return batch

    def _publish(
        self, owner_id: str, batch_id: str, owner: str, status: str, written: dict[bool, Any]
    ) -> dict[str, Any]:
        with self.db.transaction() as db:
            batch = self._held(db, owner_id, batch_id)
            for obj in written.values():
                FileStore.insert(db, owner, obj)
            counts = self._counts(db, batch)
            fields = {
                "output_file_id": written[True]["id"] if True in written else None,
                "error_file_id": written[False]["id"] if False in written else None,
                "request_counts": counts,
                STAMPS[status]: _now(),
            }
            batch = self._write(db, batch, status=status, **fields)
            self._end(db, batch_id)
        return public(batch)

    # Helpers (inside a transaction) -------------------------------------------------------

    def _write_results(self, batch_id: str, ok: bool, final: Path) -> int:
        rows = self.db.connection().execute(
            "SELECT record FROM results WHERE batch_id = ? AND ok = ? ORDER BY line",
            (batch_id, int(ok)),
        )
        return self.files.write_durably((record for (record,) in rows), final)

    def _owner(self, batch_id: str) -> str:
        query = "SELECT owner FROM batches WHERE id = ?"
        return str(self.db.connection().execute(query, (batch_id,)).fetchone()[0])

    @staticmethod
    def _read(db: Any, batch_id: str, owner: str | None = None) -> dict[str, Any]:
        row = db.execute("SELECT data, owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None or (owner is not None and row[1] != owner):
            raise not_found("batch", batch_id)
        return dict(json.loads(row[0]))

    def _held(self, db: Any, owner_id: str, batch_id: str) -> dict[str, Any]:
        row = db.execute("SELECT lease_owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None or row[0] != owner_id:
            raise LeaseLost(batch_id)
        return self._read(db, batch_id)

    @staticmethod
    def _write(db: Any, batch: dict[str, Any], **fields: Any) -> dict[str, Any]:
        batch = batch | fields
        db.execute(
            "UPDATE batches SET status = ?, data = ? WHERE id = ?",
            (batch["status"], json.dumps(batch), batch["id"]),
        )
        return batch

    @staticmethod
    def _counts(db: Any, batch: dict[str, Any]) -> dict[str, int]:
        rows = db.execute(
            "SELECT ok, COUNT(*) FROM results WHERE batch_id = ? GROUP BY ok", (batch["id"],)
        ).fetchall()
        done = {bool(ok): count for ok, count in rows}
        total = batch["request_counts"]["total"]
        return {"total": total, "completed": done.get(True, 0), "failed": done.get(False, 0)}

    @staticmethod
    def _end(db: Any, batch_id: str) -> None:
        db.execute(
            "UPDATE batches SET lease_owner = NULL, lease_expires = NULL WHERE id = ?",
            (batch_id,),
        )
        db.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))


def _now() -> int:
    return int(time.time())
