"""The OpenAI Batch API without an engine: input validation and the store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def _line(custom_id: str, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {}})


def test_batch_input_validation_names_the_line() -> None:
    from serve_app.batch_api.input import parse_input
    from serve_app.errors import APIError

    good = f"{_line('a')}\n\n{_line('b')}\n".encode()
    parsed = parse_input(good, "/v1/chat/completions")
    assert [line["custom_id"] for line in parsed.lines] == ["a", "b"] and not parsed.rejected
    # A raw U+2028 inside a string is not a line end (str.splitlines would say it is); CRLF is.
    odd = json.dumps({"custom_id": "a\u2028b", "method": "POST", "url": "/v1/completions",
                      "body": {}}, ensure_ascii=False)  # fmt: skip
    parsed = parse_input(f"{odd}\r\n{_line('c', '/v1/completions')}".encode(), "/v1/completions")
    assert [line["custom_id"] for line in parsed.lines] == ["a\u2028b", "c"]
    for content, match in {"": "no requests", "{oops\n": "line 1: not valid JSON"}.items():
        with pytest.raises(APIError, match=match):  # Nothing can run: refused at create.
            parse_input(content.encode(), "/v1/chat/completions")


def test_bad_lines_are_rejected_one_by_one_and_the_rest_run() -> None:
    from serve_app.batch_api.input import parse_input

    content = (
        "\n".join(
            [
                _line("a"),
                "{oops",
                _line("a"),
                _line("b", "/v1/embeddings"),
                json.dumps({"custom_id": "", "url": "/v1/chat/completions", "body": {}}),
                json.dumps({"custom_id": "c", "url": "/v1/chat/completions", "body": "x"}),
                _line("d"),
            ]
        ).encode()
        + b"\n\xff\xfe not text\n"
    )
    parsed = parse_input(content, "/v1/chat/completions")
    assert [line["custom_id"] for line in parsed.lines] == ["a", "d"]
    assert [(r["line"], r["custom_id"], r["code"]) for r in parsed.rejected] == [
        (2, None, "invalid_jsonl"),
        (3, "a", "duplicate_id"),
        (4, "b", "invalid_url"),
        (5, None, "invalid_line"),
        (6, "c", "invalid_line"),
        (8, None, "invalid_jsonl"),
    ]
    assert parsed.total == 8


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
    out = store.publish_partial("batch-1", "output", "batch_output")
    assert out is not None and store.file_content(out).count(b"\n") == 2
    assert store.publish_partial("batch-1", "output", "batch_output") == out  # Idempotent.
    assert store.publish_partial("batch-1", "error", "batch_output") is None  # No lines.
    store.drop_partials("batch-1")
    assert not store.partial_path("batch-1", "output").exists()
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


def test_files_and_batches_belong_to_their_key(tmp_path: Path) -> None:
    """Another key's lookups find nothing (the routes answer 404), its lists skip them, its
    deletes delete nothing; a batch's output file belongs to the batch's key."""
    from serve_app.batch_api.store import BatchStore

    store = BatchStore(tmp_path)
    mine = store.create_file(b"x", "in.jsonl", "batch", owner="alice")
    assert store.get_file(mine["id"], "alice") == mine
    assert store.get_file(mine["id"], "bob") is None and store.get_file(mine["id"], "") is None
    assert not store.delete_file(mine["id"], "bob") and store.get_file(mine["id"]) is not None
    for i, owner in enumerate(["alice", "bob", "alice", "bob"]):
        store.save_batch(
            {"id": f"batch-{i}", "created_at": 100 + i, "status": "in_progress"}, owner
        )
    store.update_batch("batch-2", status="completed")  # An update keeps the owner.
    assert store.get_batch("batch-2", "bob") is None and store.get_batch("batch-2", "alice")
    assert [b["id"] for b in store.list_batches(None, 10, "alice")[0]] == ["batch-2", "batch-0"]
    assert [b["id"] for b in store.list_batches(None, 10, "bob")[0]] == ["batch-3", "batch-1"]
    assert [b["id"] for b in store.list_batches("batch-3", 10, "bob")[0]] == ["batch-1"]
    assert len(store.list_batches(None, 10)[0]) == 4  # The service's own view: every batch.
    store.append_partial("batch-2", "output", {"custom_id": "a"})
    out = store.publish_partial("batch-2", "output", "batch_output")
    assert out is not None and store.get_file(out, "alice") and store.get_file(out, "bob") is None


def test_a_store_from_before_owners_opens_as_one_tenant(tmp_path: Path) -> None:
    import sqlite3

    from serve_app.batch_api.store import BatchStore

    db = sqlite3.connect(tmp_path / "batches.sqlite3")
    with db:
        db.execute("CREATE TABLE files (id TEXT PRIMARY KEY, created_at INTEGER, data TEXT)")
        db.execute(
            "CREATE TABLE batches (id TEXT PRIMARY KEY, created_at INTEGER, status TEXT, data TEXT)"
        )
        db.execute("INSERT INTO files VALUES ('file-1', 1, ?)", (json.dumps({"id": "file-1"}),))
    db.close()
    store = BatchStore(tmp_path)
    assert store.get_file("file-1", "") == {"id": "file-1"}
    assert store.get_file("file-1", "alice") is None


def test_completion_windows_up_to_a_day() -> None:
    from serve_app.batch_api.window import expired_line, window_seconds
    from serve_app.errors import APIError

    assert [window_seconds(w) for w in ("24h", "1h", "30m", "90s")] == [86400, 3600, 1800, 90]
    for bad in ("25h", "0s", "1d", "24 h", "", "01h", "1000000s"):
        with pytest.raises(APIError) as caught:
            window_seconds(bad)
        assert caught.value.info.param == "completion_window", bad
    line = expired_line("batch_req_1", "row-7", "30m")
    assert line["custom_id"] == "row-7" and line["response"] is None
    assert line["error"]["code"] == "batch_expired" and "30m" in line["error"]["message"]


def _stage(store: Any, batch_id: str, contents: list[str], owner: str = "", **fields: Any) -> None:
    """A validating chat batch of one line per content (custom_id = content)."""
    lines = [
        {"custom_id": c, "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": c}]}}
        for c in contents
    ]  # fmt: skip
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = store.create_file(data, "in.jsonl", "batch", owner)
    batch = {
        "id": batch_id, "object": "batch", "endpoint": "/v1/chat/completions",
        "input_file_id": upload["id"], "completion_window": "24h", "status": "validating",
        "created_at": 100, "expires_at": 10**10,
        "request_counts": {"total": len(lines), "completed": 0, "failed": 0},
    } | fields  # fmt: skip
    store.save_batch(batch, owner=owner)


async def _run_held(service: Any, batch_id: str) -> None:
    """Run a batch as the replica holding its lease."""
    assert service.store.leases.claim(batch_id, service.holder, service.lease_s)
    await service._run(batch_id)


async def test_a_batch_past_its_window_expires_with_what_finished(tmp_path: Path) -> None:
    """Pure logic with a stand-in serving: quick lines finish, slow ones are cut at the
    window and become batch_expired error lines, each custom_id once."""
    import asyncio
    import time

    from serve_app.batch_api.service import BatchService
    from serve_app.batch_api.store import BatchStore
    from serve_app.config import AppConfig

    store = BatchStore(tmp_path)
    started: list[str] = []
    cancelled: list[str] = []

    service = BatchService(lambda model: None, AppConfig(), store)  # type: ignore[arg-type,return-value]

    async def call(endpoint: str, body: dict, owner: str = "") -> tuple[int, dict]:
        content = body["messages"][0]["content"]
        started.append(content)
        try:
            await asyncio.sleep(0 if content.startswith("quick") else 30)
        except asyncio.CancelledError:
            cancelled.append(content)
            raise
        return 200, {"id": f"chatcmpl-{content}"}

    service._call = call  # type: ignore[method-assign]
    contents = [f"{kind}-{i}" for kind in ("quick", "slow") for i in range(3)]
    _stage(store, "batch-w", contents, completion_window="1s", expires_at=time.time() + 0.5)
    await _run_held(service, "batch-w")
    done = store.get_batch("batch-w")
    assert done is not None and done["status"] == "expired" and done["expired_at"]
    assert sorted(cancelled) == ["slow-0", "slow-1", "slow-2"]
    outputs = [json.loads(x) for x in store.file_content(done["output_file_id"]).splitlines()]
    errors = [json.loads(x) for x in store.file_content(done["error_file_id"]).splitlines()]
    assert sorted(o["custom_id"] for o in outputs) == ["quick-0", "quick-1", "quick-2"]
    assert sorted(e["custom_id"] for e in errors) == ["slow-0", "slow-1", "slow-2"]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert done["request_counts"] == {"total": 6, "completed": 3, "failed": 3}


async def test_a_crash_while_finishing_runs_no_line_again(tmp_path: Path) -> None:
    """Killed after publishing the output file, before the batch recorded it: the restarted
    service runs nothing again and publishes under the same file id (no orphan copy)."""
    import asyncio

    from serve_app.batch_api.service import BatchService
    from serve_app.batch_api.store import BatchStore
    from serve_app.config import AppConfig

    store = BatchStore(tmp_path)
    calls: list[str] = []

    async def call(endpoint: str, body: dict, owner: str = "") -> tuple[int, dict]:
        calls.append(body["messages"][0]["content"])
        return 200, {"id": "chatcmpl-x"}

    _stage(store, "batch-crash", [f"c-{i}" for i in range(4)], owner="k")
    first = BatchService(lambda model: None, AppConfig(), store, lease_s=0.2)  # type: ignore[arg-type,return-value]
    first._call = call  # type: ignore[method-assign]
    real_update = store.update_batch

    def crash_on_record(batch_id: str, **fields: object) -> dict:
        if "output_file_id" in fields:
            raise SystemExit("killed")  # The process dies here.
        return real_update(batch_id, **fields)

    store.update_batch = crash_on_record  # type: ignore[method-assign]
    with pytest.raises(SystemExit):
        await _run_held(first, "batch-crash")
    store.update_batch = real_update  # type: ignore[method-assign]
    assert sorted(calls) == ["c-0", "c-1", "c-2", "c-3"]
    restarted = BatchService(lambda model: None, AppConfig(), BatchStore(tmp_path))  # type: ignore[arg-type,return-value]
    restarted._call = call  # type: ignore[method-assign]
    await asyncio.sleep(0.25)  # The dead replica's lease lapses.
    await _run_held(restarted, "batch-crash")
    done = restarted.store.get_batch("batch-crash")
    assert done is not None and done["status"] == "completed"
    assert len(calls) == 4  # Nothing ran twice.
    outputs = restarted.store.file_content(done["output_file_id"]).splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in outputs) == ["c-0", "c-1", "c-2", "c-3"]
    rows = restarted.store._db.execute("SELECT data FROM files").fetchall()
    published = [json.loads(r[0])["id"] for r in rows if '"batch_output"' in r[0]]
    assert published == [done["output_file_id"]]
    assert not restarted.store.partial_path("batch-crash", "output").exists()


async def test_a_running_batch_does_its_file_and_database_work_off_the_event_loop(
    tmp_path: Path,
) -> None:
    """The router's loop streams interactive responses: every store call of a batch runs in
    a thread, and request counts are written at most about once a second, not once a line."""
    import asyncio
    import threading

    from serve_app.batch_api.service import BatchService
    from serve_app.batch_api.store import BatchStore
    from serve_app.config import AppConfig

    loop_thread = threading.get_ident()
    on_loop: list[str] = []
    count_updates: list[dict] = []

    class Watched(BatchStore):
        def __getattribute__(self, name: str) -> Any:
            attr = super().__getattribute__(name)
            if not callable(attr) or name.startswith("_") or name == "partial_path":
                return attr

            def watched(*args: Any, **kwargs: Any) -> Any:
                if threading.get_ident() == loop_thread:  # Called, not just looked up.
                    on_loop.append(name)
                return attr(*args, **kwargs)

            return watched

        def update_batch(self, batch_id: str, **fields: Any) -> dict[str, Any]:
            if "request_counts" in fields and "status" not in fields:
                count_updates.append(fields["request_counts"])
            return super().update_batch(batch_id, **fields)

    store = Watched(tmp_path)
    _stage(store, "batch-io", [f"l-{i}" for i in range(40)])
    on_loop.clear()
    service = BatchService(lambda model: None, AppConfig(), store)  # type: ignore[arg-type,return-value]

    async def call(endpoint: str, body: dict, owner: str = "") -> tuple[int, dict]:
        await asyncio.sleep(0.05)
        return 200, {"id": "chatcmpl-x"}

    service._call = call  # type: ignore[method-assign]
    await _run_held(service, "batch-io")
    assert on_loop == [], on_loop
    done = store.get_batch("batch-io")
    assert done is not None and done["status"] == "completed"
    assert done["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    assert len(count_updates) <= 2, count_updates  # 40 lines in ~0.1 s: not 40 writes.


def test_a_keys_unfinished_batches_are_held_to_its_queue_limit(tmp_path: Path) -> None:
    from serve_app.batch_api.store import BatchStore
    from serve_app.config.security import SecurityConfig

    store = BatchStore(tmp_path)

    def batch(batch_id: str) -> dict[str, Any]:
        return {"id": batch_id, "created_at": 100, "status": "validating"}

    assert store.create_batch_within(batch("batch-a"), "alice", 600, 1000) is None
    assert store.create_batch_within(batch("batch-b"), "alice", 500, 1000) == 600  # Refused.
    assert store.get_batch("batch-b") is None
    assert store.create_batch_within(batch("batch-c"), "bob", 900, 1000) is None  # Per key.
    store.update_batch("batch-a", status="completed")  # Finished batches no longer count.
    assert store.create_batch_within(batch("batch-b"), "alice", 500, 1000) is None
    assert store.create_batch_within(batch("batch-d"), "alice", 10**9, None) is None
    config = SecurityConfig(batch_queue_tokens=5000, key_batch_queue_tokens={"nightly": 10**8})
    assert config.batch_queue_tokens_for("alice") == 5000
    assert config.batch_queue_tokens_for("nightly") == 10**8
    assert SecurityConfig().batch_queue_tokens_for("alice") is None


def _replica(tmp_path: Path, calls: list[str], lease_s: float, line_s: float = 0.02) -> Any:
    """A router replica's batch service: its own store connection (as another process has),
    lines answered by a stand-in after ``line_s``."""
    import asyncio

    from serve_app.batch_api.service import BatchService
    from serve_app.batch_api.store import BatchStore
    from serve_app.config import AppConfig

    service = BatchService(
        lambda model: None,  # type: ignore[arg-type,return-value]
        AppConfig(),
        BatchStore(tmp_path),
        max_in_flight=2,
        lease_s=lease_s,
    )

    async def call(endpoint: str, body: dict, owner: str = "") -> tuple[int, dict]:
        await asyncio.sleep(line_s)
        calls.append(body["messages"][0]["content"])
        return 200, {"id": "chatcmpl-x"}

    service._call = call  # type: ignore[method-assign]
    return service


async def _settled(store: Any, batch_id: str, timeout_s: float = 20.0) -> dict[str, Any]:
    import asyncio

    async with asyncio.timeout(timeout_s):
        while (batch := store.get_batch(batch_id))["status"] not in ("completed", "cancelled"):
            await asyncio.sleep(0.02)
    return dict(batch)


def _output_ids(store: Any, batch: dict[str, Any]) -> list[str]:
    lines = store.file_content(batch["output_file_id"]).splitlines()
    return sorted(json.loads(line)["custom_id"] for line in lines)


async def test_replicas_run_a_batch_once_and_take_over_a_dead_ones(tmp_path: Path) -> None:
    """Two replicas on one store: only one runs the batch; when it dies (tasks gone, no
    release) the other takes it over once the lease lapses and finishes it from where it was,
    each line in the output once."""
    import asyncio

    calls: dict[str, list[str]] = {"a": [], "b": []}
    a = _replica(tmp_path, calls["a"], lease_s=0.6)
    b = _replica(tmp_path, calls["b"], lease_s=0.6)
    contents = [f"l-{i:02d}" for i in range(40)]
    _stage(a.store, "batch-fleet", contents)
    a.ensure_resumed()
    b.ensure_resumed()
    while len(calls["a"]) + len(calls["b"]) < 10:
        await asyncio.sleep(0.01)
    first, other = (a, b) if calls["a"] else (b, a)
    assert not calls["b" if first is a else "a"]  # One runner, not two.
    assert first._keeper is not None
    first._keeper.cancel()  # The replica dies: no renewals, no release, no finish.
    for task in list(first._tasks.values()):
        task.cancel()
    done = await _settled(other.store, "batch-fleet")
    assert done["status"] == "completed"
    assert _output_ids(other.store, done) == contents
    ran = calls["a"] + calls["b"]
    assert sorted(set(ran)) == contents
    assert len(ran) <= len(contents) + 2  # At most the lines in flight at the death again.
    assert other._keeper is not None
    other._keeper.cancel()


async def test_a_cancel_through_any_replica_stops_the_batch_where_it_runs(
    tmp_path: Path,
) -> None:
    import asyncio

    calls: list[str] = []
    runner = _replica(tmp_path, calls, lease_s=0.6, line_s=0.1)
    other = _replica(tmp_path, [], lease_s=0.6)
    _stage(runner.store, "batch-c", [f"l-{i:02d}" for i in range(60)])
    runner.ensure_resumed()
    while len(calls) < 4:
        await asyncio.sleep(0.01)
    cancelling = await other.cancel("batch-c")  # Not the replica running it.
    assert cancelling is not None and cancelling["status"] == "cancelling"
    assert "batch-c" not in other._tasks
    done = await _settled(other.store, "batch-c")
    assert done["status"] == "cancelled"
    assert len(calls) < 30  # Stopped within a renewal, not run to the end.
    assert _output_ids(other.store, done) == sorted(calls)
    assert await other.cancel("batch-c") is None  # Finished: nothing to cancel.
    assert runner._keeper is not None
    runner._keeper.cancel()


async def test_a_hung_replica_that_wakes_writes_no_record_over_its_successor(
    tmp_path: Path,
) -> None:
    """A replica stopped past its lease (no renewals) while its successor finished the batch:
    its own finish is refused, and the batch keeps the successor's record."""
    import asyncio

    from serve_app.batch_api.store import LeaseLost

    hung_calls: list[str] = []
    hung = _replica(tmp_path, hung_calls, lease_s=0.3, line_s=0.1)
    successor = _replica(tmp_path, [], lease_s=0.3)
    contents = [f"l-{i:02d}" for i in range(20)]
    _stage(hung.store, "batch-h", contents)
    assert hung.store.leases.claim("batch-h", hung.holder, hung.lease_s)
    running = asyncio.ensure_future(hung._run("batch-h"))  # No keeper: it never renews.
    await asyncio.sleep(0.4)
    successor.ensure_resumed()
    done = await _settled(successor.store, "batch-h")
    await running
    assert successor.store.get_batch("batch-h") == done  # The woken one recorded nothing.
    assert _output_ids(successor.store, done) == contents  # Each line once.
    with pytest.raises(LeaseLost):
        hung.store.update_batch("batch-h", holder=hung.holder, status="failed")
    assert successor._keeper is not None
    successor._keeper.cancel()
