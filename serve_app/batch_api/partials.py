"""Progress of a running batch: its result lines, appended to ``<batch_id>.output.partial`` and
``<batch_id>.error.partial`` as they come, so a restarted (or another) coordinator resumes the
batch without redoing or duplicating finished lines; published as the batch's files at the end.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, BinaryIO

from serve_app.batch_api.ids import new_id
from serve_app.batch_api.window import expired_line


class PartialFiles:
    """Part of ``BatchStore``: the partial files next to its database."""

    root: Path
    _lock: threading.Lock

    def create_file_from(
        self,
        source: BinaryIO,
        filename: str,
        purpose: str,
        owner: str = "",
        *,
        file_id: str | None = None,
    ) -> dict[str, Any]:
        raise NotImplementedError

    def batch_owner(self, batch_id: str) -> str:
        raise NotImplementedError

    def active_batches(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def partial_path(self, batch_id: str, kind: str) -> Path:
        return self.root / f"{batch_id}.{kind}.partial"

    def read_partial(self, batch_id: str, kind: str) -> list[dict[str, Any]]:
        """Complete lines only; a torn last line from a crash is dropped (and rewritten)."""
        with self._lock:  # Not while a line is being appended.
            return self._read_partial(batch_id, kind)

    def _read_partial(self, batch_id: str, kind: str) -> list[dict[str, Any]]:
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

    def rewrite_partial(self, batch_id: str, kind: str, lines: list[dict[str, Any]]) -> None:
        with self._lock:
            tmp = self.partial_path(batch_id, kind).with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
            tmp.replace(self.partial_path(batch_id, kind))

    def append_partial(self, batch_id: str, kind: str, line: dict[str, Any]) -> None:
        with self._lock, self.partial_path(batch_id, kind).open("a") as handle:
            handle.write(json.dumps(line) + "\n")

    def publish_partial(self, batch_id: str, kind: str, purpose: str) -> str | None:
        """Store a partial file's lines as the batch's ``kind`` file (durable before it is
        recorded) and return its id; None when it has no lines. The partial stays until
        ``drop_partials``: a crash before the batch records the file resumes from it, and
        publishing again replaces the file under the same id (no orphan copies)."""
        path = self.partial_path(batch_id, kind)
        if not path.exists() or path.stat().st_size == 0:
            return None
        file_id = f"file-{batch_id.removeprefix('batch-')}-{kind}"
        name, owner = f"{batch_id}_{kind}.jsonl", self.batch_owner(batch_id)
        with path.open("rb") as source:  # The batch's owner may download it; no other key may.
            self.create_file_from(source, name, purpose, owner, file_id=file_id)
        return file_id

    def drop_partials(self, batch_id: str) -> None:
        """Once the batch has recorded its files."""
        for kind in ("output", "error"):
            self.partial_path(batch_id, kind).unlink(missing_ok=True)

    def sweep_partials(self) -> None:
        """Drop partials left by a crash after their batch recorded its files."""
        active = {batch["id"] for batch in self.active_batches()}
        for path in self.root.glob("*.partial"):
            batch_id = path.name.split(".", 1)[0]
            if batch_id not in active:
                path.unlink(missing_ok=True)

    def record_rejected(self, batch_id: str, rejected: list[dict[str, Any]]) -> None:
        """Input lines that cannot run go to the error file once (also across a resume)."""
        written = {
            record["error"].get("line")
            for record in self.read_partial(batch_id, "error")
            if record.get("response") is None and record.get("error")
        }
        for problem in rejected:
            if problem["line"] in written:
                continue
            message = f"Line {problem['line']} of the input file: {problem['message']}."
            error = {"code": problem["code"], "message": message, "line": problem["line"]}
            record = {"id": new_id("batch_req"), "custom_id": problem["custom_id"]}
            self.append_partial(batch_id, "error", record | {"response": None, "error": error})

    def expire_unsettled(self, batch_id: str, lines: list[dict[str, Any]], window: str) -> None:
        """Every line that has not run becomes a ``batch_expired`` error line (once)."""
        settled = self.settled(batch_id)
        for line in lines:
            if line["custom_id"] not in settled:
                record = expired_line(new_id("batch_req"), line["custom_id"], window)
                self.append_partial(batch_id, "error", record)

    def settled(self, batch_id: str) -> set[str]:
        """custom_ids of lines that ran, or expired (a rejected line's custom_id may duplicate
        one that runs: it has no response)."""
        return {
            record["custom_id"]
            for kind in ("output", "error")
            for record in self.read_partial(batch_id, kind)
            if record.get("response") is not None
            or (record.get("error") or {}).get("code") == "batch_expired"
        }

    def counts(self, batch_id: str, total: int) -> dict[str, int]:
        ok = len(self.read_partial(batch_id, "output"))
        failed = len(self.read_partial(batch_id, "error"))
        return {"total": total, "completed": ok, "failed": failed}

    def dedupe(self, batch_id: str) -> None:
        """One result per line: a replica that stopped after losing its lease (hung past it,
        then woke) may have appended a line its successor ran as well."""
        seen: set[tuple[Any, Any]] = set()
        for kind in ("output", "error"):
            records = self.read_partial(batch_id, kind)
            unique = []
            for record in records:
                key = (record.get("custom_id"), (record.get("error") or {}).get("line"))
                if key not in seen:
                    seen.add(key)
                    unique.append(record)
            if len(unique) < len(records):
                self.rewrite_partial(batch_id, kind, unique)
