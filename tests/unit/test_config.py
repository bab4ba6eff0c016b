"""Config validation: bounds, clear errors, derived placement and environment."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from serve_app.config import AppConfig, EngineConfig, ReplicaConfig


def test_the_aggregation_window_keeps_its_old_names() -> None:
    old = AppConfig.model_validate(
        {"preprocessor": {"batch_wait_timeout_s": 0.02, "max_batch_size": 8}}
    )
    new = AppConfig.model_validate(
        {"preprocessor": {"aggregation_window_s": 0.02, "aggregation_max_requests": 8}}
    )
    assert old.preprocessor == new.preprocessor
    assert new.preprocessor.aggregation_window_s == 0.02


def test_defaults_are_valid() -> None:
    config = AppConfig()
    assert config.model.name == "smollm2-135m-instruct"
    assert config.preprocessor.aggregation_window_s == 0.01
    assert config.engine.enable_prefix_caching


@pytest.mark.parametrize(
    ("section", "patch", "fragment"),
    [
        ("engine", {"block_size": 24}, "power of two"),
        ("engine", {"tensor_parallel_size": 0}, "greater than or equal to 1"),
        ("engine", {"no_such_field": 1}, "Extra inputs"),
        ("preprocessor", {"aggregation_window_s": 5}, "less than or equal to 1"),
        ("preprocessor", {"batch_wait_timeout_s": 5}, "less than or equal to 1"),
        ("router", {"min_replicas": 3, "max_replicas": 2}, "exceeds max_replicas"),
        ("model", {"max_model_len": 4}, "greater than or equal to 16"),
        ("engine", {"cpu_threads_bind": "cores 0-3"}, "not a core list"),
    ],
)
def test_bad_fields_fail_with_the_field_named(
    section: str, patch: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate({section: patch})
    assert fragment in str(info.value)
    assert section in str(info.value)


def test_gpu_placement_is_derived_from_parallel_sizes() -> None:
    engine = EngineConfig(device="gpu", tensor_parallel_size=4)
    bundles, strategy = engine.placement() or ([], "")
    assert strategy == "STRICT_PACK"
    assert sum(b.get("GPU", 0) for b in bundles) == 4 and len(bundles) == 4
    pipeline = EngineConfig(device="gpu", tensor_parallel_size=2, pipeline_parallel_size=2)
    bundles, strategy = pipeline.placement() or ([], "")
    assert strategy == "PACK" and len(bundles) == 4


def test_cpu_engine_has_no_placement_group_but_kv_env() -> None:
    engine = EngineConfig(device="cpu", kv_cache_space_gib=3, env={"EXTRA": "1"})
    assert engine.placement() is None
    env = engine.runtime_env_vars()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["EXTRA"] == "1"


def test_autoscaling_options() -> None:
    options = ReplicaConfig(
        num_replicas="auto", min_replicas=1, max_replicas=3
    ).deployment_options()
    assert options["autoscaling_config"]["max_replicas"] == 3
    assert "num_replicas" not in options


def test_max_model_len_beyond_the_model_names_the_fix() -> None:
    config = AppConfig.model_validate({"model": {"max_model_len": 131072}})
    with pytest.raises(ValueError, match="rope_scaling"):
        config.model.context_window(32768)
    scaled = AppConfig.model_validate(
        {
            "model": {
                "max_model_len": 131072,
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                },
            }
        }
    )
    assert scaled.model.context_window(32768) == 131072
    assert AppConfig().model.context_window(32768) == 32768


def test_build_app_names_the_fix_for_a_too_long_context() -> None:
    from serve_app.app import check_model

    with pytest.raises(ValueError, match=r"exceeds the model.s 4096; lower it or set"):
        check_model(
            AppConfig.model_validate({"model": {"name": "tiny-qwen2", "max_model_len": 8192}})
        )
    with pytest.raises(ValueError, match=r"model.name: .*smollm2-135m-instruct"):
        check_model(AppConfig.model_validate({"model": {"name": "no-such-alias"}}))


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "tiny-qwen2"])
def test_checkpoint_positions_read_as_json_agree_with_autoconfig(name: str) -> None:
    from transformers import AutoConfig

    from serve_app.app import checkpoint_positions
    from serve_app.models import resolve_model

    path = Path(resolve_model(name))
    expected = AutoConfig.from_pretrained(path).max_position_embeddings
    assert checkpoint_positions(path) == expected > 0


@pytest.mark.parametrize(
    ("text", "positions"),
    [
        ('{"n_positions": 1024}', 1024),  # GPT-2's name for it.
        ('{"text_config": {"max_position_embeddings": 8192}}', 8192),  # Multimodal checkpoints.
        ('{"hidden_size": 64}', 0),  # Names none: nothing to check here.
        ("not json", 0),
        ("[1, 2]", 0),  # JSON, but no config object.
    ],
)
def test_checkpoint_positions_aliases_and_unreadable_configs(
    tmp_path: Path, text: str, positions: int
) -> None:
    from serve_app.app import checkpoint_positions

    (tmp_path / "config.json").write_text(text)
    assert checkpoint_positions(tmp_path) == positions
    assert checkpoint_positions(tmp_path / "missing") == 0


def test_cpu_tensor_parallel_uses_vllms_multiprocessing_executor_in_a_placement_group() -> None:
    from serve_app.app import engine_options
    from serve_app.engine.vllm_args import engine_args

    config = AppConfig.model_validate(
        {"engine": {"device": "cpu", "tensor_parallel_size": 2, "cpu_threads_bind": "0|1"}}
    )
    assert engine_args(config, "/m")["distributed_executor_backend"] == "mp"
    options = engine_options(config)
    assert options["placement_group_bundles"] == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"]["num_cpus"] == 0.5
    single = AppConfig.model_validate({"engine": {"device": "cpu"}})
    assert "distributed_executor_backend" not in engine_args(single, "/m")
    assert "placement_group_bundles" not in engine_options(single)
    gpu = AppConfig.model_validate({"engine": {"device": "gpu", "tensor_parallel_size": 2}})
    assert engine_args(gpu, "/m")["distributed_executor_backend"] == "ray"
    assert engine_options(gpu)["ray_actor_options"]["num_cpus"] == 1
    with pytest.raises(ValidationError, match=r"has 1 core list.*for 2 ranks"):
        EngineConfig(device="cpu", tensor_parallel_size=2, cpu_threads_bind="0-1")


def test_auto_binding_gives_every_rank_its_own_cores() -> None:
    from serve_app.engine.cpu_pinning import per_rank

    assert per_rank([0, 1], 2) == "0|1"
    assert per_rank([0, 1, 2, 3, 4], 2) == "0,1,2|3,4"
    assert per_rank([3], 1) == "3"
