"""Config validation: bounds, clear errors, derived placement and environment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from serve_app.config import AppConfig, EngineConfig, ReplicaConfig
from serve_app.engine.engine_args import engine_args, resolved_dtype
from serve_app.models.cpu_features import host_cpu_flags
from serve_app.preprocess.preprocessor import derive_max_model_len


def test_defaults_are_valid() -> None:
    config = AppConfig()
    assert config.model.name == "smollm2-135m-instruct"
    assert config.preprocessor.aggregation_window_s == 0.01
    assert config.preprocessor.aggregation_max_requests == 32
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
        ("engine", {"stall_timeout_s": 0}, "greater than 0"),
    ],
)
def test_bad_fields_fail_with_the_field_named(
    section: str, patch: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate({section: patch})
    assert fragment in str(info.value)
    assert section in str(info.value)


def test_aggregation_window_keeps_its_old_field_names() -> None:
    old = AppConfig.model_validate(
        {"preprocessor": {"batch_wait_timeout_s": 0.05, "max_batch_size": 8}}
    )
    assert old.preprocessor.aggregation_window_s == 0.05
    assert old.preprocessor.aggregation_max_requests == 8
    # What build_app sends to every replica validates again under the new names.
    again = AppConfig.model_validate(old.model_dump(mode="json"))
    assert again.preprocessor == old.preprocessor
    with pytest.raises(ValidationError, match="Extra inputs"):  # Both names: one too many.
        AppConfig.model_validate(
            {"preprocessor": {"aggregation_window_s": 0.05, "batch_wait_timeout_s": 0.05}}
        )


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


class _HFConfig:
    max_position_embeddings = 32768


def test_max_model_len_beyond_the_model_names_the_fix() -> None:
    config = AppConfig.model_validate({"model": {"max_model_len": 131072}})
    with pytest.raises(ValueError, match="rope_scaling"):
        derive_max_model_len(config, _HFConfig())
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
    assert derive_max_model_len(scaled, _HFConfig()) == 131072
    assert derive_max_model_len(AppConfig(), _HFConfig()) == 32768


def test_build_app_names_the_fix_for_a_too_long_context() -> None:
    from serve_app.app import check_model

    with pytest.raises(ValueError, match=r"exceeds the model.s 4096; lower it or set"):
        check_model(
            AppConfig.model_validate({"model": {"name": "tiny-qwen2", "max_model_len": 8192}})
        )
    with pytest.raises(ValueError, match=r"model.name: .*smollm2-135m-instruct"):
        check_model(AppConfig.model_validate({"model": {"name": "no-such-alias"}}))


def test_checkpoint_config_reads_json_and_falls_back_to_autoconfig(tmp_path: Path) -> None:
    """The build-time check reads config.json itself (no transformers import in the driver);
    a config without a context length gets AutoConfig's class default, as before."""
    from serve_app.models import checkpoint_config

    plain, bare = tmp_path / "plain", tmp_path / "bare"
    for folder, extra in ((plain, {"max_position_embeddings": 1024}), (bare, {})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"} | extra))
    assert checkpoint_config(str(plain)).max_position_embeddings == 1024
    assert type(checkpoint_config(str(plain))).__name__ == "SimpleNamespace"
    assert checkpoint_config(str(bare)).max_position_embeddings == 2048  # LlamaConfig's default


@pytest.mark.parametrize(
    ("dtype", "device", "flags", "expected"),
    [
        ("auto", "cpu", {"avx2", "fma"}, "float32"),  # AVX2 only: emulated bf16 is slow.
        ("auto", "cpu", {"avx2", "avx512f", "avx512_bf16"}, "auto"),
        ("auto", "cpu", {"avx2", "amx_bf16", "amx_tile"}, "auto"),
        ("auto", "cpu", {"asimd", "bf16"}, "auto"),  # Arm.
        ("auto", "cpu", set(), "auto"),  # Flags unknown: vLLM decides.
        ("bfloat16", "cpu", {"avx2"}, "bfloat16"),  # An explicit choice stands.
        ("auto", "gpu", {"avx2"}, "auto"),
    ],
)
def test_auto_dtype_on_a_cpu_follows_its_bf16_support(
    dtype: str, device: str, flags: set[str], expected: str
) -> None:
    assert resolved_dtype(dtype, device, flags) == expected


def test_engine_args_resolve_auto_dtype_for_this_host() -> None:
    config = AppConfig.model_validate({"engine": {"device": "cpu"}})
    assert engine_args(config, "/m")["dtype"] == resolved_dtype("auto", "cpu", host_cpu_flags())
    assert host_cpu_flags()  # Linux CI: /proc/cpuinfo names the flags.
