"""Offline jobs without Ray or an engine: templates, rows → requests, ids and resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from serve_app.config import AppConfig
from serve_app.hops import LoraAdapter
from serve_app.offline.output import PartWriter, read_rows
from serve_app.offline.rows import (
    JobConfig,
    RowError,
    build_request,
    fill_template,
    load_json_schema,
    row_messages,
    row_params,
    template_fields,
    with_adapters,
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


def adapter_dir(where: Path) -> str:
    where.mkdir(parents=True)
    (where / "adapter_config.json").write_text("{}")
    return str(where)


def test_rows_name_their_adapter_or_take_the_jobs(tmp_path: Path) -> None:
    poet = adapter_dir(tmp_path / "poet")
    config = with_adapters(AppConfig(), [f"poet={poet}", "tone=org/tone-lora"])
    assert config.model.lora_adapters == {"poet": poet, "tone": "org/tone-lora"}
    j = job(app_config=config, adapter_column="lora")
    assert build_request(j, {"prompt": "hi", "lora": "poet"}, "r1").adapter == "poet"
    assert build_request(j, {"prompt": "hi", "lora": None}, "r2").adapter is None
    model = config.model.public_name
    assert build_request(j, {"prompt": "hi", "lora": model}, "r3").adapter is None
    with pytest.raises(RowError, match="lora: 'sonnet' is not an adapter of the model"):
        build_request(j, {"prompt": "hi", "lora": "sonnet"}, "r4")
    both = job(app_config=config, adapter="tone", adapter_column="lora")
    assert build_request(both, {"prompt": "hi"}, "r5").adapter == "tone"
    assert build_request(both, {"prompt": "hi", "lora": "poet"}, "r6").adapter == "poet"
    assert both.lora("poet") == LoraAdapter("poet", poet)
    assert both.lora(None) is None


def test_adapters_are_checked_before_any_row_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the model has no LoRA adapters"):
        job(adapter="poet")
    with pytest.raises(ValueError, match="give NAME=PATH"):
        with_adapters(AppConfig(), ["poet"])
    with pytest.raises(ValueError, match="adapter name"):
        with_adapters(AppConfig(), ["bad name=/tmp"])
    (tmp_path / "empty").mkdir()
    config = with_adapters(AppConfig(), [f"poet={tmp_path / 'empty'}"])
    with pytest.raises(ValueError, match=r"has no adapter_config\.json"):
        job(app_config=config, adapter="poet")


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


def test_drop_done_filters_ids_as_strings() -> None:
    batch = pa.table({"id": [1, 2, 3, None], "prompt": ["a", "b", "c", "d"]})
    kept = drop_done(batch, "id", ["2"])
    assert kept.column("id").to_pylist() == [1, 3, None]
    assert drop_done(batch, "missing", ["2"]).num_rows == 4


def test_old_module_name_still_runs_the_offline_cli() -> None:
    """``python -m serve_app.batch`` (the old name) says the new one, then runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "serve_app.batch", "run", "--help"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "python -m serve_app.offline" in done.stderr.splitlines()[0]
    assert done.stdout.startswith("usage: python -m serve_app.offline run")
