"""Cache-aware routing across two engine replicas, on the real stack.

One app for the module, deployed from a Serve config (as `serve deploy` would): two small
engine replicas (1 GiB of KV cache each) behind the prefix-aware request router, with a tight
spill margin so a burst on one prompt must spill, and one LoRA adapter (built here) whose
requests the router keeps on one replica. Its last test scales the engines 2 -> 1 by
redeploying the config while requests run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from serve_app.launch import _merge, load_serve_config, wait_ready
from serve_app.models import resolve_model
from serve_app.models.lora_adapter import build_lora_adapter
from tests.serve.conftest import MODEL, ROOT
from tests.serve.test_observability import _metrics_text, _sample

APP = "routing"
ROUTING: dict[str, Any] = {
    "engine": {
        "num_replicas": 2,
        "kv_cache_space_gib": 1,
        "num_cpus": 0.1,
        "graceful_shutdown_timeout_s": 60,
        # A stopped replica is found unhealthy after 3 failed checks in a row: ~20 s.
        "health_check_period_s": 2,
        "health_check_timeout_s": 5,
        "routing": {"spill_margin": 1, "spill_ratio": 0},
    },
    "router": {"num_cpus": 0.05},
    "preprocessor": {"num_cpus": 0.05},
    # Drains are bounded by the request timeout (graceful shutdown must cover it): a short one
    # keeps the scale-down test from waiting out a 10-minute default.
    "request_timeout_s": 50,
}
ADAPTER = "poet"
# Where the module's adapter is built (the fixture fills it in; every redeploy names it).
ADAPTER_DIRS: dict[str, str] = {}
DECISIONS = "ray_serve_app_routing_decisions_total"
RESUBMISSIONS = "ray_serve_app_engine_resubmissions_total"
CHANNEL_STREAMS = "ray_serve_app_engine_channel_streams_total"


def system_prompt(k: int) -> str:
    """~700 tokens, distinct per k from the first sentence on."""
    rules = " ".join(f"Rule {k}.{i}: answer politely about topic {i * 7 + k}." for i in range(60))
    return f"You are support agent number {k} of a shipping company. {rules}"


def chat(k: int, question: str, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system_prompt(k)},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def _deploy(engine_replicas: int | None = None) -> None:
    """Apply the app's Serve config; a changed replica count alone is a plain rescale."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    args = load_serve_config(ROOT / "serve_config.cpu.yaml")["applications"][0]["args"]
    lora = {
        "model": {"lora_adapters": ADAPTER_DIRS},
        "engine": {"vllm_args": {"max_loras": 1, "max_lora_rank": 8}},
        "batch_api": {"enabled": False},  # Not under test here: one process less on 2 cores.
    }
    app: dict[str, Any] = {
        "name": APP,
        "route_prefix": f"/{APP}",
        "import_path": "serve_app:build_app",
        "args": _merge(_merge(args, ROUTING), lora),
    }
    if engine_replicas is not None:
        app["deployments"] = [{"name": "Engine", "num_replicas": engine_replicas}]
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}))


def _engine_replicas() -> dict[str, int]:
    """Replica states of the app's Engine, e.g. {"RUNNING": 2}."""
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or "Engine" not in app.deployments:
        return {}
    states = app.deployments["Engine"].replica_states
    return {str(state): n for state, n in states.items() if n}


def _wait_for_engines(running: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while _engine_replicas() != {"RUNNING": running}:
        assert time.monotonic() < deadline, _engine_replicas()
        time.sleep(1)


def _decisions(**labels: str) -> dict[str, float]:
    """This app's routing decisions per replica, as exported to Prometheus."""
    text = _metrics_text()
    replicas = {
        line.split('replica="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if line.startswith(DECISIONS) and f'application="{APP}"' in line
    }
    return {r: _sample(text, DECISIONS, application=APP, replica=r, **labels) for r in replicas}


def _settled_decisions(expected_total: float | None = None) -> dict[str, float]:
    """Per-replica decisions once the export stops moving (or reaches ``expected_total``)."""
    import ray

    gap_s = ray._config.metrics_report_interval_ms() / 1000 + 2
    value, deadline = _decisions(), time.monotonic() + 120
    while time.monotonic() < deadline:
        if expected_total is not None and sum(value.values()) >= expected_total:
            return value
        time.sleep(gap_s)
        again = _decisions()
        if expected_total is None and again == value:
            return value
        value = again
    return value


@pytest.fixture(scope="module")
def routing_url(base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    where = tmp_path_factory.mktemp("adapters") / ADAPTER
    ADAPTER_DIRS[ADAPTER] = str(build_lora_adapter(resolve_model(MODEL), where, seed=1))
    url = f"{base_url}/{APP}"
    try:
        _deploy()
        wait_ready(url, timeout_s=600)
        _wait_for_engines(2)
        yield url
    finally:  # Also when the deploy or a test failed.
        # Engines drain for up to graceful_shutdown_timeout_s (60 s): more than serve.delete's
        # own 60-second wait on a busy machine, so wait here, longer.
        serve.delete(APP, _blocking=False)
        deadline = time.monotonic() + 300
        while APP in serve.status().applications:
            assert time.monotonic() < deadline, f"{APP} still deleting after 300 s"
            time.sleep(1)


@pytest.fixture(scope="module")
def routing_client(routing_url: str) -> OpenAI:
    return OpenAI(base_url=f"{routing_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_requests_sharing_a_prefix_are_served_from_one_replicas_cache(
    routing_client: OpenAI,
) -> None:
    """Serve's default router would send each follow-up to a random one of the two replicas
    (half of them recomputing the prompt); every follow-up here finds its prefix cached."""
    questions = ["Where is my parcel?", "Can I change the address?", "Do you ship abroad?"]
    for k in (1, 2):
        first = routing_client.chat.completions.create(**chat(k, "Hello"))
        assert first.usage is not None
        for question in questions:
            usage = routing_client.chat.completions.create(**chat(k, question)).usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens or 0
            assert cached >= 0.8 * first.usage.prompt_tokens, (k, question, cached)


def test_a_hot_prompt_spills_over_to_the_other_replica(routing_url: str) -> None:
    before = _settled_decisions()
    burst = 12

    async def run() -> list[int]:
        async with AsyncOpenAI(
            base_url=f"{routing_url}/v1", api_key="unused", max_retries=0, timeout=180
        ) as client:
            calls = [
                client.chat.completions.with_raw_response.create(**chat(1, f"Question {i}?", 24))
                for i in range(burst)
            ]
            return [r.status_code for r in await asyncio.gather(*calls)]

    assert asyncio.run(run()) == [200] * burst
    after = _settled_decisions(expected_total=sum(before.values()) + burst)
    served = {r: after.get(r, 0) - before.get(r, 0) for r in after}
    assert sum(served.values()) == burst
    assert len([n for n in served.values() if n > 0]) == 2, served  # Not all on one replica.
    spilled = sum(_decisions(reason="spill").values())
    assert spilled >= 1


def test_a_completion_with_several_prompts_is_routed_whole(routing_client: OpenAI) -> None:
    """Its engine calls share the HTTP request's internal id in Serve's router: each must still
    get a replica (they used to wait out engine_wait_timeout_s and fail with a 503)."""
    prompts = [f"{system_prompt(k)} Question: where is parcel {k}?" for k in range(5, 9)]
    completion = routing_client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=2, temperature=0
    )
    assert sorted(choice.index for choice in completion.choices) == [0, 1, 2, 3]


def test_an_adapters_requests_go_to_the_replica_that_has_it_loaded(
    routing_client: OpenAI,
) -> None:
    """Serve's default router would load the adapter on both replicas (and on every replica
    of a larger fleet); ours keeps an adapter's requests on its home replica, which every
    router replica computes alike, until that replica is past the spill margin."""
    before = _settled_decisions()
    before_adapter = _decisions(reason="adapter")
    questions = [
        f"Write line {i} of a poem about the {topic}."
        for i, topic in enumerate(
            ["sea", "moon", "city", "rain", "forest", "train", "snow", "desert"]
        )
    ]
    for question in questions:  # One at a time: never past the margin.
        response = routing_client.chat.completions.create(
            model=ADAPTER,
            messages=[{"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
        )
        assert response.model == ADAPTER and response.choices[0].message.content
    _settled_decisions(expected_total=sum(before.values()) + len(questions))
    after = _decisions(reason="adapter")
    served = sorted(after.get(r, 0) - before_adapter.get(r, 0) for r in after)
    assert served[-1] == len(questions) and sum(served) == len(questions), served


def test_a_killed_engine_replica_costs_no_request_that_had_not_started(routing_url: str) -> None:
    """SIGKILL one engine replica under load. What it held and had not answered yet (every
    non-streaming request) is resubmitted to the other replica, invisibly: all 200. A stream
    that had started ends with an error event, then [DONE]; nothing hangs. Serve brings the
    replica back. The first two streams open the router's output channels (one per prompt,
    each prompt's home replica); the later two stream through them, so the kill also cuts a
    channel with streams on it."""
    import json
    import os
    import signal

    from tests.serve.test_scale_survive import _replica_pids

    before = _sample(_metrics_text(), RESUBMISSIONS, application=APP)
    channel_before = _sample(_metrics_text(), CHANNEL_STREAMS, application=APP)

    started: list[int] = []

    async def stream(http: httpx.AsyncClient, i: int) -> list[str]:
        body = chat(3 + i % 2, f"Tell a long story about ship {i}.", 160) | {"stream": True}
        body["ignore_eos"] = True
        events = []
        async with http.stream("POST", f"{routing_url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 2:  # Role, then the first token.
                        started.append(i)
        return events

    async def whole(http: httpx.AsyncClient, i: int) -> int:
        body = chat(3 + i % 2, f"Tell a long story about plane {i}.", 96)
        body["ignore_eos"] = True
        return (await http.post(f"{routing_url}/v1/chat/completions", json=body)).status_code

    async def run() -> tuple[list[list[str]], list[int]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(240, connect=30)) as http:
            streams = [asyncio.create_task(stream(http, i)) for i in range(2)]
            deadline = time.monotonic() + 120
            while len(started) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)  # Their replicas offered channels: opened by now.
            await asyncio.sleep(1)
            streams += [asyncio.create_task(stream(http, i)) for i in range(2, 4)]
            wholes = [asyncio.create_task(whole(http, i)) for i in range(8)]
            while len(started) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)  # Admitted on both replicas, streams under way.
            victim = _replica_pids(APP, "Engine")[0]
            os.kill(victim, signal.SIGKILL)
            return list(await asyncio.gather(*streams)), list(await asyncio.gather(*wholes))

    streamed, statuses = asyncio.run(run())
    assert statuses == [200] * 8, statuses
    cut = 0
    for events in streamed:
        assert events[-1] == "data: [DONE]", events[-3:]
        if '"error"' in events[-2]:
            cut += 1
            assert json.loads(events[-2][6:])["error"]["type"] == "server_error", events[-2]
    after = _sample(_metrics_text(), RESUBMISSIONS, application=APP)
    deadline = time.monotonic() + 60
    while after <= before and time.monotonic() < deadline:  # Exported every few seconds.
        time.sleep(2)
        after = _sample(_metrics_text(), RESUBMISSIONS, application=APP)
    channel_after = _sample(_metrics_text(), CHANNEL_STREAMS, application=APP)
    while channel_after <= channel_before and time.monotonic() < deadline:
        time.sleep(2)
        channel_after = _sample(_metrics_text(), CHANNEL_STREAMS, application=APP)
    print(
        f"\nreplica killed: {cut} of 4 streams cut, {after - before:.0f} resubmitted, 8/8 200, "
        f"{channel_after - channel_before:.0f} streams on output channels"
    )
    assert after > before, "no request was resubmitted: the killed replica held none"
    assert channel_after > channel_before, "no stream went through an output channel"
    _wait_for_engines(2)


def test_a_hung_engine_replica_costs_no_request_that_had_not_started(routing_url: str) -> None:
    """SIGSTOP one engine replica with non-streaming requests on it: its connections stay open
    and nothing on them ever fails. Once Serve finds it unhealthy, the router probes it, finds
    it silent and resubmits what it held to the other replica: all 200, well inside
    request_timeout_s (50 s), where they used to wait it out (504)."""
    import os
    import signal

    from tests.serve.test_scale_survive import _replica_pids

    before = _sample(_metrics_text(), RESUBMISSIONS, application=APP)

    async def whole(http: httpx.AsyncClient, i: int) -> int:
        body = chat(1 + i % 2, f"Write a long letter about harbour {i}.", 200)
        body["ignore_eos"] = True
        return (await http.post(f"{routing_url}/v1/chat/completions", json=body)).status_code

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(240, connect=30)) as http:
            wholes = [asyncio.create_task(whole(http, i)) for i in range(8)]
            await asyncio.sleep(3)  # Preprocessed and admitted: the burst spills to both.
            victim = _replica_pids(APP, "Engine")[0]
            os.kill(victim, signal.SIGSTOP)
            try:
                return list(await asyncio.gather(*wholes))
            finally:
                os.kill(victim, signal.SIGCONT)  # Serve replaces it; let it die cleanly.

    statuses = asyncio.run(run())
    assert statuses == [200] * 8, statuses
    after = _sample(_metrics_text(), RESUBMISSIONS, application=APP)
    deadline = time.monotonic() + 60
    while after <= before and time.monotonic() < deadline:  # Exported every few seconds.
        time.sleep(2)
        after = _sample(_metrics_text(), RESUBMISSIONS, application=APP)
    print(f"\nreplica stopped: {after - before:.0f} resubmitted, 8/8 200")
    assert after > before, "no request was resubmitted: the stopped replica held none"
    _wait_for_engines(2)


def test_scaling_down_mid_run_costs_no_request(routing_url: str) -> None:
    """Engines 2 -> 1 by redeploying the config while 4 clients keep sending: the leaving
    replica drains, its prompts re-route to the other one and are cached there again."""
    results: list[tuple[int, int]] = []  # (prompt, status)

    async def client_loop(http: httpx.AsyncClient, w: int, stop: asyncio.Event) -> None:
        n = 0
        while not stop.is_set():
            k = 1 + (w + n) % 2
            body = chat(k, f"Client {w} asks question {n}.", 8)
            response = await http.post(f"{routing_url}/v1/chat/completions", json=body)
            results.append((k, response.status_code))
            n += 1

    async def run() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        async with httpx.AsyncClient(timeout=180) as http:
            tasks = [asyncio.create_task(client_loop(http, w, stop)) for w in range(4)]
            await asyncio.sleep(3)
            await loop.run_in_executor(None, _deploy, 1)
            await loop.run_in_executor(None, _wait_for_engines, 1, 300)
            sent_at_scale = len(results)
            while len(results) < sent_at_scale + 8:  # Some traffic on the one left.
                await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks)

    asyncio.run(run())
    statuses = [status for _, status in results]
    assert statuses == [200] * len(results), statuses
    for k in (1, 2):  # Both prompts are cached on the replica left.
        with httpx.Client(timeout=120) as http:
            response = http.post(f"{routing_url}/v1/chat/completions", json=chat(k, "Thanks!"))
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
