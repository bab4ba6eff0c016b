"""Input rows with their line numbers, where one bad line never fails the read.

Ray Data's JSON and CSV readers fail a whole file on one malformed line (a JSONDecodeError deep
inside the read task). JSONL and CSV are read here instead, line by line as the bytes stream
in: a line that is not valid JSON, a CSV record with the wrong number of fields, or bytes that
are not UTF-8 become *bad rows* that carry an error naming the file and line, and the job
reports them like any other bad row. Parquet (binary) and ``.json`` documents are read by
Ray Data.

Every input becomes the same three columns: ``__line`` (1-based, within its file; null for
Parquet and .json), ``__row`` (the row as JSON object text) and ``__error`` (on bad rows).
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import pyarrow as pa
from ray.data.datasource import FileBasedDatasource

ROW_SCHEMA = pa.schema([("__line", pa.int64()), ("__row", pa.string()), ("__error", pa.string())])
ROWS_PER_BLOCK = 1000
READ_BYTES = 1024 * 1024
_INT = re.compile(r"^-?[0-9]+$")
_FLOAT = re.compile(r"^-?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$")


def _lines(stream: Any) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes without the newline) as the file streams in."""
    rest, number = b"", 0
    while chunk := stream.read(READ_BYTES):
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        for part in parts:
            number += 1
            yield number, part.rstrip(b"\r")
    if rest:
        yield number + 1, rest.rstrip(b"\r")


def jsonl_rows(stream: Any, name: str) -> Iterator[tuple[int, str | None, str | None]]:
    """(line, row JSON, error) of every non-blank line."""
    for number, raw in _lines(stream):
        if not raw.strip():
            continue
        where = f"{name} line {number}"
        try:
            text = raw.decode()
            value = json.loads(text)
        except UnicodeDecodeError:
            yield number, None, f"{where}: not UTF-8 text"
            continue
        except ValueError as exc:
            yield number, None, f"{where}: not valid JSON ({exc})"
            continue
        if not isinstance(value, dict):
            yield number, None, f"{where}: not a JSON object"
            continue
        yield number, text, None


def csv_value(text: str) -> Any:
    """A CSV cell as a typed value, as Ray Data's reader would infer it: empty → null."""
    if text == "":
        return None
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def csv_rows(stream: Any, name: str) -> Iterator[tuple[int, str | None, str | None]]:
    """(first line of the record, row JSON, error) of every record after the header."""
    decoded = (raw.decode(errors="surrogateescape") + "\n" for _, raw in _lines(stream))
    reader = csv.reader(decoded)
    header: list[str] | None = None
    while True:
        start = reader.line_num + 1
        try:
            record = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            yield start, None, f"{name} line {start}: not a valid CSV record ({exc})"
            continue
        if not record:
            continue
        if header is None:
            header = record
            continue
        where = f"{name} line {start}"
        if any("\udc80" <= char <= "\udcff" for cell in record for char in cell):
            yield start, None, f"{where}: not UTF-8 text"
        elif len(record) != len(header):
            yield start, None, f"{where}: {len(record)} fields, the header has {len(header)}"
        else:
            row = {key: csv_value(cell) for key, cell in zip(header, record, strict=True)}
            yield start, json.dumps(row), None


class LineRowsDatasource(FileBasedDatasource):
    """JSONL or CSV files as rows of ROW_SCHEMA (see the module docstring)."""

    def __init__(self, paths: str | list[str], kind: Literal["jsonl", "csv"], **kwargs: Any):
        super().__init__(paths, **kwargs)
        self.kind = kind

    def _read_stream(self, f: Any, path: str) -> Iterator[pa.Table]:
        name = path.rsplit("/", 1)[-1]
        rows = jsonl_rows(f, name) if self.kind == "jsonl" else csv_rows(f, name)
        block: list[tuple[int, str | None, str | None]] = []
        for row in rows:
            block.append(row)
            if len(block) >= ROWS_PER_BLOCK:
                yield _table(block)
                block = []
        if block:
            yield _table(block)


def _table(rows: list[tuple[int, str | None, str | None]]) -> pa.Table:
    lines, texts, errors = zip(*rows, strict=True)
    return pa.table([list(lines), list(texts), list(errors)], schema=ROW_SCHEMA)


def as_rows(batch: pa.Table) -> pa.Table:
    """Rows Ray Data read (Parquet, JSON) in ROW_SCHEMA: no line numbers, rows as JSON text."""
    rows = [json.dumps(row, default=str) for row in batch.to_pylist()]
    return pa.table([[None] * len(rows), rows, [None] * len(rows)], schema=ROW_SCHEMA)


def read_input(uri: str) -> Any:
    """A Ray Dataset of ROW_SCHEMA rows: JSONL/JSON, CSV or Parquet by file extension."""
    import ray.data

    lower = uri.lower().rstrip("/")
    if lower.endswith((".jsonl", ".jsonl.gz")):
        return ray.data.read_datasource(LineRowsDatasource(uri, "jsonl"))
    if lower.endswith((".csv", ".csv.gz")):
        return ray.data.read_datasource(LineRowsDatasource(uri, "csv"))
    if lower.endswith((".json", ".json.gz")):  # A JSON document, not lines: Ray Data's reader.
        return ray.data.read_json(uri).map_batches(as_rows, batch_format="pyarrow")
    if lower.endswith(".parquet") or "." not in lower.rsplit("/", 1)[-1]:
        return ray.data.read_parquet(uri).map_batches(as_rows, batch_format="pyarrow")
    raise ValueError(f"{uri}: unknown input format (use .jsonl, .json, .csv or .parquet)")
