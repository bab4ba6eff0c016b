"""Input text of offline jobs, parsed line by line: one bad line is one bad row, not a dead job.

Ray Data's JSON and CSV readers fail the whole job on the first malformed line (a
``JSONDecodeError`` deep inside ``ReadArrowJSON``). Here every line stands alone: a malformed
or non-object JSON line, a CSV record with the wrong number of fields, or text that is not
UTF-8 becomes a :class:`BadLine` with its 1-based line number, and the other rows go on.

Formats: JSON Lines (``.jsonl``, ``.json``), a ``.json`` file holding one JSON array of
objects (what Ray's ``read_json`` also accepted), and CSV with a header row (empty cells are
missing values; values stay text, which the request validation converts like JSON's). Gzip
text is decompressed here when the reader has not done so already.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

TextFormat = Literal["json", "csv"]
# The prefix of every bad line's error message: how the job tells them from other failed rows.
PREFIX = "input "


@dataclass(frozen=True)
class BadLine:
    """A line (or array item) that cannot become a row, and why."""

    number: int | None  # 1-based; None: the whole file
    problem: str
    file: str  # The file's name, relative to the input directory.
    several: bool = False  # The input has several files: the id names this one.
    unit: Literal["line", "item"] = "line"  # "item": the n-th element of a JSON array

    @property
    def row_id(self) -> str:
        """Stable across runs (resume skips it like any finished row); unique in the input."""
        if self.number is None:
            return f"file:{self.file}"
        prefix = f"{self.file}:" if self.several else ""
        return f"{prefix}{self.unit}:{self.number}"

    @property
    def message(self) -> str:
        place = self.file if self.number is None else f"{self.unit} {self.number} of {self.file}"
        return f"{PREFIX}{place}: {self.problem}"


Parsed = dict[str, Any] | BadLine
Bad = Callable[..., BadLine]  # (number, problem[, unit]) -> a BadLine of the file at hand


def is_bad_line(error: str | None) -> bool:
    """Whether an output row's error is a bad input line (not a row the engine refused)."""
    return error is not None and error.startswith(PREFIX)


def parse_file(data: bytes, fmt: TextFormat, file: str, several: bool = False) -> list[Parsed]:
    """Every row of one file in order: dicts for good rows, BadLine for the rest."""

    def bad(number: int | None, problem: str, unit: Literal["line", "item"] = "line") -> BadLine:
        return BadLine(number, problem, file, several, unit)

    if data[:2] == b"\x1f\x8b":  # gzip magic: not decompressed on the way in.
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            return [bad(None, f"not a readable gzip file ({exc}); none of its rows ran")]
    data = data.removeprefix(codecs.BOM_UTF8)
    if fmt == "csv":
        return list(_csv_rows(data, bad))
    if data.lstrip()[:1] == b"[" and not file.lower().endswith((".jsonl", ".jsonl.gz")):
        return _json_array(data, bad)
    return list(_json_lines(data, bad))


def _lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(1-based number, line without its ending); lines end at \\n as in JSONL (and ``wc -l``)."""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    for number, line in enumerate(lines, start=1):
        yield number, line.removesuffix(b"\r")


def _not_utf8(exc: UnicodeDecodeError) -> str:
    return f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at column {exc.start + 1})"


def _json_lines(data: bytes, bad: Bad) -> Iterator[Parsed]:
    for number, raw in _lines(data):
        if not raw.strip():
            continue  # Blank lines (a trailing one, say) are not rows.
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield bad(number, _not_utf8(exc))
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            # exc's own "line 1 column 2" counts within the line: say the column only.
            yield bad(number, f"not valid JSON: {exc.msg} at column {exc.colno}")
            continue
        if isinstance(value, dict):
            yield value
        else:
            yield bad(number, f"not a JSON object but {_kind(value)}")


def _json_array(data: bytes, bad: Bad) -> list[Parsed]:
    """A ``.json`` file that is one array: each object a row; a broken array is one bad line."""
    try:
        value = json.loads(data)
    except json.JSONDecodeError as exc:
        ran = "the file is one JSON array, so none of its rows ran"
        return [bad(exc.lineno, f"not valid JSON: {exc.msg} at column {exc.colno}; {ran}")]
    except UnicodeDecodeError as exc:
        line, column = (
            data.count(b"\n", 0, exc.start) + 1,
            exc.start - data.rfind(b"\n", 0, exc.start),
        )
        problem = f"not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column})"
        return [bad(line, f"{problem}; the file is one JSON array, so none of its rows ran")]
    return [
        item if isinstance(item, dict) else bad(n, f"not a JSON object but {_kind(item)}", "item")
        for n, item in enumerate(value, start=1)
    ]


def _kind(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


def _csv_rows(data: bytes, bad: Bad) -> Iterator[Parsed]:
    """Records of a CSV file with a header; a record spanning lines is numbered by its first."""
    # Python's default limit (128 KiB per field) would make a long document a bad row.
    csv.field_size_limit(max(csv.field_size_limit(), 1 << 30))
    numbers: list[int] = []  # The line number of each line handed to the reader, in order.
    undecodable: list[BadLine] = []

    def text() -> Iterator[str]:
        for number, raw in _lines(data):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                undecodable.append(bad(number, _not_utf8(exc)))
                continue
            numbers.append(number)
            yield line + "\n"

    reader = csv.reader(text(), strict=True)  # strict: an unclosed quote is an error, not a field
    header: list[str] | None = None
    while True:
        start = len(numbers)
        try:
            record = next(reader)
            problem = None
        except StopIteration:
            break
        except csv.Error as exc:
            record, problem = [], f"not valid CSV: {exc}"
        # A csv.Error may come before the reader took a line (never seen; be safe).
        first = numbers[start] if start < len(numbers) else (numbers[-1] if numbers else 1)
        last = numbers[-1] if numbers else first
        # A skipped non-UTF-8 line inside a quoted field would silently shorten the field.
        inside = [u for u in undecodable if u.number is not None and first < u.number < last]
        yield from (u for u in undecodable if u not in inside)
        undecodable.clear()
        if problem is None and inside:  # One bad row for the record, not one more per line.
            yield bad(first, f"line {inside[0].number} inside this record is not UTF-8 text")
            continue
        if problem is None and not any(field.strip() for field in record) and len(record) <= 1:
            continue  # A blank line.
        if problem is None and header is None:
            header = record
            if len(set(header)) < len(header):
                twice = next(name for name in header if header.count(name) > 1)
                yield bad(
                    first, f"the header names column {twice!r} twice; no row of this file ran"
                )
                return
            continue
        if problem is None and header is not None and len(record) != len(header):
            problem = f"{len(record)} fields where the header has {len(header)}"
        if problem is not None:
            if last > first:
                problem += f" (the record runs to line {last}: an unclosed quote?)"
            yield bad(first, problem)
        elif header is not None:
            values = zip(header, record, strict=True)
            yield {name: value if value != "" else None for name, value in values}
    yield from undecodable
