"""The multi-worker engine path on CPU: tensor_parallel_size 2 through the whole graph.

vLLM's CPU build refuses the Ray executor the GPU config uses ("current platform cpu does not
support ray": ``CpuPlatform.ray_device_key`` is empty), so a CPU engine with several ranks runs
vLLM's multiprocessing executor: one worker process per rank, each bound to its own core, inside
the engine replica's STRICT_PACK placement group (one CPU bundle per rank). The embedded
tiny-qwen2 (random weights) is served over HTTP with the openai client; the placement group,
the executor and the rank processes are read back from Ray, vLLM and the OS. Slow (~2-3 min:
the engine starts two worker processes on 2 cores).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from openai import OpenAI

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

APP = "tp2"
ARGS: dict[str, Any] = {
    "model": {"name": "tiny-qwen2", "max_model_len": 512},
    "engine": {
        "device": "cpu",
        "tensor_parallel_size": 2,
        "cpu_threads_bind": "0|1",  # One core per rank.
        "kv_cache_space_gib": 1,
        "enforce_eager": True,
        "max_num_seqs": 16,
        "num_cpus": 0.5,
        "health_check_timeout_s": 120,
    },
    "router": {"num_cpus": 0.05},
    "preprocessor": {"num_cpus": 0.05},
}


@pytest.fixture(scope="module")
def tp2_url() -> Iterator[str]:
    import ray
    from ray import serve

    from serve_app import build_app

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(ARGS), name=APP, route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # Ready = a RUNNING engine replica (readiness probe).
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(2)
    else:
        pytest.fail(f"the TP=2 engine was not ready after 600 s: {serve.status()}")
    yield url
    serve.delete(APP)
    serve.shutdown()
    ray.shutdown()


def test_tp2_on_cpu_serves_through_the_graph(tp2_url: str) -> None:
    client = OpenAI(base_url=f"{tp2_url}/v1", api_key="unused", max_retries=0, timeout=300)
    chat = client.chat.completions.create(
        model="tiny-qwen2",
        messages=[{"role": "user", "content": "Hello there."}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.content
    stream = client.completions.create(
        model="tiny-qwen2", prompt="Once upon a time", max_tokens=6, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
    )  # fmt: skip
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage and usage[0].completion_tokens == 6


def test_tp2_runs_one_bound_worker_per_rank_in_its_placement_group(tp2_url: str) -> None:
    from ray import serve
    from ray._private.state import actors
    from ray.util import placement_group_table

    args = serve.get_deployment_handle("Engine", app_name=APP).engine_args.remote().result()
    assert (args["tensor_parallel_size"], args["distributed_executor_backend"]) == (2, "mp")
    groups = [pg for pg in placement_group_table().values() if pg["state"] == "CREATED"]
    assert len(groups) == 1, groups
    bundles = [groups[0]["bundles"][i] for i in sorted(groups[0]["bundles"])]
    assert (bundles, groups[0]["strategy"]) == ([{"CPU": 0.5}, {"CPU": 0.5}], "STRICT_PACK")
    (replica,) = [
        int(a["Pid"])
        for a in actors().values()
        if a["State"] == "ALIVE" and str(a["Name"]).startswith(f"SERVE_REPLICA::{APP}#Engine#")
    ]
    workers = {
        p.name(): sorted(p.cpu_affinity())
        for p in psutil.Process(replica).children(recursive=True)
        if "Worker_TP" in p.name()
    }
    assert workers == {"VLLM::Worker_TP0": [0], "VLLM::Worker_TP1": [1]}, workers
