"""The batch coordinator's operations (``BatchApi``) without Ray: uploads in parts, owners kept
apart, downloads streamed. The lines run through a stand-in for the engine; the real stack is
in tests/serve/test_batch_api.py and test_batch_fleet.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from serve_app.batch_api.api import BatchApi
from serve_app.batch_api.service import BatchService
from serve_app.batch_api.store import BatchStore
from serve_app.batch_api.uploads import STALE_S, Uploads
from serve_app.config import AppConfig
from serve_app.errors import APIError


def _api(root: Path, **batch_api: Any) -> BatchApi:
    config = AppConfig.model_validate({"batch_api": batch_api})
    service = BatchService(lambda model: None, config, BatchStore(root))  # type: ignore[arg-type,return-value]

    async def call(endpoint: str, body: dict[str, Any], owner: str = "") -> tuple[int, dict]:
        content = body["messages"][0]["content"]
        if content == "over":  # As check_limits answers a line past the key's limits.
            error = {"message": "max_tokens too large", "type": "invalid_request_error"}
            return 400, {"error": error | {"param": "max_tokens", "code": "limit_exceeded"}}
        return 200, {"id": f"chatcmpl-{content}", "owner": owner}

    service._call = call  # type: ignore[method-assign]
    return BatchApi(service)


def _lines(count: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"c-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": str(i)}]},
            }
        ).encode()
        + b"\n"
        for i in range(count)
    )


async def _upload(api: BatchApi, content: bytes, owner: str, part: int = 7) -> dict[str, Any]:
    upload_id = f"upload-{owner or 'none'}-{len(content)}"
    for offset in range(0, len(content), part):
        await api.upload_part(upload_id, offset, content[offset : offset + part])
    return await api.finish_upload(upload_id, len(content), "in.jsonl", "batch", owner)


async def _download(api: BatchApi, file_id: str, owner: str) -> bytes:
    items = [item async for item in api.file_content(file_id, owner)]
    size, chunks = items[0], items[1:]
    content = b"".join(chunks)  # type: ignore[arg-type]
    assert size == len(content)
    return content


async def test_an_upload_in_parts_is_one_file_and_another_owner_never_sees_it(
    tmp_path: Path,
) -> None:
    api = _api(tmp_path)
    content = _lines(5)
    file = await _upload(api, content, "alice")
    assert file["bytes"] == len(content) and file["purpose"] == "batch"
    assert await _download(api, file["id"], "alice") == content
    assert not list((tmp_path / "uploads").iterdir())  # Moved into the store, not copied.
    for look in (api.get_file, api.delete_file):
        with pytest.raises(APIError) as found:
            await look(file["id"], "bob")
        assert found.value.info.status == 404
    with pytest.raises(APIError):
        await _download(api, file["id"], "bob")
    assert (await api.delete_file(file["id"], "alice"))["deleted"]
    with pytest.raises(APIError):
        await api.get_file(file["id"], "alice")


async def test_a_part_sent_twice_lands_once_and_a_missing_part_records_nothing(
    tmp_path: Path,
) -> None:
    api = _api(tmp_path)
    await api.upload_part("upload-x", 0, b"abc")
    await api.upload_part("upload-x", 0, b"abc")  # A retried part: same bytes, same place.
    await api.upload_part("upload-x", 3, b"def")
    file = await api.finish_upload("upload-x", 6, "x.jsonl", "batch", "")
    assert await _download(api, file["id"], "") == b"abcdef"
    await api.upload_part("upload-y", 0, b"abc")
    with pytest.raises(APIError) as cut:
        await api.finish_upload("upload-y", 6, "y.jsonl", "batch", "")
    assert cut.value.info.status == 503 and cut.value.info.code == "upload_incomplete"
    assert not (tmp_path / "uploads" / "upload-y").exists()


async def test_an_upload_past_max_file_bytes_is_a_413_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    api = _api(tmp_path, max_file_bytes=1024)
    await api.upload_part("upload-big", 0, b"x" * 1000)
    with pytest.raises(APIError) as big:
        await api.upload_part("upload-big", 1000, b"x" * 100)
    assert big.value.info.status == 413 and big.value.info.param == "file"
    assert not (tmp_path / "uploads" / "upload-big").exists()
    with pytest.raises(KeyError):  # Ids name a file under uploads/, nothing else.
        await api.upload_part("../batches.sqlite3", 0, b"x")


def test_abandoned_uploads_are_swept(tmp_path: Path) -> None:
    uploads = Uploads(tmp_path)
    uploads.write("upload-old", 0, b"x")
    uploads.write("upload-new", 0, b"x")
    old = time.time() - STALE_S - 60
    os.utime(uploads.path("upload-old"), (old, old))
    assert uploads.sweep() == 1
    assert [p.name for p in uploads.dir.iterdir()] == ["upload-new"]


async def test_batches_run_for_their_owner_and_others_get_404(tmp_path: Path) -> None:
    import asyncio

    api = _api(tmp_path)
    api.start()
    file = await _upload(api, _lines(4), "alice")
    body = {"input_file_id": file["id"], "endpoint": "/v1/chat/completions"}
    with pytest.raises(APIError) as foreign:  # Bob cannot batch Alice's file.
        await api.create_batch(body, "bob")
    assert foreign.value.info.status == 404
    batch = await api.create_batch(body | {"completion_window": "1h"}, "alice")
    assert batch["completion_window"] == "1h"
    assert batch["expires_at"] - batch["created_at"] == 3600
    for _ in range(200):
        done = await api.get_batch(batch["id"], "alice")
        if done["status"] == "completed":
            break
        await asyncio.sleep(0.05)
    assert done["status"] == "completed", done
    assert (await api.list_batches(None, 20, "bob"))["data"] == []
    assert [b["id"] for b in (await api.list_batches(None, 20, "alice"))["data"]] == [batch["id"]]
    for look in (api.get_batch, api.cancel_batch):
        with pytest.raises(APIError) as hidden:
            await look(batch["id"], "bob")
        assert hidden.value.info.status == 404
    output = await _download(api, done["output_file_id"], "alice")
    lines = [json.loads(line) for line in output.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == [f"c-{i}" for i in range(4)]
    assert {line["response"]["body"]["owner"] for line in lines} == {"alice"}
    assert api.service._keeper is not None
    api.service._keeper.cancel()


def test_a_lines_trace_id_is_the_same_in_every_process_that_runs_it() -> None:
    from opentelemetry import trace

    from serve_app.batch_api.lines import line_trace_key
    from serve_app.observability.tracing import keyed_context

    def trace_id(batch_id: str, custom_id: str) -> int:
        context = keyed_context(line_trace_key(batch_id, custom_id))
        return int(trace.get_current_span(context).get_span_context().trace_id)

    assert trace_id("batch-1", "a") == trace_id("batch-1", "a") != 0
    assert len({trace_id("batch-1", "a"), trace_id("batch-1", "b"), trace_id("batch-2", "a")}) == 3


def test_with_the_batch_api_off_there_is_no_coordinator_and_its_routes_are_404() -> None:
    from serve_app import build_app
    from serve_app.batch_api import routes

    args: dict[str, Any] = {"model": {"name": "tiny-qwen2"}}
    coordinator = build_app(args)._bound_deployment.init_args[1]
    assert coordinator._bound_deployment.name == "BatchCoordinator"
    off = build_app(args | {"batch_api": {"enabled": False}})
    assert off._bound_deployment.init_args[1] is None
    before, routes._client = routes._client, None
    try:
        with pytest.raises(APIError) as off_error:
            routes.client()
        assert off_error.value.info.status == 404
        assert "batch_api.enabled" in off_error.value.info.message
    finally:
        routes._client = before


async def test_a_line_the_api_rejects_is_an_error_line_with_its_line_number(
    tmp_path: Path,
) -> None:
    import asyncio

    api = _api(tmp_path)
    api.start()
    over = json.dumps(
        {
            "custom_id": "c-over",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "over"}]},
        }
    ).encode()
    content = _lines(3) + b"{broken\n" + over + b"\n"
    file = await _upload(api, content, "")
    body = {"input_file_id": file["id"], "endpoint": "/v1/chat/completions"}
    batch = await api.create_batch(body, "")
    for _ in range(200):
        done = await api.get_batch(batch["id"], "")
        if done["status"] == "completed":
            break
        await asyncio.sleep(0.05)
    assert done["request_counts"] == {"total": 5, "completed": 3, "failed": 2}, done
    errors = [
        json.loads(x) for x in (await _download(api, done["error_file_id"], "")).split(b"\n") if x
    ]
    found = {(e["custom_id"], e["error"]["line"], e["error"]["code"]) for e in errors}
    assert found == {(None, 4, "invalid_jsonl"), ("c-over", 5, "limit_exceeded")}
    assert api.service._keeper is not None
    api.service._keeper.cancel()
