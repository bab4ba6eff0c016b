"""The OpenAI Batch API on the real graph: two router replicas, the BatchCoordinator, SmolLM2 on
vLLM CPU, the official openai client, two API keys.

One app ("batchapi") next to the shared one: keys, a short lease (a killed coordinator's batch
is taken over within seconds) and a store in a temporary directory.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import psutil
import pytest
from openai import OpenAI

from serve_app import build_app
from tests.serve.conftest import MODEL
from tests.serve.test_scale_survive import _replica_pids

APP = "batchapi"
KEYS = {"alice": "sk-alice-5b1c9e", "bob": "sk-bob-7d2a4f", "small": "sk-small-0e8c1a"}
CHAT: Literal["/v1/chat/completions"] = "/v1/chat/completions"
FRANCE = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def batch_url(base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    tmp = Path(tmp_path_factory.mktemp("batchapi"))
    keys = tmp / "api_keys"
    keys.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    keys.chmod(0o600)
    args: dict[str, Any] = {
        "model": {"name": MODEL, "max_model_len": 2048, "dtype": "auto"},
        "engine": {
            "device": "cpu",
            "enforce_eager": True,
            "kv_cache_space_gib": 1,
            "block_size": 32,
            "max_num_seqs": 64,
            "num_cpus": 0.2,
        },
        "preprocessor": {"num_cpus": 0.05},
        "router": {"num_cpus": 0.05, "num_replicas": 2},
        "security": {"api_keys_file": str(keys), "limits": {"max_tokens_cap": 512}},
        "batch_api": {
            "root": str(tmp / "store"),
            "lease_s": 4,
            "poll_s": 0.25,
            "key_enqueued_tokens": {"small": 5000},
        },
    }
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}", blocking=False)
    url = f"{base_url}/{APP}"
    deadline = time.monotonic() + 900
    while not _ready(url):
        assert time.monotonic() < deadline, f"{APP} not ready after 900 s"
        time.sleep(1)
    yield url
    serve.delete(APP)


def _ready(url: str) -> bool:
    try:
        auth = {"Authorization": f"Bearer {KEYS['alice']}"}
        return httpx.get(f"{url}/v1/batches", headers=auth, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def client(url: str, name: str = "alice") -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=KEYS[name], max_retries=0, timeout=300)


def router_urls(batch_url: str) -> list[str]:
    """Each router replica's own HTTP address (Serve's direct ingress), so a test can send to
    a chosen one; the shared proxy address when replicas do not listen themselves."""
    urls = []
    for pid in _replica_pids(APP, "Router"):
        ports = [
            c.laddr.port
            for c in psutil.Process(pid).net_connections("tcp")
            if c.status == "LISTEN" and 30000 <= c.laddr.port < 31000
        ]
        for port in ports:
            for url in (f"http://127.0.0.1:{port}/{APP}", f"http://127.0.0.1:{port}"):
                if _ready(url):
                    urls.append(url)
                    break
    return urls if len(urls) == 2 else [batch_url, batch_url]


def line(custom_id: str, content: str = FRANCE, **body: Any) -> dict[str, Any]:
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
    } | body
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": payload}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(item) + "\n" for item in lines).encode()


def wait_done(clients: list[OpenAI], batch_id: str, timeout: float = 600) -> Any:
    """Poll through each client in turn; a 503 (coordinator restarting) is waited out."""
    deadline, turn = time.monotonic() + timeout, 0
    while True:
        assert time.monotonic() < deadline, f"batch {batch_id} not done in {timeout} s"
        turn += 1
        try:
            batch = clients[turn % len(clients)].batches.retrieve(batch_id)
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc
            time.sleep(0.5)
            continue
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.5)


def records(api: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(text) for text in api.files.content(file_id).text.splitlines()]


def engine_counts(batch_id: str) -> dict[str, int]:
    from ray import serve

    engine = serve.get_deployment_handle("Engine", app_name=APP)
    return dict(engine.batch_line_counts.remote(batch_id).result(timeout_s=60))


def test_either_router_serves_every_call_and_each_line_runs_once(batch_url: str) -> None:
    urls = router_urls(batch_url)
    if os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1":  # Direct ingress: one URL each.
        assert len(set(urls)) == 2, urls
    first, second = (client(url) for url in urls)
    lines = [
        line(f"q-{i}", FRANCE, max_tokens=12) if i % 50 == 0 else line(f"q-{i}", f"Say {i}.")
        for i in range(500)
    ]
    upload = first.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert second.files.retrieve(upload.id).bytes == upload.bytes
    batch = second.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    assert first.batches.retrieve(batch.id).status in ("validating", "in_progress")
    done = wait_done([first, second], batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None and done.request_counts.completed == 500
    assert first.files.content(done.output_file_id).content == (
        second.files.content(done.output_file_id).content
    )
    outputs = records(second, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"q-{i}" for i in range(500))
    paris = [o for o in outputs if int(o["custom_id"][2:]) % 50 == 0]
    answers = [o["response"]["body"]["choices"][0]["message"]["content"] for o in paris]
    assert sum("Paris" in answer for answer in answers) >= 8, answers
    assert done.error_file_id is None
    counts = engine_counts(batch.id)
    assert counts["completed"] == counts["distinct"] == 500, counts


def test_keys_never_see_each_others_files_or_batches(batch_url: str) -> None:
    alice, bob = client(batch_url, "alice"), client(batch_url, "bob")
    upload = alice.files.create(file=("a.jsonl", jsonl([line("a-1")])), purpose="batch")
    batch = alice.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="1h")
    for attempt in (
        lambda: bob.files.retrieve(upload.id),
        lambda: bob.files.content(upload.id),
        lambda: bob.files.delete(upload.id),
        lambda: bob.batches.retrieve(batch.id),
        lambda: bob.batches.cancel(batch.id),
        lambda: bob.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert upload.id not in {f.id for f in bob.files.list()}
    assert batch.id not in {b.id for b in bob.batches.list()}
    assert batch.id in {b.id for b in alice.batches.list()}
    assert wait_done([alice], batch.id).status == "completed"


def test_bad_lines_are_error_lines_and_the_rest_run(batch_url: str) -> None:
    api = client(batch_url)
    lines = [json.dumps(line(f"r-{i}")) for i in range(200)]
    lines[49] = '{"custom_id": "r-49", "body": {broken'
    lines[119] = json.dumps(line("r-119", max_tokens=5000))  # Over max_tokens_cap 512.
    upload = api.files.create(file=("r.jsonl", "\n".join(lines).encode()), purpose="batch")
    done = wait_done(
        [api],
        api.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h").id,
    )
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (198, 2)
    assert len(records(api, done.output_file_id)) == 198
    errors = {e["error"]["line"]: e for e in records(api, done.error_file_id)}
    assert set(errors) == {50, 120}
    assert errors[50]["error"]["code"] == "invalid_json" and errors[50]["custom_id"] is None
    assert errors[120]["custom_id"] == "r-119"
    assert errors[120]["response"]["status_code"] == 400
    assert errors[120]["response"]["body"]["error"]["param"] == "max_tokens"
    # A key's enqueued-token limit: a create that would pass it is a 429 with the numbers.
    small = client(batch_url, "small")
    big_lines = jsonl([line(f"b-{i}", max_tokens=100) for i in range(60)])
    big = small.files.create(file=("big.jsonl", big_lines), purpose="batch")
    needs = 60 * (math.ceil(len(FRANCE) / 4) + 100)
    with pytest.raises(openai.RateLimitError, match=f"needs {needs} tokens"):
        small.batches.create(input_file_id=big.id, endpoint=CHAT, completion_window="24h")


def test_a_killed_coordinator_loses_and_repeats_nothing(batch_url: str) -> None:
    api = client(batch_url)
    lines = [line(f"k-{i}", f"Name a color ({i}).", max_tokens=6) for i in range(300)]
    upload = api.files.create(file=("k.jsonl", jsonl(lines)), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 300
    while (counts := api.batches.retrieve(batch.id).request_counts) is None or (
        counts.completed < 30
    ):
        assert time.monotonic() < deadline, "no progress to kill in the middle of"
        time.sleep(0.2)
    (pid,) = _replica_pids(APP, "BatchCoordinator")
    os.kill(pid, signal.SIGKILL)
    done = wait_done([api], batch.id)
    assert done.status == "completed" and _replica_pids(APP, "BatchCoordinator") != [pid]
    outputs = records(api, done.output_file_id)
    errors = records(api, done.error_file_id)
    ids = collections.Counter(o["custom_id"] for o in outputs)
    assert not errors, (len(errors), errors[:3])
    assert set(ids) == {f"k-{i}" for i in range(300)} and max(ids.values()) == 1
    engine = engine_counts(batch.id)
    assert engine["completed"] == engine["distinct"] == 300, engine


def _file_chunks(total_bytes: int) -> Iterator[bytes]:
    """About ``total_bytes`` of batch lines, a megabyte at a time."""
    template, sent, i = json.dumps(line("ID")), 0, 0
    while sent < total_bytes:
        chunk = "".join(template.replace('"ID"', f'"u-{i + j}"') + "\n" for j in range(5000))
        i, sent = i + 5000, sent + len(chunk)
        yield chunk.encode()


def _upload(url: str, size: int, mb_per_s: float | None = None) -> httpx.Response:
    """A file of about ``size`` bytes of batch lines, streamed as multipart (never in memory),
    at most ``mb_per_s`` megabytes a second when given."""

    def body() -> Iterator[bytes]:
        yield b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--B\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
        start, sent = time.monotonic(), 0
        for chunk in _file_chunks(size):
            yield chunk
            sent += len(chunk)
            if mb_per_s is not None:
                time.sleep(max(0.0, start + sent / (mb_per_s * 1024**2) - time.monotonic()))
        yield b"\r\n--B--\r\n"

    headers = {
        "Authorization": f"Bearer {KEYS['alice']}",
        "content-type": "multipart/form-data; boundary=B",
    }
    return httpx.post(f"{url}/v1/files", content=body(), timeout=600, headers=headers)


def _memory(pids: list[int]) -> tuple[int, int]:
    """(RSS, USS) of the processes in MiB; USS leaves out shared pages (Ray's object store)."""
    infos = [psutil.Process(pid).memory_full_info() for pid in pids]
    return sum(i.rss for i in infos) >> 20, sum(i.uss for i in infos) >> 20


def _upload_watching(
    url: str, pids: list[int], size: int, mb_per_s: float | None = None
) -> tuple[dict[str, Any], int, int]:
    """Upload ``size`` bytes; (file object, peak RSS growth, peak USS growth) of ``pids``."""
    api = client(url)
    for _ in range(2):  # Warm-up: first-use allocations are not the upload.
        api.files.delete(_upload(url, 8 * 1024**2).json()["id"])
    before, peak, stop = _memory(pids), [0, 0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            now = _memory(pids)
            peak[:] = [max(peak[0], now[0]), max(peak[1], now[1])]
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        response = _upload(url, size, mb_per_s)
    finally:
        stop.set()
        sampler.join()
    assert response.status_code == 200, response.text
    return response.json(), peak[0] - before[0], peak[1] - before[1]


def test_a_100_mb_upload_streams_through_with_flat_router_memory(batch_url: str) -> None:
    size = 100 * 1024**2
    urls = router_urls(batch_url)
    if urls[0] != batch_url:  # Straight into one router (Serve's direct ingress): flat.
        # Serve's ingress reads a body as fast as the client sends it (no backpressure), so a
        # loopback client that outpaces the router's disk queues the difference in Serve, not
        # in our spool; a 200 Mbit/s client is one the spool keeps pace with.
        (pid,) = [p for p in _replica_pids(APP, "Router") if _listens(p, urls[0])]
        uploaded, rss, uss = _upload_watching(urls[0], [pid], size, mb_per_s=25)
        print(f"\n100 MB into one router: RSS +{rss} MiB, private +{uss} MiB")
        # RSS also counts object-store pages the chunks pass through. A router that buffered
        # the body would grow by 100 MiB; a loaded 2-core CI box lets the spool fall behind a
        # little (a 50 MB/s client once failed the earlier 16 MiB bound there).
        assert uss < 32
        client(batch_url).files.delete(uploaded["id"])
    # Through Serve's proxy, Serve relays the body to the router as fast as the client sends
    # it (large batches via the object store, shared pages): the router's own memory stays
    # well below the file's size, since it spools what arrives (the same 200 Mbit/s client:
    # an unthrottled loopback one measured +31 to +60 MiB, what Serve had queued).
    routers = _replica_pids(APP, "Router")
    uploaded, rss, uss = _upload_watching(batch_url, routers, size, mb_per_s=25)
    print(f"100 MB through the proxy: router RSS +{rss} MiB, private +{uss} MiB")
    assert uss < 48  # Under half the file, whatever Serve queued on a busy machine.
    digest = hashlib.sha256()
    for chunk in _file_chunks(size):
        digest.update(chunk)
    back = hashlib.sha256()
    auth = {"Authorization": f"Bearer {KEYS['alice']}"}
    url = f"{batch_url}/v1/files/{uploaded['id']}/content"
    with httpx.stream("GET", url, headers=auth, timeout=600) as download:
        for chunk in download.iter_bytes():
            back.update(chunk)
    assert uploaded["bytes"] >= size and back.hexdigest() == digest.hexdigest()
    # Every other route keeps the default 2 MiB body limit.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 3 * 1024**2}]}
    refused = httpx.post(f"{batch_url}/v1/chat/completions", json=chat, headers=auth, timeout=60)
    assert refused.status_code == 413
    client(batch_url).files.delete(uploaded["id"])


def _listens(pid: int, url: str) -> bool:
    port = int(url.split(":")[2].split("/")[0])
    return any(c.laddr.port == port for c in psutil.Process(pid).net_connections("tcp"))


def test_cancel_keeps_finished_lines_and_a_short_window_expires(batch_url: str) -> None:
    api = client(batch_url)
    long = {"max_tokens": 512, "ignore_eos": True}
    lines = [line(f"s-{i}") for i in range(10)]
    lines += [line(f"l-{i}", "Tell a long story.", **long) for i in range(60)]
    upload = api.files.create(file=("w.jsonl", jsonl(lines)), purpose="batch")
    cancelled = api.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="1h")
    while (counts := api.batches.retrieve(cancelled.id).request_counts) is None or (
        counts.completed < 1
    ):
        time.sleep(0.2)
    assert api.batches.cancel(cancelled.id).status == "cancelling"
    done = wait_done([api], cancelled.id)
    assert done.status == "cancelled" and done.cancelled_at
    kept = records(api, done.output_file_id)
    assert done.request_counts is not None
    assert kept and len(kept) == done.request_counts.completed
    # 30 s cannot finish 60 sequences of 512 tokens on CPU: the rest expires.
    expiring = api.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="30s")
    done = wait_done([api], expiring.id)
    assert done.status == "expired" and done.expired_at
    outputs, errors = records(api, done.output_file_id), records(api, done.error_file_id)
    assert outputs and errors and len(outputs) + len(errors) == 70
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert {o["custom_id"] for o in outputs}.isdisjoint(e["custom_id"] for e in errors)


def test_an_upload_is_its_first_file_part_only(batch_url: str) -> None:
    first, second = jsonl([line("first")]), jsonl([line("second")])
    body = b"".join(
        b'--B\r\nContent-Disposition: form-data; name="%s"; filename="%s"\r\n\r\n%s\r\n'
        % (name, name + b".jsonl", data)
        for name, data in ((b"file", first), (b"extra", second))
    )
    body += b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B--\r\n'
    headers = {
        "Authorization": f"Bearer {KEYS['alice']}",
        "content-type": "multipart/form-data; boundary=B",
    }
    response = httpx.post(f"{batch_url}/v1/files", content=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    uploaded = response.json()
    assert uploaded["filename"] == "file.jsonl" and uploaded["bytes"] == len(first)
    assert client(batch_url).files.content(uploaded["id"]).content == first
