"""The Batch API without Ray or an engine: input lines, token counting, windows, the store's
verbs (tenants, quotas, leases between two coordinators, crash-safe publishing), uploads."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from serve_app.batch_api.lines import (
    EXPIRED,
    Line,
    LineError,
    error_record,
    scan,
    summarize,
)
from serve_app.batch_api.store import BatchStore, LeaseLost
from serve_app.batch_api.upload import (
    ChunkWriter,
    FieldValue,
    FileData,
    FileStart,
    MultipartStream,
)
from serve_app.config import AppConfig
from serve_app.config.batch import window_seconds
from serve_app.errors import APIError
from serve_app.openai.charging import request_charge

CHAT = "/v1/chat/completions"
MODEL = "smollm2-135m-instruct"


def chat_line(custom_id: str, **body: Any) -> str:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} | body
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": payload})


def config(**batch_api: Any) -> AppConfig:
    return AppConfig.model_validate(
        {"security": {"limits": {"max_tokens_cap": 100}}, "batch_api": batch_api}
    )


def test_every_bad_line_is_an_error_line_with_its_number() -> None:
    content = (
        "\n".join(
            [
                chat_line("a", max_tokens=5),
                "{broken",
                "",  # Blank lines are skipped but counted in the numbering.
                chat_line("a"),
                chat_line("b").replace(CHAT, "/v1/embeddings"),
                chat_line("c", max_tokens=500),  # Over max_tokens_cap: as over HTTP.
                chat_line("d", priority="high"),  # A wrong type fails this line only.
                '["not", "an", "object"]',
                json.dumps({"custom_id": "e", "url": CHAT}),
            ]
        ).encode()
        + b"\n\xff\xfe{}\n"
        + chat_line("f").encode()
    )
    items = list(scan(content, CHAT, config()))
    good = [i for i in items if isinstance(i, Line)]
    bad = {i.number: i for i in items if isinstance(i, LineError)}
    assert [(g.number, g.custom_id) for g in good] == [(1, "a"), (11, "f")]
    assert good[0].tokens == 1 + 5 and good[0].weight == 1
    codes = {n: (e.info.code, e.custom_id, e.answered) for n, e in bad.items()}
    assert codes == {
        2: ("invalid_json", None, False),
        4: ("duplicate_custom_id", None, False),  # "a" stays unique over both files.
        5: ("invalid_url", "b", False),
        6: ("integer_above_max_value", "c", True),
        7: ("invalid_value", "d", True),
        8: ("invalid_request", None, False),
        9: ("invalid_body", "e", False),
        10: ("invalid_encoding", None, False),
    }
    assert bad[6].info.param == "max_tokens" and bad[7].info.param == "priority"
    record = error_record("batch-01", 6, "c", bad[6].info, True)
    assert record["error"] == {
        "code": "integer_above_max_value",
        "message": bad[6].info.message,
        "line": 6,
    }
    assert record["response"]["status_code"] == 400 and record["custom_id"] == "c"
    expired = error_record("batch-01", 3, "x", EXPIRED, False)
    assert expired["response"] is None and expired["error"]["code"] == "batch_expired"


def test_file_level_problems_and_token_totals() -> None:
    settings = config(max_lines=2)
    assert summarize(b"\n\n", CHAT, settings).errors[0]["code"] == "empty_file"
    three = "\n".join(chat_line(str(i)) for i in range(3)).encode()
    assert summarize(three, CHAT, settings).errors[0]["code"] == "too_many_lines"
    two = summarize(three.rsplit(b"\n", 1)[0], CHAT, config())
    assert (two.total, two.errors, two.tokens) == (2, [], 2 * (1 + 1024))


def test_line_tokens_counts_n_prompts_and_tools() -> None:
    chat = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 10, "n": 3}
    assert request_charge(CHAT, chat, 1024) == 10 + 3 * 10
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert request_charge(CHAT, chat | {"tools": tools}, 1024) > 40
    prompts = {"prompt": ["abcd", "abcdefgh"], "max_tokens": 5, "n": 2}
    assert request_charge("/v1/completions", prompts, 1024) == 1 + 2 + 2 * 5 * 2
    assert request_charge("/v1/completions", {"prompt": [1, 2, 3]}, 1024) == 3 + 16


@pytest.mark.parametrize(
    ("window", "seconds"), [("24h", 86400), ("1h", 3600), ("30m", 1800), ("30s", 30)]
)
def test_completion_windows(window: str, seconds: int) -> None:
    assert window_seconds(window) == seconds


@pytest.mark.parametrize("window", ["25h", "0s", "1d", "h", "24 h", "-1h"])
def test_bad_completion_windows(window: str) -> None:
    with pytest.raises(ValueError, match="up to 24h"):
        window_seconds(window)


def new_batch(batch_id: str, total: int = 3, status: str = "validating") -> dict[str, Any]:
    return {
        "id": batch_id,
        "created_at": 1,
        "status": status,
        "input_file_id": "file-x",
        "request_counts": {"total": total, "completed": 0, "failed": 0},
    }


def test_tenants_and_the_enqueued_token_limit(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    store.create("alice", new_batch("batch-01"), tokens=60, limit=100)
    with pytest.raises(APIError) as refused:
        store.create("alice", new_batch("batch-02"), tokens=50, limit=100)
    assert refused.value.info.status == 429 and "needs 50" in str(refused.value)
    assert "60 of its 100" in str(refused.value)
    store.create("bob", new_batch("batch-03"), tokens=50, limit=100)  # Bob has his own.
    with pytest.raises(APIError, match="No batch"):
        store.get("bob", "batch-01")
    assert [b["id"] for b in store.list_batches("bob", None, 10)[0]] == ["batch-03"]
    with pytest.raises(APIError, match="No batch"):
        store.request_cancel("bob", "batch-01")
    assert store.request_cancel("alice", "batch-01")["status"] == "cancelling"


def test_two_coordinators_never_run_one_batch(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    store.create("", new_batch("batch-01"), 0, None)
    ((claimed, epoch),) = store.claim("A", lease_s=30, most=4)
    assert claimed["id"] == "batch-01" and epoch == 1
    assert store.claim("B", lease_s=30, most=4) == []  # Held: B gets nothing.
    assert store.begin("A", "batch-01")["status"] == "in_progress"
    assert store.record("A", "batch-01", [(1, True, {"custom_id": "x"})])["completed"] == 1
    with pytest.raises(LeaseLost):
        store.record("B", "batch-01", [(2, True, {"custom_id": "y"})])
    assert store.renew("A", 0, ["batch-01"]) == {"batch-01": "in_progress"}  # Expires now.
    ((taken, epoch),) = store.claim("B", lease_s=30, most=4)
    assert epoch == 2 and taken["request_counts"]["completed"] == 1
    assert store.renew("A", 30, ["batch-01"]) == {}  # A sees it lost the batch.
    with pytest.raises(LeaseLost):
        store.record("A", "batch-01", [(2, True, {"custom_id": "late"})])
    # B resumes from what A recorded; a line recorded twice keeps its first result.
    assert store.done_lines("batch-01") == {1}
    store.record(
        "B", "batch-01", [(1, True, {"custom_id": "x", "again": 1}), (2, False, {"custom_id": "z"})]
    )
    store.finalize("B", "batch-01", "completed")
    done = store.publish("B", "batch-01", epoch)
    assert done["status"] == "completed" and done["request_counts"] == {
        "total": 3,
        "completed": 1,
        "failed": 1,
    }
    assert done["completed_at"] and store.done_lines("batch-01") == set()
    output = store.files.content(done["output_file_id"]).decode().splitlines()
    assert [json.loads(line) for line in output] == [{"custom_id": "x"}]
    assert store.files.get("", done["error_file_id"])["purpose"] == "batch_output"
    assert store.claim("C", 30, 4) == []  # Ended: nobody runs it again.


def test_a_crash_mid_publish_is_published_again_by_the_next_owner(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    store.create("", new_batch("batch-01", total=1), 0, None)
    store.claim("A", 30, 1)
    store.record("A", "batch-01", [(1, True, {"custom_id": "x"})])
    store.finalize("A", "batch-01", "expired")
    store.renew("A", 0, ["batch-01"])  # A dies before publishing.
    ((batch, epoch),) = store.claim("B", 30, 1)
    assert batch["status"] == "finalizing"
    done = store.publish("B", "batch-01", epoch)
    assert done["status"] == "expired" and done["expired_at"] and "_ends_as" not in done


def test_files_of_a_publish_cut_short_are_dropped_and_a_late_owner_leaves_none(
    tmp_path: Path,
) -> None:
    store = BatchStore(tmp_path)
    store.create("", new_batch("batch-01", total=1), 0, None)
    store.claim("A", 30, 1)
    store.record("A", "batch-01", [(1, True, {"custom_id": "x"})])
    # A wrote its output file and died before recording it.
    store.files.write_durably(['{"custom_id": "x"}'], store.files.path("file-01-o1"))
    store.renew("A", 0, ["batch-01"])
    ((_, epoch),) = store.claim("B", 30, 1)
    done = store.publish("B", "batch-01", epoch)
    assert sorted(p.name for p in store.files.files_dir.iterdir()) == [done["output_file_id"]]
    # A coordinator publishing after it lost the lease keeps nothing it wrote.
    store.create("", new_batch("batch-02", total=1), 0, None)
    ((_, late),) = store.claim("A", 30, 1)
    store.record("A", "batch-02", [(1, True, {"custom_id": "y"})])
    store.renew("A", 0, ["batch-02"])
    store.claim("B", 30, 1)
    with pytest.raises(LeaseLost):
        store.publish("A", "batch-02", late)
    assert sorted(p.name for p in store.files.files_dir.iterdir()) == [done["output_file_id"]]


def test_a_coordinator_never_claims_a_batch_it_runs_and_lines_know_their_tenant(
    tmp_path: Path,
) -> None:
    store = BatchStore(tmp_path)
    store.create("alice", new_batch("batch-01"), 0, None)
    ((batch, _),) = store.claim("A", 30, 4)
    assert batch["_owner"] == "alice"
    store.renew("A", 0, ["batch-01"])  # Renewed late: the lease looks expired.
    assert store.claim("A", 30, 4, running=["batch-01"]) == []
    assert [b["id"] for b, _ in store.claim("B", 30, 4)] == ["batch-01"]


def test_uploads_stream_to_disk_and_stay_with_their_owner(tmp_path: Path) -> None:
    files = BatchStore(tmp_path).files
    upload = files.start_upload("alice", "in.jsonl")
    for offset in (20, 0, 10):  # Chunks may arrive out of order: each has its offset.
        files.write_upload("alice", upload, offset, bytes([65 + offset // 10]) * 10, limit=35)
    with pytest.raises(APIError, match="too large") as too_large:
        files.write_upload("alice", upload, 30, b"x" * 10, limit=35)
    assert too_large.value.info.status == 413
    with pytest.raises(APIError, match="No upload"):  # Dropped with its bytes.
        files.finish_upload("alice", upload, "batch")
    upload = files.start_upload("alice", "in.jsonl")
    for offset in (0, 10, 20):
        files.write_upload("alice", upload, offset, bytes([65 + offset // 10]) * 10, limit=35)
    with pytest.raises(APIError, match="No upload"):
        files.write_upload("bob", upload, 0, b"abc", limit=35)
    made = files.finish_upload("alice", upload, "batch")
    assert (
        made["bytes"] == 30
        and b"".join(files.chunks(made["id"])) == b"A" * 10 + b"B" * 10 + b"C" * 10
    )
    assert files.list_files("bob", None, None, 10, "desc") == ([], False)
    with pytest.raises(APIError, match="No file"):
        files.delete("bob", made["id"])
    files.delete("alice", made["id"])
    assert not list((tmp_path / "uploads").iterdir())
    stale = files.start_upload("carol", "x.jsonl")
    assert files.sweep_uploads(idle_s=3600) == 0 and files.sweep_uploads(idle_s=-1) == 1
    with pytest.raises(APIError, match="No upload"):
        files.finish_upload("carol", stale, "batch")


async def test_chunk_writer_keeps_writes_in_flight_and_reports_failures() -> None:
    written: dict[int, bytes] = {}
    most, running = [0], [0]

    async def write(offset: int, chunk: bytes) -> None:
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.01)
        running[0] -= 1
        if chunk == b"bad":
            raise APIError("refused", status=413)
        written[offset] = chunk

    writer = ChunkWriter(write, in_flight=3)
    for chunk in (b"aa", b"bbb", b"c", b"dddd"):
        await writer.send(chunk)
    await writer.flush()
    assert written == {0: b"aa", 2: b"bbb", 5: b"c", 6: b"dddd"} and most[0] == 3
    failing = ChunkWriter(write, in_flight=1)
    await failing.send(b"bad")
    with pytest.raises(APIError, match="refused"):
        await failing.send(b"next")


def test_multipart_is_parsed_as_it_arrives() -> None:
    body = (
        b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n" + b"0123456789" * 5 + b"\r\n--XyZ--\r\n"
    )
    stream = MultipartStream("multipart/form-data; boundary=XyZ")
    events = [event for i in range(0, len(body), 7) for event in stream.feed(body[i : i + 7])]
    events += stream.finish()
    assert events[0] == FieldValue("purpose", "batch")
    assert events[1] == FileStart("file", "in.jsonl")
    data = b"".join(e.data for e in events if isinstance(e, FileData))
    assert data == b"0123456789" * 5 and len(events) > 4  # Bytes passed on in pieces.
    with pytest.raises(APIError, match="multipart"):
        MultipartStream("application/json")
