"""engine.vllm_args: passthrough to vLLM, misspelt names, collisions with what we derive."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from serve_app.config import AppConfig
from serve_app.config.vllm_args import DERIVED, FIXED, engine_arg_names
from serve_app.engine.engine_args import engine_args, resolved_values

needs_vllm = pytest.mark.skipif(engine_arg_names() is None, reason="vLLM is not installed")


def _config(**vllm_args: Any) -> AppConfig:
    return AppConfig.model_validate({"engine": {"vllm_args": vllm_args}})


def _error(**vllm_args: Any) -> str:
    with pytest.raises(ValidationError) as info:
        _config(**vllm_args)
    return str(info.value)


def test_passthrough_reaches_the_engine_args() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    config = _config(max_logprobs=25, kv_cache_dtype="fp8", speculative_config=spec)
    args = engine_args(config, "/m")
    assert args["max_logprobs"] == 25
    assert args["kv_cache_dtype"] == "fp8"
    assert args["speculative_config"] == spec
    args["speculative_config"]["method"] = "eagle"  # vLLM fills in what it is given.
    assert config.engine.vllm_args["speculative_config"]["method"] == "ngram"


def test_empty_default_changes_nothing() -> None:
    assert AppConfig().engine.vllm_args == {}
    assert engine_args(AppConfig(), "/m") == engine_args(_config(), "/m")
    assert set(engine_args(AppConfig(), "/m")) <= DERIVED.keys() | FIXED.keys()


@needs_vllm
def test_a_misspelt_name_fails_with_the_closest_one() -> None:
    message = _error(kv_cache_dtyp="fp8")
    assert "engine.vllm_args" in message
    assert "unknown vLLM engine argument 'kv_cache_dtyp'; did you mean 'kv_cache_dtype'?" in message
    assert "did you mean 'quantization'" in _error(quantisation="awq")
    assert "set engine.max_num_seqs" in _error(max_num_seq=4)  # Closest is one of ours.
    assert "vllm serve --help" in _error(zzzz=1)


def test_a_derived_name_is_an_error_naming_our_field() -> None:
    message = _error(tensor_parallel_size=2)
    assert "set engine.tensor_parallel_size, not engine.vllm_args.tensor_parallel_size" in message
    assert "set model.max_model_len" in _error(max_model_len=1024)
    assert "scheduling_policy is set by serve_app" in _error(scheduling_policy="fcfs")


def _every_key(config: AppConfig) -> set[str]:
    return set(engine_args(config, "/m"))


def test_every_emitted_name_is_listed_and_real() -> None:
    """DERIVED and FIXED cannot drift from engine_args: every name it emits (every branch on)
    is listed, every listed name is a vLLM EngineArgs field and every DERIVED target a field."""
    config = AppConfig.model_validate(
        {
            "model": {
                "max_model_len": 4096,
                "rope_scaling": {"rope_type": "yarn", "factor": 4},
                "lora_adapters": {"sql": "/adapters/sql"},
            },
            "engine": {
                "device": "gpu",
                "tensor_parallel_size": 2,
                "block_size": 16,
                "max_num_batched_tokens": 2048,
            },
        }
    )
    emitted = _every_key(config) | _every_key(AppConfig())
    listed = DERIVED.keys() | FIXED.keys()
    assert emitted - listed == set()
    # Listed but never emitted: only names fixed by their absence (the tokenizer stays ours).
    assert listed - emitted == {"tokenizer", "skip_tokenizer_init"}
    known = engine_arg_names()
    if known is not None:
        assert listed <= known
    for targets in DERIVED.values():
        for target in targets.split(" and "):
            section, field = target.split(".")
            model: type[BaseModel] = AppConfig.model_fields[section].annotation  # type: ignore[assignment]
            assert field in model.model_fields, target


def test_source_read_names_match_the_dataclass() -> None:
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    fields = {field.name for field in dataclasses.fields(arg_utils.EngineArgs)}
    assert engine_arg_names() == fields
    # The offline path builds vLLM's EngineArgs from engine_args output, passthrough included.
    from serve_app.engine.engine_args import vllm_engine_args

    args = vllm_engine_args(engine_args(_config(max_logprobs=25), "/m"), arg_utils.EngineArgs)
    assert args.max_logprobs == 25


def test_resolved_values_read_the_engine_config() -> None:
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_logprobs=25, dtype=SimpleNamespace()),
        cache_config=SimpleNamespace(cache_dtype="fp8", block_size=32),
        scheduler_config=SimpleNamespace(max_num_seqs=128),
        speculative_config=None,
    )
    names = ["max_logprobs", "kv_cache_dtype", "block_size", "max_num_seqs", "speculative_config"]
    assert resolved_values(vllm_config, [*names, "nowhere"]) == {
        "max_logprobs": 25,
        "kv_cache_dtype": "fp8",
        "block_size": 32,
        "max_num_seqs": 128,
        "speculative_config": None,
    }
    assert isinstance(resolved_values(vllm_config, ["dtype"])["dtype"], str)
