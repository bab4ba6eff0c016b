"""The output directory: part files written atomically (tmp, then rename), read back to resume.

A part file is complete or absent: rows land in ``.part-<n>.<ext>.tmp`` and the rename makes
them visible. A crash loses at most the rows in flight; a re-run reads the ids already present
and skips them, so no row is lost or written twice.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable
from typing import Any, Literal

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from serve_app.offline.rows import OUTPUT_COLUMNS

OUTPUT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("output", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("finish_reason", pa.string()),
        ("error", pa.string()),
    ]
)
_PART = re.compile(r"^part-(\d+)\.(jsonl|parquet)$")


def open_dir(uri: str) -> tuple[pafs.FileSystem, str]:
    """A local path or a pyarrow filesystem URI (file://, s3://, gs://, …) → (fs, path)."""
    if "://" in uri:
        fs, path = pafs.FileSystem.from_uri(uri)
        return fs, path
    import os

    return pafs.LocalFileSystem(), os.path.abspath(uri)


def _parts(fs: pafs.FileSystem, root: str) -> list[tuple[int, str]]:
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        return []
    found = []
    for entry in fs.get_file_info(pafs.FileSelector(root, recursive=False)):
        match = _PART.match(entry.base_name)
        if match and entry.type == pafs.FileType.File:
            found.append((int(match.group(1)), entry.path))
    return sorted(found)


def read_rows(uri: str) -> list[dict[str, Any]]:
    """Every row of every complete part file (tmp files of a crashed run are ignored)."""
    fs, root = open_dir(uri)
    rows: list[dict[str, Any]] = []
    for _, path in _parts(fs, root):
        if path.endswith(".parquet"):
            with fs.open_input_file(path) as handle:
                rows.extend(pq.read_table(handle).to_pylist())
        else:
            with fs.open_input_stream(path) as handle:
                text = handle.read().decode()
            # JSONL lines end at \n; splitlines would also split at a U+2028 in a text.
            rows.extend(json.loads(line) for line in text.split("\n") if line.strip())
    return rows


class PartWriter:
    """Appends finished rows as new part files; knows every id already written."""

    def __init__(self, uri: str, fmt: Literal["jsonl", "parquet"] = "jsonl") -> None:
        self.fs, self.root = open_dir(uri)
        self.format = fmt
        self.fs.create_dir(self.root, recursive=True)
        parts = _parts(self.fs, self.root)
        self.next_index = parts[-1][0] + 1 if parts else 0
        self.done_ids: set[str] = {
            str(row["id"]) for row in read_rows(uri) if row.get("id") is not None
        }
        self.resumed = len(self.done_ids)
        self._cleanup_tmp()

    def _cleanup_tmp(self) -> None:
        for entry in self.fs.get_file_info(pafs.FileSelector(self.root, recursive=False)):
            if entry.base_name.startswith(".part-") and entry.base_name.endswith(".tmp"):
                self.fs.delete_file(entry.path)

    def write(self, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """Write the rows whose id is new as one part file; return what was written."""
        fresh = []
        for row in rows:
            rid = row.get("id")
            if rid is not None and rid in self.done_ids:
                continue
            if rid is not None:
                self.done_ids.add(rid)
            fresh.append({column: row.get(column) for column in OUTPUT_COLUMNS})
        if not fresh:
            return fresh
        name = f"part-{self.next_index:05d}.{self.format}"
        self.next_index += 1
        tmp, final = f"{self.root}/.{name}.tmp", f"{self.root}/{name}"
        with self.fs.open_output_stream(tmp) as handle:
            handle.write(_encode(fresh, self.format))
        self.fs.move(tmp, final)
        return fresh


def _encode(rows: list[dict[str, Any]], fmt: str) -> bytes:
    if fmt == "jsonl":
        return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA), buffer)
    return buffer.getvalue()
