"""Offline batch jobs without Ray or an engine: templates, rows → requests, ids and resume."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pytest

from serve_app.hops import AdapterRef
from serve_app.offline.output import PartWriter, read_rows
from serve_app.offline.rows import (
    JobConfig,
    RowError,
    build_request,
    fill_template,
    load_json_schema,
    row_adapter,
    row_messages,
    row_params,
    template_fields,
)
from serve_app.offline.runner import drop_done


def job(**kwargs: object) -> JobConfig:
    return JobConfig(input="in.jsonl", output="out", **kwargs)  # type: ignore[arg-type]


def test_template_fills_named_columns() -> None:
    template = "Summarize clause {n}: {text}"
    assert template_fields(template) == ["n", "text"]
    assert fill_template(template, {"n": 3, "text": "Pay on time."}) == (
        "Summarize clause 3: Pay on time."
    )


def test_template_missing_column_is_a_row_error() -> None:
    with pytest.raises(RowError, match="missing column 'text'"):
        fill_template("{n}: {text}", {"n": 1, "text": None})


@pytest.mark.parametrize("template", ["{row.__class__}", "{a[0]}", "{}", "{0}", "{oops"])
def test_template_rejects_attribute_index_and_bad_fields(template: str) -> None:
    with pytest.raises(ValueError, match="template"):
        template_fields(template)


def test_only_one_prompt_source() -> None:
    with pytest.raises(ValueError, match="only one"):
        job(prompt_column="p", template="{x}")
    assert job().prompt_column == "prompt"


def test_messages_with_system_and_json_string_messages() -> None:
    j = job(messages_column="chat", system="Be brief.")
    chat = json.dumps([{"role": "user", "content": "hi"}])
    assert row_messages(j, {"chat": chat}) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    with pytest.raises(RowError, match="JSON list"):
        row_messages(j, {"chat": "not json"})


def test_row_params_override_job_params() -> None:
    j = job(max_tokens=8, temperature=0.5)
    assert row_params(j, {"max_tokens": 4, "temperature": None, "other": 1}) == {
        "max_tokens": 4,
        "temperature": 0.5,
    }


def test_build_request_validates_like_the_api() -> None:
    j = job(max_tokens=8, json_schema={"type": "object"})
    request = build_request(j, {"prompt": "hi", "temperature": 0}, "r1")
    assert request.sampling.max_tokens == 8 and request.sampling.temperature == 0
    assert request.sampling.structured is not None
    assert request.sampling.structured.kind == "json"
    with pytest.raises(RowError, match="temperature"):
        build_request(j, {"prompt": "hi", "temperature": -1}, "r2")
    with pytest.raises(RowError, match="max_tokens"):
        build_request(j, {"prompt": "hi", "max_tokens": 0}, "r3")
    with pytest.raises(RowError, match="missing column 'prompt'"):
        build_request(j, {"id": 1}, "r4")


def test_json_schema_checked_once_up_front(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert load_json_schema(good)["type"] == "object"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "no-such-type"}))
    with pytest.raises(ValueError, match="json_schema"):
        load_json_schema(bad)


def row(rid: str, error: str | None = None) -> dict[str, object]:
    return {"id": rid, "output": "x", "prompt_tokens": 1, "completion_tokens": 1, "error": error}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_part_writer_dedups_and_resumes(tmp_path: Path, fmt: str) -> None:
    out = str(tmp_path / "out")
    writer = PartWriter(out, fmt)  # type: ignore[arg-type]
    assert writer.write([row("a"), row("b")]) and writer.write([row("b"), row("c")])
    # A crashed run's half-written tmp file is invisible and cleaned up on resume.
    (tmp_path / "out" / f".part-00009.{fmt}.tmp").write_text("garbage")
    again = PartWriter(out, fmt)  # type: ignore[arg-type]
    assert again.done_ids == {"a", "b", "c"} and again.resumed == 3
    assert again.next_index == 2
    assert [r["id"] for r in again.write([row("a"), row("d")])] == ["d"]
    ids = [r["id"] for r in read_rows(out)]
    assert sorted(ids) == ["a", "b", "c", "d"]
    assert not list((tmp_path / "out").glob(".*.tmp"))


def test_drop_done_filters_ids_as_strings_and_bad_rows_by_error() -> None:
    rows = [json.dumps({"id": 1}), json.dumps({"id": 2}), json.dumps({"x": 1}), None]
    errors = [None, None, None, "in.jsonl line 4: not valid JSON"]
    batch = pa.table(
        [[1, 2, 3, 4], rows, errors],
        schema=pa.schema(
            [("__line", pa.int64()), ("__row", pa.string()), ("__error", pa.string())]
        ),
    )
    kept = drop_done(batch, "id", ["2", "#in.jsonl line 4: not valid JSON"])
    assert kept.column("__line").to_pylist() == [1, 3]
    assert drop_done(batch, "id", []).num_rows == 4


def test_reader_turns_bad_lines_into_bad_rows() -> None:
    from serve_app.offline.reader import csv_rows, jsonl_rows

    jsonl = io.BytesIO(b'{"id": 1}\n\n{broken\n[1]\n\xff{}\r\n{"id": 2}')
    rows = list(jsonl_rows(jsonl, "in.jsonl"))
    assert [(line, text) for line, text, _ in rows if text] == [(1, '{"id": 1}'), (6, '{"id": 2}')]
    errors = {line: error for line, _, error in rows if error}
    assert set(errors) == {3, 4, 5} and errors[3].startswith("in.jsonl line 3: not valid JSON")
    assert errors[5] == "in.jsonl line 5: not UTF-8 text"
    csv_file = io.BytesIO(b'id,text,n\n1,"two\nlines",3\n2,short\n3,\xff,4\n4,,0.5\n')
    rows = list(csv_rows(csv_file, "in.csv"))
    good = [(line, json.loads(text)) for line, text, _ in rows if text]
    assert good == [
        (2, {"id": 1, "text": "two\nlines", "n": 3}),
        (6, {"id": 4, "text": None, "n": 0.5}),
    ]
    assert [(line, error) for line, _, error in rows if error] == [
        (4, "in.csv line 4: 2 fields, the header has 3"),
        (5, "in.csv line 5: not UTF-8 text"),
    ]


def test_rows_pick_an_adapter_by_column_or_the_jobs() -> None:
    loras = {"banana": "/adapters/banana", "zebra": "org/zebra-lora"}
    per_row = job(loras=loras, adapter="banana", adapter_column="adapter")
    assert per_row.app_config.lora.active and per_row.app_config.lora.adapters == loras
    assert row_adapter(per_row, {"adapter": "zebra"}) == AdapterRef("zebra", "org/zebra-lora")
    assert row_adapter(per_row, {"adapter": None}) == AdapterRef("banana", "/adapters/banana")
    with pytest.raises(RowError, match="unknown adapter 'kiwi'"):
        row_adapter(per_row, {"adapter": "kiwi"})
    assert row_adapter(job(), {"adapter": "banana"}) is None  # No adapter column: the base.
    with pytest.raises(ValueError, match="adapter 'kiwi' is not one of"):
        job(loras=loras, adapter="kiwi")
    with pytest.raises(ValueError, match="absolute directory"):
        job(loras={"rel": "./adapters/rel"})
