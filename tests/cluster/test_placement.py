"""Placement: the production config's engine placement group, on logical GPUs only.

A local Ray cluster advertises 4 logical GPUs (none exist). The Engine deployment's options,
exactly as ``serve_app.app.engine_options`` produces them for ``serve_config.yaml`` (TP=4),
are deployed on a stand-in class (no vLLM, no GPU), and the placement group Serve reserves is
read back from Ray. A config the cluster cannot place (TP=8 on 4 GPUs) fails at build time.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from serve_app.config import AppConfig
from serve_app.launch import load_serve_config

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def _production(**engine: Any) -> AppConfig:
    args = load_serve_config(ROOT / "serve_config.yaml")["applications"][0]["args"]
    args["engine"] |= engine
    return AppConfig.model_validate(args)


@pytest.fixture(scope="module")
def gpu_cluster() -> Iterator[None]:
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False)
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield
    finally:  # Also when start-up or a test failed.
        serve.shutdown()
        ray.shutdown()


def test_engine_placement_group_matches_config(gpu_cluster: None) -> None:
    from ray import serve
    from ray.util import placement_group_table

    from serve_app.app import engine_options

    config = _production(num_replicas=1)  # One stand-in replica: no queue depth to scale on.
    assert config.engine.tensor_parallel_size == 4
    options = engine_options(config)
    assert options["placement_group_bundles"] == [{"CPU": 1, "GPU": 1}] + [{"GPU": 1}] * 3
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"]["num_gpus"] == 0

    @serve.deployment(name="Engine")
    class StandIn:
        def __call__(self) -> str:
            return "ok"

    serve.run(StandIn.options(**options).bind(), name="placement", route_prefix=None)
    try:
        deadline = time.monotonic() + 120
        created: list[dict[str, Any]] = []
        while not created and time.monotonic() < deadline:
            created = [pg for pg in placement_group_table().values() if pg["state"] == "CREATED"]
            time.sleep(0.5)
        assert len(created) == 1, created
        group = created[0]
        bundles = [group["bundles"][i] for i in sorted(group["bundles"])]
        assert bundles == [{"CPU": 1.0, "GPU": 1.0}] + [{"GPU": 1.0}] * 3
        assert group["strategy"] == "STRICT_PACK"
    finally:
        serve.delete("placement")


def test_unplaceable_config_fails_at_build(gpu_cluster: None) -> None:
    from serve_app import build_app

    with pytest.raises(ValueError, match=r"needs 8 GPUs on one node.*has 4"):
        build_app(_production(tensor_parallel_size=8))
    with pytest.raises(ValueError, match=r"needs 8 GPUs on the cluster"):
        build_app(_production(tensor_parallel_size=4, pipeline_parallel_size=2))
