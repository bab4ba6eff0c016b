"""Offline job input without Ray: bad lines become error rows with their line number."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from serve_app.offline.__main__ import main
from serve_app.offline.input_files import (
    PROBLEM_COLUMN,
    ROW_COLUMN,
    InputError,
    check_input,
    decode_rows,
    parse_files,
    to_table,
)
from serve_app.offline.input_rows import BadLine, Parsed, is_bad_line, parse_file
from serve_app.offline.rows import JobConfig
from serve_app.offline.runner import drop_done
from serve_app.offline.worker import EngineWorker


def bad(rows: list[Parsed]) -> dict[int | None, str]:
    return {row.number: row.problem for row in rows if isinstance(row, BadLine)}


def good(rows: list[Parsed]) -> list[dict[str, Any]]:
    return [row for row in rows if not isinstance(row, BadLine)]


JSONL = b"\n".join(
    [
        b'{"id": 1, "prompt": "a", "max_tokens": 4}',
        b"{broken",
        b"",
        b"   ",
        b"[1, 2]",
        b"3",
        b'{"id": "x", "prompt": "caf\xe9"}',  # Latin-1, not UTF-8
        b'{"id": 2, "messages": [{"role": "user", "content": "hi"}], "extra": {"k": [1]}}',
    ]
)


def test_jsonl_bad_lines_keep_their_1_based_numbers_and_the_rest_run() -> None:
    rows = parse_file(JSONL + b"\n\n", "json", "in.jsonl")
    assert good(rows) == [
        {"id": 1, "prompt": "a", "max_tokens": 4},
        {"id": 2, "messages": [{"role": "user", "content": "hi"}], "extra": {"k": [1]}},
    ]
    problems = bad(rows)
    assert set(problems) == {2, 5, 6, 7}  # Blank lines 3 and 4 are no rows at all.
    assert problems[2] == (
        "not valid JSON: Expecting property name enclosed in double quotes at column 2"
    )
    assert problems[5] == "not a JSON object but an array"
    assert problems[6] == "not a JSON object but a number"
    assert problems[7] == "not UTF-8 text (byte 0xe9 at column 27)"
    line = next(row for row in rows if isinstance(row, BadLine))
    assert (line.row_id, line.message) == ("line:2", f"input line 2 of in.jsonl: {problems[2]}")
    assert is_bad_line(line.message) and not is_bad_line("missing column 'prompt'")
    assert not is_bad_line(None)


def test_crlf_bom_and_gzip_inputs() -> None:
    text = b'\xef\xbb\xbf{"id": 1}\r\n{oops\r\n{"id": 2}\r\n'
    for data in (text, gzip.compress(text)):
        rows = parse_file(data, "json", "in.jsonl.gz")
        assert good(rows) == [{"id": 1}, {"id": 2}] and set(bad(rows)) == {2}
    broken = parse_file(gzip.compress(text)[:20], "json", "in.jsonl.gz")
    assert len(broken) == 1 and "not a readable gzip file" in broken[0].problem  # type: ignore[union-attr]
    assert broken[0].row_id == "file:in.jsonl.gz"  # type: ignore[union-attr]


def test_json_array_file_like_read_json() -> None:
    rows = parse_file(b'[{"id": 1}, "text", {"id": 2}]', "json", "in.json")
    assert good(rows) == [{"id": 1}, {"id": 2}]
    item = rows[1]
    assert isinstance(item, BadLine) and item.row_id == "item:2"
    assert item.message == "input item 2 of in.json: not a JSON object but a string"
    # A broken array cannot be read in part: one bad row at the line the parser stopped.
    broken = parse_file(b'[\n{"id": 1},\n{"id" 2}\n]', "json", "in.json")
    assert bad(broken).keys() == {3} and "none of its rows ran" in bad(broken)[3]
    latin = bad(parse_file(b'[{"id": 1},\n"\xff"]', "json", "in.json"))
    assert latin[2].startswith("not UTF-8 text (byte 0xff at column 2); the file is one JSON")
    # In a .jsonl file a line that is an array is one bad line, not a file of rows.
    assert bad(parse_file(b'[1, 2]\n{"id": 1}\n', "json", "in.jsonl")).keys() == {1}


CSV = (
    b"id,prompt,max_tokens\n"
    b'1,"Hello, world",4\n'
    b"2,short\n"
    b"3,too,many,fields\n"
    b'4,"two\nlines, with ""quotes""",\n'
    b"\n"
    b"5,caf\xe9,4\n"
    b"6,last,8\n"
)


def test_csv_bad_records_and_line_numbers_after_quoted_newlines() -> None:
    rows = parse_file(CSV, "csv", "in.csv")
    assert good(rows) == [
        {"id": "1", "prompt": "Hello, world", "max_tokens": "4"},
        {"id": "4", "prompt": 'two\nlines, with "quotes"', "max_tokens": None},  # empty: missing
        {"id": "6", "prompt": "last", "max_tokens": "8"},
    ]
    assert bad(rows) == {
        3: "2 fields where the header has 3",
        4: "4 fields where the header has 3",
        8: "not UTF-8 text (byte 0xe9 at column 6)",  # Line 8: record 4 spans lines 5 and 6.
    }


def test_csv_unclosed_quote_duplicate_header_and_gzip() -> None:
    rows = parse_file(b'id,prompt\n1,"open\n2,b\n3,c\n', "csv", "in.csv")
    assert bad(rows) == {
        2: "not valid CSV: unexpected end of data (the record runs to line 4: an unclosed quote?)"
    }
    assert not good(rows)
    after = parse_file(b'id,prompt\n1,"a"b\n2,b\n', "csv", "in.csv")
    assert list(bad(after)) == [2] and good(after) == [{"id": "2", "prompt": "b"}]
    twice = parse_file(b"id,id\n1,2\n", "csv", "in.csv")
    assert list(bad(twice)) == [1] and "'id' twice" in bad(twice)[1] and not good(twice)
    # A non-UTF-8 line inside a quoted field fails its record once (not a shortened field).
    inside = parse_file(b'id,prompt\n1,"a\nb\xff\nc"\n2,x\n', "csv", "in.csv")
    assert bad(inside) == {2: "line 3 inside this record is not UTF-8 text"}
    assert good(inside) == [{"id": "2", "prompt": "x"}]
    zipped = parse_file(gzip.compress(b"id,prompt\n1,a\n1,b,c\n"), "csv", "in.csv.gz")
    assert good(zipped) == [{"id": "1", "prompt": "a"}] and list(bad(zipped)) == [3]
    assert parse_file(b"", "csv", "in.csv") == [] and parse_file(b"", "json", "in.jsonl") == []


def test_table_between_read_and_worker_keeps_json_types_and_heterogeneous_keys() -> None:
    batch = pa.table(
        {"bytes": [JSONL, b"id,prompt\n7,x\n"], "path": ["/data/in/a.jsonl", "/data/in/b/c.jsonl"]}
    )
    table = parse_files(batch, "json", "id", roots=("/data/in",))
    assert table.schema.field("id").type == pa.string()
    assert table.column("id").to_pylist() == [
        "1", "a.jsonl:line:2", "a.jsonl:line:5", "a.jsonl:line:6", "a.jsonl:line:7", "2",
        "b/c.jsonl:line:1", "b/c.jsonl:line:2",
    ]  # fmt: skip
    rows = decode_rows(table, "id")
    assert rows[0] == {"id": 1, "prompt": "a", "max_tokens": 4}  # ints stay ints, keys as given
    assert rows[5]["extra"] == {"k": [1]} and "prompt" not in rows[5]
    assert rows[1] == {"id": "a.jsonl:line:2", PROBLEM_COLUMN: rows[1][PROBLEM_COLUMN]}
    assert rows[1][PROBLEM_COLUMN].startswith("input line 2 of a.jsonl: not valid JSON")
    # A single file: ids are plain line numbers; resume drops a bad line already written.
    single = to_table(parse_file(JSONL, "json", "in.jsonl"), "id")
    kept = drop_done(single, "id", ["line:2", "1"])
    assert "line:2" not in kept.column("id").to_pylist() and kept.num_rows == single.num_rows - 2
    # Parquet batches pass through as their own columns.
    assert decode_rows(pa.table({"id": [1], "prompt": ["a"]}), "id") == [{"id": 1, "prompt": "a"}]
    assert ROW_COLUMN in table.column_names


class _NoPreprocessing:
    def preprocess_batch(self, requests: list[Any]) -> list[Any]:
        assert requests == []
        return []


def test_worker_writes_bad_lines_as_failed_rows() -> None:
    worker = EngineWorker.__new__(EngineWorker)  # No engine: no row here reaches one.
    worker.job = JobConfig(input="in.jsonl", output="out")
    worker.preprocessor = _NoPreprocessing()  # type: ignore[assignment]
    table = to_table(parse_file(b"{broken\n[1]\n", "json", "in.jsonl"), "id")
    out = asyncio.run(worker.process(decode_rows(table, "id")))
    assert [(row["id"], row["output"], row["completion_tokens"]) for row in out] == [
        ("line:1", None, 0),
        ("line:2", None, 0),
    ]
    assert out[1]["error"] == "input line 2 of in.jsonl: not a JSON object but an array"


def test_check_input_formats_and_file_level_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a.jsonl").write_text('{"id": 1}\n')
    assert check_input(str(tmp_path / "a.jsonl")).format == "json"
    assert check_input(str(tmp_path / "a.jsonl")).roots is None
    with pytest.raises(InputError, match="no such file"):
        check_input(str(tmp_path / "missing.jsonl"))
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(InputError, match="unknown input format"):
        check_input(str(tmp_path / "a.txt"))
    # A directory named without an extension: the format of the files in it.
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "part-1.csv.gz").write_bytes(gzip.compress(b"id\n1\n"))
    (tmp_path / "rows" / "_SUCCESS").write_text("")
    spec = check_input(str(tmp_path / "rows") + "/")
    assert (spec.format, spec.roots) == ("csv", (str(tmp_path / "rows"),))
    assert spec.extensions() == ["csv", "csv.gz"]
    # A relative path stays relative in Ray's listing: bad-line ids still name sub/part-1.
    monkeypatch.chdir(tmp_path)
    relative = check_input("rows").roots
    assert relative is not None and "rows" in relative
    batch = pa.table({"bytes": [b"id\n1,2\n"], "path": ["rows/sub/part-1.csv"]})
    assert parse_files(batch, "csv", "id", relative).column("id").to_pylist() == [
        "sub/part-1.csv:line:2"
    ]
    (tmp_path / "rows" / "part-2.jsonl").write_text("{}\n")
    with pytest.raises(InputError, match="mixes csv and json"):
        check_input(str(tmp_path / "rows"))
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"id": [1]}), tmp_path / "pq" / "part-0.parquet")
    assert check_input(str(tmp_path / "pq")).format == "parquet"


def test_cli_names_a_missing_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.jsonl"
    assert main(["run", "--input", str(missing), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {missing}: no such file or directory\n"
    assert not (tmp_path / "out").exists()  # Nothing started, nothing written.


def test_jsonl_rows_reach_the_table_as_written() -> None:
    rows = [{"id": f"r{i}", "prompt": "p", "temperature": 0.5 * i} for i in range(3)]
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    assert decode_rows(to_table(parse_file(data, "json", "x.jsonl"), "id"), "id") == rows
