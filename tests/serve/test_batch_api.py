"""The OpenAI Batch API with the official client, on the real engine (SmolLM2 on vLLM CPU).

The Batch API router runs in a standalone FastAPI app over an ``OpenAIServing`` backed by the
same ``Preprocessor`` and ``VLLMEngine`` the Serve graph uses (no Serve, so it does not depend
on how serve_app/ingress/router.py wires it); the last test checks the Serve app once it is wired.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from openai import BadRequestError, NotFoundError, OpenAI, RateLimitError

from serve_app.batch_api import routes as batch_api
from serve_app.batch_api.store import BatchStore
from serve_app.config import AppConfig
from serve_app.errors import APIError, ErrorInfo
from serve_app.hops import EngineRequest, EngineStep, PreprocessRequest, PreprocessResult
from serve_app.openai.serving import OpenAIServing

MODEL = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[2]
QUEUE_TOKENS = 100_000  # security.batch_queue_tokens of the module's app (one tenant: "").
LEASE_S = 3.0  # batch_api.lease_s: a dead replica's batches move on this soon.


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    import os

    import uvicorn

    from serve_app.engine.vllm_engine import VLLMEngine
    from serve_app.models import resolve_model
    from serve_app.offline.__main__ import app_config
    from serve_app.preprocess.preprocessor import Preprocessor

    config: AppConfig = app_config(str(ROOT / "serve_config.cpu.yaml"))
    config.engine.kv_cache_space_gib = 1
    config.security.batch_queue_tokens = QUEUE_TOKENS
    config.batch_api.lease_s = LEASE_S
    os.environ.update(config.engine.runtime_env_vars())
    path = resolve_model(MODEL)
    preprocessor = Preprocessor(config, path)
    engine = VLLMEngine(config, path)

    async def preprocess(request: PreprocessRequest) -> PreprocessResult:
        return (await asyncio.to_thread(preprocessor.preprocess_batch, [request]))[0]

    async def generate(request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
        async for step in engine.generate(request):
            yield step

    serving = OpenAIServing(config, preprocess, generate)
    root = tmp_path_factory.mktemp("batches")
    app = FastAPI()
    app.include_router(batch_api.router)

    @app.exception_handler(APIError)
    async def _error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.info.body(), status_code=exc.info.status)

    batch_api.attach(serving, config, root)
    port = _port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", root
    server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()


@pytest.fixture(scope="module")
def bclient(batch_server: tuple[str, Path]) -> OpenAI:
    return OpenAI(base_url=f"{batch_server[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 6,
            "temperature": 0,
        }
        | body,
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def wait_done(client: OpenAI, batch_id: str, timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.5)


def by_custom_id(client: OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    text = client.files.content(file_id).text
    lines = [json.loads(line) for line in text.split("\n") if line]  # JSONL: \n ends a line.
    assert len({line["custom_id"] for line in lines}) == len(lines)
    return {line["custom_id"]: line for line in lines}


def _local_service() -> Any:
    """The standalone app's batch service (what ``batch_api.attach`` made)."""
    local = batch_api._client
    assert isinstance(local, batch_api._Local)
    return local.api.service


def _on_loop(service: Any, work: Any) -> Any:
    """Run ``work()`` on the server's loop (where the services and the engine run)."""
    assert service._keeper is not None

    async def run() -> Any:
        return work()

    loop = service._keeper.get_loop()
    return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=30)


def _stop(service: Any) -> None:
    """The replica dies: its keeper and batch tasks gone, its leases never renewed again."""

    def die() -> None:
        service._keeper.cancel()
        for task in service._tasks.values():
            task.cancel()

    _on_loop(service, die)


def test_batch_end_to_end(bclient: OpenAI) -> None:
    lines = [chat_line(f"q-{i}", f"Say the number {i}.") for i in range(8)]
    lines.append(chat_line("bad-model", "hi", model="nope"))
    lines.append(chat_line("bad-temp", "hi", temperature=-1))
    upload = bclient.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes > 0
    assert bclient.files.retrieve(upload.id).id == upload.id
    batch = bclient.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status in ("validating", "in_progress")
    done = wait_done(bclient, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (10, 8)
    assert done.request_counts.failed == 2
    outputs = by_custom_id(bclient, done.output_file_id)
    assert set(outputs) == {f"q-{i}" for i in range(8)}
    for line in outputs.values():
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["choices"][0]["message"]["content"]
        assert 1 <= body["usage"]["completion_tokens"] <= 6
    errors = by_custom_id(bclient, done.error_file_id)
    assert errors["bad-model"]["response"]["status_code"] == 404
    assert errors["bad-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert errors["bad-temp"]["response"]["status_code"] == 400
    assert bclient.files.delete(upload.id).deleted
    with pytest.raises(NotFoundError):
        bclient.files.retrieve(upload.id)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"not json\n", "line 1: not valid JSON"),
        (jsonl([chat_line("a", "x") | {"url": "/v1/embeddings"}]), "url must be"),
        (b"\n\n", "no requests"),
    ],
)
def test_input_with_no_line_that_can_run_is_a_400(
    bclient: OpenAI, content: bytes, match: str
) -> None:
    upload = bclient.files.create(file=("in.jsonl", content), purpose="batch")
    with pytest.raises(BadRequestError, match=match):
        bclient.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )


def test_bad_input_lines_are_error_lines_and_the_rest_run(bclient: OpenAI) -> None:
    """Malformed JSON, a duplicate custom_id, a wrong url and a body the API rejects each
    become a line of the error file (custom_id when known, the line number, a code); the good
    lines run."""
    content = (
        jsonl([chat_line("a", "Say one."), chat_line("a", "Say two.")])
        + b"{broken\n"
        + jsonl([chat_line("b", "Say three.") | {"url": "/v1/embeddings"}])
        + jsonl([chat_line("c", "Say four.")])
        + jsonl([chat_line("d", "Say five.", temperature=-1)])
    )
    upload = bclient.files.create(file=("in.jsonl", content), purpose="batch")
    batch = bclient.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_done(bclient, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (6, 2, 4)
    assert set(by_custom_id(bclient, done.output_file_id)) == {"a", "c"}
    assert done.error_file_id is not None
    text = bclient.files.content(done.error_file_id).text
    rejected = [json.loads(line) for line in text.split("\n") if line]
    found = {(r["custom_id"], r["error"]["line"], r["error"]["code"]) for r in rejected}
    assert found == {
        ("a", 2, "duplicate_id"),
        (None, 3, "invalid_jsonl"),
        ("b", 4, "invalid_url"),
        ("d", 6, "invalid_value"),  # Ran: the API's 400 is its response, as OpenAI's.
    }
    (ran,) = [r for r in rejected if r["custom_id"] == "d"]
    assert ran["response"]["status_code"] == 400
    never_ran = [r for r in rejected if r is not ran]
    assert all(r["response"] is None and r["error"]["message"] for r in never_ran)


def test_completions_endpoint_list_and_cancel(bclient: OpenAI) -> None:
    line = {
        "custom_id": "c-1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5},
    }
    upload = bclient.files.create(file=("c.jsonl", jsonl([line])), purpose="batch")
    first = bclient.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    assert wait_done(bclient, first.id).status == "completed"
    slow = [chat_line(f"s-{i}", "Write a long story.", max_tokens=200) for i in range(64)]
    upload = bclient.files.create(file=("s.jsonl", jsonl(slow)), purpose="batch")
    second = bclient.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    page = bclient.batches.list(limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more
    older = bclient.batches.list(limit=1, after=second.id)
    assert [b.id for b in older.data] == [first.id]
    assert bclient.batches.cancel(second.id).status == "cancelling"
    cancelled = wait_done(bclient, second.id, timeout=60)
    assert cancelled.status == "cancelled"
    assert cancelled.request_counts is not None and cancelled.request_counts.completed < 64


def test_a_batch_past_its_completion_window_ends_expired(bclient: OpenAI) -> None:
    """A 10-second window on a batch that needs about a minute: what finished is in the
    output file, the rest are batch_expired error lines (OpenAI's semantics), each once."""
    quick = [chat_line(f"e-quick-{i}", f"Say the number {i}.", max_tokens=2) for i in range(3)]
    slow = [
        chat_line(f"e-slow-{i}", "Write a long story.", max_tokens=1000, ignore_eos=True)
        for i in range(12)
    ]
    upload = bclient.files.create(file=("e.jsonl", jsonl(quick + slow)), purpose="batch")
    batch = bclient.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="10s",  # type: ignore[arg-type]  # OpenAI's own API takes 24h only.
    )
    assert batch.expires_at is not None and batch.expires_at - batch.created_at == 10
    done = wait_done(bclient, batch.id, timeout=120)
    assert done.status == "expired" and done.expired_at is not None
    outputs = by_custom_id(bclient, done.output_file_id)
    errors = by_custom_id(bclient, done.error_file_id)
    assert set(outputs) == {line["custom_id"] for line in quick}
    assert set(errors) == {line["custom_id"] for line in slow}
    assert {e["error"]["code"] for e in errors.values()} == {"batch_expired"}
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 12)
    with pytest.raises(BadRequestError, match="completion_window"):
        bclient.batches.create(
            input_file_id=upload.id,
            endpoint="/v1/chat/completions",
            completion_window="48h",  # type: ignore[arg-type]
        )


def test_a_batch_past_the_enqueued_token_limit_is_a_429_with_the_numbers(
    bclient: OpenAI,
) -> None:
    """600 lines x 200 tokens (n and every prompt counted) cannot be enqueued under a
    100,000-token limit; nothing is stored, and a batch that fits still runs."""
    big = [chat_line(f"q-{i}", "Write a poem.", max_tokens=100, n=2) for i in range(600)]
    upload = bclient.files.create(file=("q.jsonl", jsonl(big)), purpose="batch")
    with pytest.raises(RateLimitError) as caught:
        bclient.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "batch_queue_limit_exceeded", error
    assert f"{QUEUE_TOKENS}" in error["message"] and "tokens" in error["message"]
    small = bclient.files.create(file=("s.jsonl", jsonl(big[:3])), purpose="batch")
    batch = bclient.batches.create(
        input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert wait_done(bclient, batch.id).status == "completed"


def test_resume_after_restart(bclient: OpenAI, batch_server: tuple[str, Path]) -> None:
    """A batch left in_progress with partial output finishes the rest once, on attach."""
    _, root = batch_server
    lines = [chat_line(f"r-{i}", f"Count to {i}.") for i in range(4)]
    store = BatchStore(root)
    upload = store.create_file(jsonl(lines), "r.jsonl", "batch")
    batch = {
        "id": "batch-resume",
        "object": "batch",
        "endpoint": "/v1/chat/completions",
        "input_file_id": upload["id"],
        "completion_window": "24h",
        "status": "in_progress",
        "created_at": int(time.time()),
        "request_counts": {"total": 4, "completed": 1, "failed": 0},
    }
    store.save_batch(batch)
    earlier = {"id": "x", "custom_id": "r-0", "response": {"status_code": 200, "body": {}}}
    store.append_partial("batch-resume", "output", earlier)
    with store.partial_path("batch-resume", "output").open("a") as handle:
        handle.write('{"torn line')  # the crash happened mid-write
    old = _local_service()
    bclient.batches.list()  # The old replica is up (a service starts on its first call) ...
    _stop(old)  # ... and gone: a restart leaves no second live replica on the store.
    batch_api.attach(old.serving_for, old.config, root)  # a restarted router replica
    done = wait_done(bclient, "batch-resume")
    assert done.status == "completed"
    outputs = by_custom_id(bclient, done.output_file_id)
    assert set(outputs) == {"r-0", "r-1", "r-2", "r-3"} and outputs["r-0"]["id"] == "x"


def test_another_replica_finishes_the_batch_of_one_that_died(
    bclient: OpenAI, batch_server: tuple[str, Path]
) -> None:
    """A second router replica's batch service on the same store (its own connection, as in
    another process), the real engine under both. The replica running a batch dies (its tasks
    gone, its lease never renewed again): the second one takes the batch over once the lease
    lapses and finishes it, every line in the output once."""
    from serve_app.batch_api.service import BatchService

    _, root = batch_server
    bclient.batches.list()  # Starts the attached service, if no call has yet.
    dying = _local_service()
    survivor = BatchService(dying.serving_for, dying.config, BatchStore(root))

    def on_loop(work: Any) -> Any:
        return _on_loop(dying, work)

    on_loop(survivor.ensure_resumed)
    # Lengths spread out, so lines finish one after another rather than all at once.
    lines = [chat_line(f"d-{i}", f"Tell a story number {i}.", max_tokens=4 + i) for i in range(60)]
    upload = bclient.files.create(file=("d.jsonl", jsonl(lines)), purpose="batch")
    batch = bclient.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    store = BatchStore(root)
    assert store.leases.holder(batch.id) == dying.holder
    deadline = time.monotonic() + 120
    while (counts := bclient.batches.retrieve(batch.id).request_counts) is None or (
        counts.completed < 3
    ):
        assert time.monotonic() < deadline, "no line finished"
        time.sleep(0.2)

    _stop(dying)
    assert counts.completed < len(lines), "finished before the replica died: nothing to take"
    try:
        done = wait_done(bclient, batch.id)
        assert done.status == "completed"
        assert store.leases.holder(batch.id) == survivor.holder
        assert set(by_custom_id(bclient, done.output_file_id)) == {f"d-{i}" for i in range(60)}
    finally:
        assert survivor._keeper is not None
        on_loop(survivor._keeper.cancel)
        batch_api.attach(dying.serving_for, dying.config, root)  # A live one for what follows.


def test_wired_into_the_serve_app(base_url: str, client: OpenAI) -> None:
    if httpx.get(f"{base_url}/v1/batches", timeout=30).status_code == 404:
        pytest.skip("batch_api is not wired into serve_app/ingress/router.py yet")
    upload = client.files.create(file=("in.jsonl", jsonl([chat_line("w", "Hi")])), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_done(client, batch.id)
    assert done.status == "completed" and set(by_custom_id(client, done.output_file_id)) == {"w"}


def test_a_100_mb_upload_streams_past_the_2_mib_body_limit(base_url: str, client: OpenAI) -> None:
    """The Serve app keeps security.max_body_bytes (2 MiB) for every other route; an upload
    streams to disk under batch_api.max_file_bytes, and downloads stream back. The router's
    and the coordinator's own memory (USS) comes back flat: Serve's proxy hands the router the
    body in large batches, whose memory goes back to the OS once freed (app.BUFFER_ENV, and
    routes._give_back_memory after each upload). Serve's receive task in the router holds its
    last batch until the request's disconnect message, which can come just after the client
    has the response (with the proxy on gRPC): memory is read once the request is over."""
    import psutil

    from tests.serve.conftest import APP
    from tests.serve.test_scale_survive import _replica_pids

    row = json.dumps(chat_line("row", "Summarize: " + "lorem ipsum " * 80)) + "\n"
    content = row.encode() * (100 * 1024 * 1024 // len(row))
    routers = [psutil.Process(pid) for pid in _replica_pids(APP, "Router")]
    coordinators = [psutil.Process(pid) for pid in _replica_pids(APP, "BatchCoordinator")]

    def own(processes: list[psutil.Process]) -> int:
        return sum(p.memory_full_info().uss for p in processes)

    def grown_when_settled() -> tuple[int, int]:
        deadline = time.monotonic() + 30
        while True:
            grown = own(routers) - before[0], own(coordinators) - before[1]
            if max(grown) < 25e6 or time.monotonic() > deadline:
                return grown
            time.sleep(0.5)

    before = own(routers), own(coordinators)
    upload = client.files.create(file=("big.jsonl", content), purpose="batch")
    grown = grown_when_settled()
    assert upload.bytes == len(content) > 100_000_000
    print(
        f"\n{len(content) / 1e6:.0f} MB uploaded; USS grew {grown[0] / 1e6:.1f} MB (router), "
        f"{grown[1] / 1e6:.1f} MB (coordinator)"
    )
    assert max(grown) < 25e6, grown  # Under 1 MB here; 30-55 MB in the router before.
    with httpx.stream("GET", f"{base_url}/v1/files/{upload.id}/content", timeout=120) as got:
        assert got.status_code == 200
        assert sum(len(chunk) for chunk in got.iter_bytes()) == len(content)
    client.files.delete(upload.id)
    too_big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 3_000_000}]}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=too_big, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
