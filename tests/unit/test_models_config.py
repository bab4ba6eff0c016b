"""Several models, LoRA settings and engine.vllm_args in the config (no Ray, no engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from serve_app import build_app
from serve_app.app import check_models
from serve_app.config import AppConfig
from serve_app.config.models import CPU_LORA_EXTENSION
from serve_app.engine.vllm_args import (
    check_vllm_arg_names,
    engine_args,
    resolved_dtype,
)
from serve_app.models.cpu_features import host_cpu_flags

ROOT = Path(__file__).resolve().parents[2]
TWO = {
    "models": [
        {"model": {"name": "smollm2-135m-instruct"}, "engine": {"device": "cpu"}},
        {"model": {"name": "tiny-qwen2"}, "engine": {"device": "cpu", "max_num_seqs": 8}},
    ]
}


def test_the_single_model_keys_are_a_one_item_models_list() -> None:
    config = AppConfig.model_validate(
        {"model": {"name": "tiny-qwen2"}, "engine": {"max_num_seqs": 8}, "lora": {"max_loras": 2}}
    )
    assert len(config.models) == 1
    assert (config.model.name, config.engine.max_num_seqs) == ("tiny-qwen2", 8)
    assert config.lora.max_loras == 2 and not config.lora.active
    dumped = config.model_dump(mode="json")
    assert set(dumped) >= {"models", "router"} and "engine" not in dumped
    assert AppConfig.model_validate(dumped) == config  # What replicas re-validate.
    assert AppConfig() == AppConfig.model_validate({"model": {}})


def test_models_and_the_single_model_keys_do_not_mix() -> None:
    with pytest.raises(ValidationError, match="both `models` and top-level engine"):
        AppConfig.model_validate(TWO | {"engine": {"max_num_seqs": 4}})


def test_each_model_gets_its_own_view_and_deployment_names() -> None:
    config = AppConfig.model_validate(TWO)
    views = [config.for_model(i) for i in range(2)]
    assert [v.model.name for v in views] == ["smollm2-135m-instruct", "tiny-qwen2"]
    assert views[1].engine.max_num_seqs == 8 and len(views[1].models) == 1
    names = [b.deployment_names(first=i == 0) for i, b in enumerate(config.models)]
    assert names == [("Preprocessor", "Engine"), ("Preprocessor-tiny-qwen2", "Engine-tiny-qwen2")]
    # Every deployment drains at least request_timeout_s, in every model.
    assert all(v.engine.graceful_shutdown_timeout_s == 610 for v in views)


@pytest.mark.parametrize(
    ("models", "fragment"),
    [
        ([{"model": {"name": "a/b"}}, {"model": {"name": "a/b"}}], "unique across models"),
        (
            [
                {"model": {"name": "a/b"}, "lora": {"adapters": {"x": "/x"}}},
                {"model": {"name": "c/d"}, "lora": {"adapters": {"x": "/y"}}},
            ],
            "['x'] appear twice",
        ),
        ([{"model": {"name": "a/b"}, "lora": {"adapters": {"a/b": "/x"}}}], "appear twice"),
        (
            [
                {"model": {"name": "a/b"}},
                {"model": {"name": "c/x"}, "id": "s"},
                {"model": {"name": "d/y"}, "id": "s"},
            ],
            "same deployment id",
        ),
        ([{"model": {"name": "a/b"}, "id": "Bad Id"}], "id 'Bad Id'"),
    ],
)
def test_names_clients_and_serve_see_are_unique(models: list[Any], fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate({"models": models})
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("lora", "fragment"),
    [
        ({"adapters": {"x": "./adapters/x"}}, "absolute directory"),
        ({"adapters": {"x": "a/b/c"}}, "absolute directory"),
        ({"adapters": {"has space": "/x"}}, "without spaces"),
        ({"max_lora_rank": 12}, "max_lora_rank 12"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "below max_loras 4"),
        ({"enabled": False, "runtime_loading": True}, "lora.enabled is false"),
    ],
)
def test_lora_settings_are_checked(lora: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate({"lora": lora})
    assert fragment in str(info.value)


def test_lora_and_vllm_args_become_engine_arguments() -> None:
    config = AppConfig.model_validate(
        {
            "engine": {"device": "cpu", "vllm_args": {"kv-cache-dtype": "fp8", "max_logprobs": 3}},
            "lora": {"adapters": {"a": "org/adapter"}, "max_loras": 2, "max_lora_rank": 8},
        }
    )
    args = engine_args(config, "/m")
    assert args["kv_cache_dtype"] == "fp8" and args["max_logprobs"] == 3
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"]) == (True, 2, 8)
    assert "max_cpu_loras" not in args  # Unset: vLLM's default (max_loras).
    assert args["worker_extension_cls"] == CPU_LORA_EXTENSION  # The CPU LoRA fix.
    plain = engine_args(AppConfig.model_validate({"engine": {"device": "gpu"}}), "/m")
    assert "enable_lora" not in plain and "worker_extension_cls" not in plain


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


@pytest.mark.parametrize(
    ("engine", "fragment"),
    [
        ({"vllm_args": {"tensor_parallel_size": 2}}, "set engine.tensor_parallel_size instead"),
        ({"vllm_args": {"max-model-len": 4096}}, "set model.max_model_len instead"),
        ({"vllm_args": {"enable_lora": True}}, "set lora.enabled"),
        ({"vllm_args": {"scheduling_policy": "fcfs"}}, "priority scheduling"),
        ({"vllm_args": {"disable_log_stats": True}}, "watchdog"),
        ({"vllm_args": {"max-logprobs": 2, "max_logprobs": 3}}, "given twice"),
    ],
)
def test_vllm_args_the_app_derives_are_refused_with_the_field_to_use(
    engine: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate({"engine": engine})
    assert fragment in str(info.value)


def test_vllm_args_that_clash_with_what_a_model_block_derives() -> None:
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(ValidationError, match=r"conflicts with model\.rope_scaling"):
        AppConfig.model_validate(
            {"model": {"rope_scaling": rope}, "engine": {"vllm_args": {"hf_overrides": {}}}}
        )
    AppConfig.model_validate({"engine": {"vllm_args": {"hf_overrides": {"x": 1}}}})
    with pytest.raises(ValidationError, match="LoRA on CPU needs the app's own"):
        AppConfig.model_validate(
            {
                "engine": {"device": "cpu", "vllm_args": {"worker_extension_cls": "m.C"}},
                "lora": {"runtime_loading": True},
            }
        )


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("kv_cache_dtyp", "kv_cache_dtype"),
        ("max_logprob", "max_logprobs"),
        ("speculative_confg", "speculative_config"),
        ("reasoning_parsr", "reasoning_parser"),
    ],
)
def test_a_misspelt_vllm_arg_fails_at_build_naming_the_closest(name: str, suggestion: str) -> None:
    with pytest.raises(ValueError, match=f"did you mean '{suggestion}'"):
        build_app({"engine": {"device": "cpu", "vllm_args": {name: "x"}}})
    with pytest.raises(ValueError, match=rf"models\[1\]\.engine\.vllm_args: '{name}'"):
        check_models(
            AppConfig.model_validate(
                {
                    "models": [
                        TWO["models"][0],
                        {**TWO["models"][1], "engine": {"vllm_args": {name: 1}}},
                    ]
                }
            )
        )
    check_vllm_arg_names({"quantization": "awq", "kv_cache_dtype": "fp8", "max_logprobs": 3})


@pytest.mark.parametrize("path", sorted(ROOT.glob("serve_config*.yaml")), ids=lambda p: p.name)
def test_every_example_config_validates(path: Path) -> None:
    for app in yaml.safe_load(path.read_text())["applications"]:
        config = AppConfig.model_validate(app["args"])
        for block in config.models:
            check_vllm_arg_names(block.engine.vllm_args)
