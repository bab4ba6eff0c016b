"""The input of an offline job: which files, in which format, and the rows they hold.

Parquet is read by Ray Data as is. JSON and CSV files are read as bytes and parsed by
:mod:`serve_app.offline.input_rows`, so a bad line becomes a row of its own instead of failing
the job. Between the read and the engine worker, a parsed row travels as its JSON text in one
string column (plus its id, for resume): Arrow never has to agree on one type per column across
lines and files, and the worker sees exactly the values the file holds.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.fs as pafs

from serve_app.offline.input_rows import BadLine, Parsed, TextFormat, parse_file
from serve_app.offline.rows import row_id

Format = Literal["json", "csv", "parquet"]
ROW_COLUMN = "__input_row__"  # A good row's JSON text.
PROBLEM_COLUMN = "__input_error__"  # A bad line's error message; the key the worker checks.
SUFFIXES: dict[str, Format] = {
    ".jsonl": "json",
    ".json": "json",
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".csv": "csv",
    ".csv.gz": "csv",
    ".parquet": "parquet",
}


class InputError(ValueError):
    """The input as a whole cannot be read (missing, unknown format): one line, not a trace."""


@dataclass(frozen=True)
class InputSpec:
    uri: str
    format: Format
    # Set for a directory: bad-line ids name their file relative to it. Its spellings as Ray may
    # list its files (pyarrow keeps a relative local path relative), absolute one first.
    roots: tuple[str, ...] | None = None

    def extensions(self) -> list[str]:
        """What Ray Data lists in a directory (its own listing skips names with _ or .)."""
        return [s[1:] for s, fmt in SUFFIXES.items() if fmt == self.format]


def format_of(name: str) -> Format | None:
    lower = name.lower().rstrip("/")
    return next((fmt for suffix, fmt in SUFFIXES.items() if lower.endswith(suffix)), None)


def check_input(uri: str) -> InputSpec:
    """Format and shape of the input, checked before Ray starts (raises InputError)."""
    known = format_of(uri)
    named = "." in uri.rstrip("/").rsplit("/", 1)[-1]
    try:
        fs, path = _filesystem(uri)
        info = fs.get_file_info(path)
    except (OSError, ValueError) as exc:
        if "://" not in uri:  # A local path that cannot be looked at (permissions, say).
            raise InputError(f"{uri}: {exc}") from None
        # A scheme pyarrow cannot open (http via fsspec, say): Ray Data may; decide by name.
        if known is None and named:
            raise InputError(_unknown(uri)) from None
        return InputSpec(uri, known or "parquet")
    if info.type == pafs.FileType.NotFound:
        raise InputError(f"{uri}: no such file or directory")
    if info.type != pafs.FileType.Directory:
        if known is None and named:
            raise InputError(_unknown(uri))
        return InputSpec(uri, known or "parquet")  # No extension at all: Parquet, as before.
    given = uri.removeprefix("local://").rstrip("/")
    roots = tuple(dict.fromkeys([path.rstrip("/"), given, posixpath.normpath(given)]))
    return InputSpec(uri, known or _format_of_dir(fs, path, uri), roots=roots)


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    from serve_app.offline.output import open_dir

    return open_dir(uri.removeprefix("local://"))


def _unknown(uri: str) -> str:
    return f"{uri}: unknown input format (use .jsonl, .json, .csv or .parquet, or those with .gz)"


def _format_of_dir(fs: pafs.FileSystem, path: str, uri: str) -> Format:
    """A directory named without an extension: the format of the files in it (Parquet if none)."""
    found = set()
    for entry in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
        hidden = any(part.startswith(("_", ".")) for part in entry.path[len(path) :].split("/"))
        fmt = format_of(entry.base_name)
        if entry.type == pafs.FileType.File and fmt is not None and not hidden:
            found.add(fmt)
    if len(found) > 1:
        raise InputError(f"{uri}: mixes {' and '.join(sorted(found))} files; use one format")
    return found.pop() if found else "parquet"


def to_table(rows: list[Parsed], id_column: str) -> pa.Table:
    """The parsed rows as the job's read stage hands them on: id, JSON text, error message."""
    ids: list[str | None] = []
    texts: list[str | None] = []
    problems: list[str | None] = []
    for row in rows:
        if isinstance(row, BadLine):
            ids.append(row.row_id)
            texts.append(None)
            problems.append(row.message)
        else:
            ids.append(row_id(row, id_column))
            texts.append(json.dumps(row, ensure_ascii=False))
            problems.append(None)
    return pa.table(
        {
            id_column: pa.array(ids, pa.string()),
            ROW_COLUMN: pa.array(texts, pa.string()),
            PROBLEM_COLUMN: pa.array(problems, pa.string()),
        }
    )


def parse_files(
    batch: pa.Table, fmt: TextFormat, id_column: str, roots: tuple[str, ...] | None = None
) -> pa.Table:
    """Ray Data UDF over ``read_binary_files(..., include_paths=True)``: files → parsed rows."""
    rows: list[Parsed] = []
    files = zip(batch.column("bytes").to_pylist(), batch.column("path").to_pylist(), strict=True)
    for data, path in files:
        rows += parse_file(data, fmt, _relative(path, roots), several=roots is not None)
    return to_table(rows, id_column)


def _relative(path: str, roots: tuple[str, ...] | None) -> str:
    for root in roots or ():
        if path.startswith(root + "/"):
            return path[len(root) + 1 :]
    return posixpath.basename(path)


def decode_rows(batch: pa.Table, id_column: str) -> list[dict[str, Any]]:
    """Rows as the worker reads them; a bad line is ``{id_column: its id, PROBLEM_COLUMN: …}``."""
    if ROW_COLUMN not in batch.column_names:
        return list(batch.to_pylist())  # Parquet: the file's own columns.
    ids = batch.column(id_column).to_pylist()
    texts = batch.column(ROW_COLUMN).to_pylist()
    problems = batch.column(PROBLEM_COLUMN).to_pylist()
    return [
        json.loads(text) if text is not None else {id_column: rid, PROBLEM_COLUMN: problem}
        for rid, text, problem in zip(ids, texts, problems, strict=True)
    ]


def read_input(spec: InputSpec, id_column: str) -> Any:
    """A Ray Dataset of the input rows (see the module docstring)."""
    import ray.data

    files: Any  # A Dataset; Ray's stubs do not take keyword-configured UDFs.
    try:
        if spec.format == "parquet":
            return ray.data.read_parquet(spec.uri)
        files = ray.data.read_binary_files(
            spec.uri, include_paths=True, file_extensions=spec.extensions()
        )
    except (OSError, ValueError) as exc:  # Listing the files: no file there, none readable.
        raise InputError(f"{spec.uri}: {exc}") from exc
    return files.map_batches(
        parse_files,
        batch_size=1,  # One file per call: a file's rows are one block, as with read_json.
        batch_format="pyarrow",
        fn_kwargs={"fmt": spec.format, "id_column": id_column, "roots": spec.roots},
    )
