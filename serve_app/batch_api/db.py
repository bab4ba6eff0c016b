"""The Batch API's SQLite database and durable file writes (all blocking: call from threads).

One database file on the coordinator's node, in WAL mode: readers never wait for the writer,
and two coordinator processes on that node (an upgrade, a restart) serialize their writes on
SQLite's lock. Each thread gets its own connection. Never put it on a network filesystem shared
by two nodes: SQLite's locking is not safe there.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS files_by_owner ON files (owner, id);
CREATE TABLE IF NOT EXISTS uploads (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL, status TEXT NOT NULL,
    tokens INTEGER NOT NULL, lease_owner TEXT, lease_expires REAL, lease_epoch INTEGER NOT NULL,
    data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, id);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status, created_at);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line));
"""


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


class Database:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / "store.sqlite3"
        self._local = threading.local()
        db = self.connection()
        if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
            # Uploads in progress under an older layout: their clients upload again.
            db.execute("DROP TABLE IF EXISTS uploads")
        db.executescript(SCHEMA)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def connection(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            # Autocommit mode: transactions are explicit (BEGIN IMMEDIATE) in `transaction`.
            db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")  # A recorded result survives a power cut.
            self._local.db = db
        return db

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One atomic step: the write lock is taken up front, so check-then-write is safe
        against another coordinator process."""
        db = self.connection()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_rename(tmp: Path, final: Path) -> None:
    """``tmp`` (written and closed) becomes ``final``, on disk before this returns."""
    with tmp.open("rb+") as handle:
        os.fsync(handle.fileno())
    tmp.replace(final)
    fsync_dir(final.parent)
