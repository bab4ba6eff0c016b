"""The OpenAI Batch API without an engine: input validation and the store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _line(custom_id: str, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {}})


def test_batch_input_validation_names_the_line() -> None:
    from serve_app.batch_api.service import parse_input
    from serve_app.errors import APIError

    good = f"{_line('a')}\n\n{_line('b')}\n".encode()
    assert [line["custom_id"] for line in parse_input(good, "/v1/chat/completions")] == ["a", "b"]
    # A raw U+2028 inside a string is not a line end (str.splitlines would say it is); CRLF is.
    odd = json.dumps({"custom_id": "a\u2028b", "method": "POST", "url": "/v1/completions",
                      "body": {}}, ensure_ascii=False)  # fmt: skip
    lines = parse_input(f"{odd}\r\n{_line('c', '/v1/completions')}".encode(), "/v1/completions")
    assert [line["custom_id"] for line in lines] == ["a\u2028b", "c"]
    cases = {
        f"{_line('a')}\n{{oops\n": "Line 2 .* not valid JSON",
        f"{_line('a')}\n{_line('a')}\n": "duplicate custom_id 'a'",
        f"{_line('a', '/v1/embeddings')}\n": "url must be",
        "": "no requests",
    }
    for content, match in cases.items():
        with pytest.raises(APIError, match=match):
            parse_input(content.encode(), "/v1/chat/completions")


def test_batch_store_files_pagination_and_partials(tmp_path: Path) -> None:
    from serve_app.batch_api.store import BatchStore

    store = BatchStore(tmp_path)
    file = store.create_file(b"abc", "in.jsonl", "batch")
    assert store.get_file(file["id"]) == file and store.file_content(file["id"]) == b"abc"
    for i in range(5):
        store.save_batch({"id": f"batch-{i}", "created_at": 100 + i, "status": "completed"})
    store.update_batch("batch-1", status="in_progress")
    page, more = store.list_batches(None, 2)
    assert [b["id"] for b in page] == ["batch-4", "batch-3"] and more
    page, more = store.list_batches("batch-3", 5)
    assert [b["id"] for b in page] == ["batch-2", "batch-1", "batch-0"] and not more
    assert [b["id"] for b in store.active_batches()] == ["batch-1"]
    store.append_partial("batch-1", "output", {"custom_id": "a"})
    with store.partial_path("batch-1", "output").open("a") as handle:
        handle.write('{"custom_id": "b"')  # torn by a crash
    assert store.read_partial("batch-1", "output") == [{"custom_id": "a"}]
    store.append_partial("batch-1", "output", {"custom_id": "c"})
    assert len(store.read_partial("batch-1", "output")) == 2
    out = store.finish_partial("batch-1", "output", "batch_output")
    assert out is not None and store.file_content(out).count(b"\n") == 2
    assert store.delete_file(file["id"]) and store.get_file(file["id"]) is None


def test_batches_made_in_one_second_list_newest_first(tmp_path: Path) -> None:
    from serve_app.batch_api.store import BatchStore, new_id

    store = BatchStore(tmp_path)
    made = [new_id("batch") for _ in range(50)]
    for batch_id in made:
        store.save_batch({"id": batch_id, "created_at": 100, "status": "completed"})
    page, more = store.list_batches(None, 3)
    assert [b["id"] for b in page] == made[::-1][:3] and more
    page, _ = store.list_batches(page[-1]["id"], 100)
    assert [b["id"] for b in page] == made[::-1][3:]
