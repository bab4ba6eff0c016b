"""One owner per batch: a lease in the store, shared by every process that opens it.

A coordinator process runs a batch only while it holds the batch's lease, which it renews every
second; each renewal also brings back the batch's status, so a cancel made through any router
reaches the one running it. A lease nobody renews (its process died, hung, or was drained
away) expires, and the first process to see that (the coordinator's replacement, or a new one
during an upgrade) takes the batch over and resumes it from its partial files. A process that
finds its lease taken stops the batch; its record writes are fenced
(``BatchStore.update_batch(holder=...)``), so they land only under the lease. Claims and
renewals are single SQLite statements: two processes never both win one.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterable

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
_IN_ACTIVE = f"status IN ({','.join('?' for _ in ACTIVE)})"


class LeaseLost(Exception):
    """This replica no longer holds the batch's lease: another one runs it now."""


class BatchLeases:
    """The ``holder`` and ``lease_until`` columns of the store's batches."""

    def __init__(
        self,
        db: sqlite3.Connection,
        lock: threading.Lock,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db, self._lock, self._clock = db, lock, clock
        with self._lock, self._db:
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(batches)")}
            if "holder" not in columns:  # Stores from before leases: every batch unheld.
                self._db.execute("ALTER TABLE batches ADD COLUMN holder TEXT NOT NULL DEFAULT ''")
                self._db.execute(
                    "ALTER TABLE batches ADD COLUMN lease_until REAL NOT NULL DEFAULT 0"
                )

    def until(self, lease_s: float) -> float:
        return self._clock() + lease_s

    def claim(self, batch_id: str, holder: str, lease_s: float) -> bool:
        """Take (or keep) an active batch whose lease is ``holder``'s or has expired."""
        now = self._clock()
        with self._lock, self._db:
            taken = self._db.execute(
                "UPDATE batches SET holder = ?, lease_until = ? "
                f"WHERE id = ? AND {_IN_ACTIVE} AND (holder = ? OR lease_until < ?)",
                (holder, now + lease_s, batch_id, *ACTIVE, holder, now),
            ).rowcount
        return bool(taken)

    def renew(self, batch_ids: Iterable[str], holder: str, lease_s: float) -> dict[str, str]:
        """Extend ``holder``'s leases; the status of each batch it still holds (a batch
        missing from the answer was taken over, or deleted)."""
        held: dict[str, str] = {}
        until = self.until(lease_s)
        with self._lock, self._db:
            for batch_id in batch_ids:
                row = self._db.execute(
                    "UPDATE batches SET lease_until = ? WHERE id = ? AND holder = ? "
                    "RETURNING status",
                    (until, batch_id, holder),
                ).fetchone()
                if row is not None:
                    held[batch_id] = str(row[0])
        return held

    def orphans(self, limit: int = 100) -> list[str]:
        """Active batches whose lease expired (or that never had one), oldest first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM batches WHERE {_IN_ACTIVE} AND lease_until < ? "
                "ORDER BY created_at LIMIT ?",
                (*ACTIVE, self._clock(), limit),
            ).fetchall()
        return [str(row[0]) for row in rows]

    def release(self, batch_id: str, holder: str) -> None:
        """Let another replica take the batch at once (this one is stopping)."""
        with self._lock, self._db:
            self._db.execute(
                "UPDATE batches SET lease_until = 0 WHERE id = ? AND holder = ?",
                (batch_id, holder),
            )

    def holder(self, batch_id: str) -> str:
        """Which replica holds (or last held) the batch's lease; "" for none yet."""
        with self._lock:
            row = self._db.execute(
                "SELECT holder FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()
        return "" if row is None else str(row[0])

    def check(self, batch_id: str, holder: str) -> None:
        """Inside the caller's transaction (lock held): raise unless ``holder`` holds it."""
        row = self._db.execute("SELECT holder FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None or row[0] != holder:
            raise LeaseLost(batch_id)
