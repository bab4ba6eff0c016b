"""Several models in one app: the config's `models` list, the graph build_app wires from it, and
the router's dispatch on `model` (with stand-in handles: pure logic; the real stack is in
tests/serve/test_qwen2.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from serve_app.config import AppConfig
from serve_app.errors import APIError
from serve_app.ingress.backends import ModelBackend, ModelBackends
from serve_app.offline.__main__ import app_config

TWO: dict[str, Any] = {
    "engine": {"kv_cache_space_gib": 1, "num_cpus": 0.2, "max_num_seqs": 8},
    "preprocessor": {"num_cpus": 0.05},
    "models": [
        {"model": {"name": "smollm2-135m-instruct"}},
        {
            "model": {"name": "tiny-qwen2", "served_model_name": "qwen"},
            "engine": {"tensor_parallel_size": 2, "max_num_seqs": 4},
        },
    ],
}


def test_each_model_inherits_the_app_blocks_and_overrides_them_key_by_key() -> None:
    config = AppConfig.model_validate(TWO)
    smol, qwen = config.per_model()
    assert config.served_names == ["smollm2-135m-instruct", "qwen"]
    assert (smol.engine.max_num_seqs, qwen.engine.max_num_seqs) == (8, 4)
    assert (smol.engine.tensor_parallel_size, qwen.engine.tensor_parallel_size) == (1, 2)
    assert smol.engine.kv_cache_space_gib == qwen.engine.kv_cache_space_gib == 1
    assert smol.preprocessor.num_cpus == qwen.preprocessor.num_cpus == 0.05
    assert qwen.model.name == "tiny-qwen2" and not qwen.models
    # What replicas are given validates back to the same config.
    assert AppConfig.model_validate(config.as_args()) == config
    assert AppConfig.model_validate(qwen.as_args()) == qwen


def test_one_model_configs_are_unchanged() -> None:
    config = AppConfig.model_validate({"model": {"name": "tiny-qwen2"}})
    assert config.per_model() == [config]
    assert config.served_names == ["tiny-qwen2"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"model": {"name": "tiny-qwen2"}} | TWO, "not both"),
        (
            {"models": [{"model": {"name": "a/b"}}, {"model": {"name": "a-b"}}]},
            "set a distinct model.served_model_name",
        ),
        ({"models": [{"model": {"name": "x"}, "engine": {"max_num_seq": 2}}]}, "max_num_seq"),
        ({"models": [{"engine": {}}]}, "models.0.model"),
    ],
)
def test_bad_model_lists_fail_with_the_fix(args: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        AppConfig.model_validate(args)


def test_build_app_wires_one_preprocessor_and_engine_per_model() -> None:
    from serve_app import build_app

    app = build_app(TWO)
    router = app._bound_deployment
    backends, coordinator, _ = router.init_args
    # The batch coordinator calls the same deployments as the router.
    assert coordinator._bound_deployment.name == "BatchCoordinator"
    assert coordinator._bound_deployment.init_args[0] is backends
    names = {
        model: (pair["preprocessor"]._bound_deployment.name, pair["engine"]._bound_deployment.name)
        for model, pair in backends.items()
    }
    assert names == {
        "smollm2-135m-instruct": (
            "Preprocessor-smollm2-135m-instruct",
            "Engine-smollm2-135m-instruct",
        ),
        "qwen": ("Preprocessor-qwen", "Engine-qwen"),
    }
    one = build_app({"model": {"name": "tiny-qwen2"}})._bound_deployment.init_args[0]
    assert one["tiny-qwen2"]["engine"]._bound_deployment.name == "Engine"


def _handle(name: str) -> Any:
    handle = SimpleNamespace(deployment_name=name)
    handle.options = lambda **_: handle
    return handle


def test_the_router_dispatches_on_model_and_names_the_served_ones() -> None:
    config = AppConfig.model_validate(TWO)
    backends = ModelBackends(
        [
            ModelBackend(
                single,
                _handle(f"Preprocessor-{i}"),
                _handle(f"Engine-{i}"),
                app_name="app",
                on_resubmit=lambda model: None,
            )
            for i, single in enumerate(config.per_model())
        ]
    )
    assert backends.serving("qwen").model_name == "qwen"
    assert backends.get("qwen").config.engine.tensor_parallel_size == 2
    with pytest.raises(APIError) as caught:
        backends.serving("gpt-4")
    assert caught.value.info.status == 404
    assert caught.value.info.code == "model_not_found"
    assert "smollm2-135m-instruct, qwen" in caught.value.info.message


def test_the_offline_job_runs_one_named_model_of_a_multi_model_config(tmp_path: Any) -> None:
    import yaml

    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"applications": [{"name": "llm", "args": TWO}]}))
    assert app_config(str(path), "qwen").model.name == "tiny-qwen2"
    with pytest.raises(ValueError, match="serves several models"):
        app_config(str(path))
    with pytest.raises(ValueError, match="smollm2-135m-instruct, qwen"):
        app_config(str(path), "gpt-4")
    assert app_config(None, "tiny-qwen2").model.name == "tiny-qwen2"


def test_the_two_model_production_example_validates() -> None:
    from pathlib import Path

    from serve_app.launch import load_serve_config

    path = Path(__file__).resolve().parents[2] / "serve_config.two_models.yaml"
    args = load_serve_config(path)["applications"][0]["args"]
    chat, coder = AppConfig.model_validate(args).per_model()
    assert (chat.model.public_name, coder.model.public_name) == (
        "Qwen/Qwen2.5-7B-Instruct",
        "qwen2.5-coder",
    )
    assert chat.engine.placement() == coder.engine.placement()
    assert set(chat.model.lora_adapters) == {"sql-helper", "support-tone"}
    assert chat.engine.vllm_args["max_loras"] == 2 and not coder.model.lora_adapters
    assert (chat.engine.max_replicas, coder.engine.max_replicas) == (2, 1)


def test_the_awq_production_example_validates() -> None:
    """One GPU per replica, INT4 weights through vllm_args (checked against the installed
    vLLM's EngineArgs), autoscaling 1..8."""
    from pathlib import Path

    from serve_app.engine.engine_args import engine_args
    from serve_app.launch import load_serve_config

    path = Path(__file__).resolve().parents[2] / "serve_config.awq.yaml"
    config = AppConfig.model_validate(load_serve_config(path)["applications"][0]["args"])
    assert config.model.name == "Qwen/Qwen2.5-7B-Instruct-AWQ"
    assert config.engine.world_size == 1
    assert config.engine.placement()[0] == [{"CPU": 1, "GPU": 1}]
    args = engine_args(config, "/models/qwen2.5-7b-instruct-awq")
    assert (args["quantization"], args["dtype"]) == ("awq_marlin", "float16")
    assert (config.engine.min_replicas, config.engine.max_replicas) == (1, 8)
