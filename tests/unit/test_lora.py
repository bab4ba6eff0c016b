"""LoRA adapters, pure logic: the config block, the engine arguments, the serving core's routing of
an adapter's requests, the adapter builder and the CPU ops mend. The real stack (Ray Serve +
vLLM CPU + SmolLM2 with two adapters) is tests/serve/test_lora.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from serve_app.config import AppConfig
from serve_app.config.model import check_adapter
from serve_app.engine.cpu_lora_fix import applies_base_to_adapter, skipping_no_lora
from serve_app.engine.engine_args import engine_args
from serve_app.hops import (
    EngineChunk,
    EngineRequest,
    EngineStep,
    LoraAdapter,
    PreprocessRequest,
    PreprocessResult,
    SamplingSpec,
    TokenizedPrompt,
)
from serve_app.models.lora_adapter import ALL_TARGETS, build_lora_adapter
from serve_app.openai.serving import OpenAIServing, RequestStats
from serve_app.preprocess.block_hashes import block_hashes


def _config(**model: Any) -> AppConfig:
    return AppConfig.model_validate({"model": {"name": "tiny-qwen2"} | model})


def test_adapters_enable_lora_in_the_engine_and_keep_absolute_paths(tmp_path: Path) -> None:
    config = _config(lora_adapters={"sql": str(tmp_path), "hub": "org/adapter"})
    assert config.model.lora_adapters == {"sql": str(tmp_path), "hub": "org/adapter"}
    assert engine_args(config, "/m")["enable_lora"] is True
    assert "enable_lora" not in engine_args(_config(), "/m")
    # Replicas get the validated config back and resolve the same paths.
    assert AppConfig.model_validate(config.as_args()) == config


def test_a_relative_adapter_path_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    config = _config(lora_adapters={"sql": "adapters/sql"})
    assert config.model.lora_adapters["sql"] == str(tmp_path / "adapters" / "sql")


@pytest.mark.parametrize(
    ("adapters", "fragment"),
    [
        ({"has space": "/a"}, "adapter name 'has space'"),
        ({"tiny-qwen2": "/a"}, "the model's own served name"),
        ({"sql": " "}, "give a local directory or a hub id"),
    ],
)
def test_bad_adapters_fail_with_the_fix(adapters: dict[str, str], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        _config(lora_adapters=adapters)


def test_enable_lora_is_derived_not_passed_through() -> None:
    with pytest.raises(ValidationError, match=r"set model\.lora_adapters"):
        AppConfig.model_validate({"engine": {"vllm_args": {"enable_lora": True}}})


def test_the_builder_writes_a_peft_adapter_a_build_accepts(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 2,
            }
        )
    )
    out = build_lora_adapter(base, tmp_path / "adapter", seed=3, rank=4)
    check_adapter("a", str(out))
    from safetensors.numpy import load_file

    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 2 * 2  # layers x projections x (A, B)
    assert tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (
        32,
        4,
    )
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    again = build_lora_adapter(base, tmp_path / "again", seed=3, rank=4)
    assert (again / "adapter_model.safetensors").read_bytes() == (
        out / "adapter_model.safetensors"
    ).read_bytes()
    # Every linear layer, as most fine-tunes (and the LoRA cost benchmark's adapters).
    config = json.loads((base / "config.json").read_text()) | {"intermediate_size": 96}
    (base / "config.json").write_text(json.dumps(config))
    full = build_lora_adapter(base, tmp_path / "full", seed=3, rank=4, targets=ALL_TARGETS)
    tensors = load_file(str(full / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * 2
    assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 96)
    assert json.loads((full / "adapter_config.json").read_text())["target_modules"] == list(
        ALL_TARGETS
    )


def test_a_directory_without_adapter_config_fails_the_check(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"has no adapter_config\.json"):
        check_adapter("x", str(tmp_path))
    with pytest.raises(ValueError, match="is not a directory"):
        check_adapter("x", str(tmp_path / "missing"))
    check_adapter("x", "org/adapter")  # A hub id: fetched by vLLM.


async def test_an_adapter_serving_sends_its_adapter_to_both_hops() -> None:
    seen: dict[str, Any] = {}

    async def preprocess(request: PreprocessRequest) -> PreprocessResult:
        seen["adapter"] = request.adapter
        return PreprocessResult([TokenizedPrompt([1, 2])], request.sampling.with_max_tokens(1))

    async def generate(request: EngineRequest) -> AsyncIterator[EngineStep]:
        seen["lora"] = request.lora
        yield EngineStep([EngineChunk(0, "x", [5], "stop")], prompt_tokens=2, finished=True)

    config = _config(lora_adapters={"sql": "/adapters/sql"})
    base = OpenAIServing(config, preprocess, generate)
    sql = base.for_adapter(LoraAdapter("sql", "/adapters/sql"))
    assert sql.model_name == "sql"
    card = sql.models(2048).data[0]
    assert (card.id, card.parent, card.root) == ("sql", "tiny-qwen2", "/adapters/sql")
    assert base.models().data[0].parent is None
    request = PreprocessRequest("r", "chat", SamplingSpec(), messages=[])
    prepared = await sql.prepare(request, 0, RequestStats("/v1/chat/completions", "sql"))
    _ = [step async for step in sql.steps(prepared)]
    assert seen == {"adapter": "sql", "lora": LoraAdapter("sql", "/adapters/sql")}


def test_prefix_hashes_of_an_adapter_are_its_own() -> None:
    tokens = list(range(64))
    plain, sql = block_hashes(tokens, 32), block_hashes(tokens, 32, salt=b"sql")
    assert len(plain) == len(sql) == 2 and not set(plain) & set(sql)


def _gathering_shrink(inputs: Any, weights: Any, output: Any, indices: Any, scaling: float) -> None:
    """vLLM 0.32's CPU op: index -1 gathers the last adapter slot."""
    import torch

    selected = weights[indices].squeeze(dim=1)
    output[:, : selected.shape[1]] = scaling * torch.einsum("bi, boi -> bo", inputs, selected)


def test_tokens_without_an_adapter_keep_their_output() -> None:
    torch = pytest.importorskip("torch")
    assert applies_base_to_adapter(_gathering_shrink)
    fixed = skipping_no_lora(_gathering_shrink)
    assert not applies_base_to_adapter(fixed)
    weights = torch.ones(2, 1, 3, 2)  # Two adapter slots.
    output = torch.full((3, 3), 7.0)
    fixed(torch.ones(3, 2), weights, output, torch.tensor([0, -1, 1]), 1.0)
    assert output.tolist() == [[2.0] * 3, [7.0] * 3, [2.0] * 3]


def test_the_installed_vllm_ops_are_mended_on_cpu() -> None:
    pytest.importorskip("vllm")
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the GPU kernels skip index -1 themselves")
    from serve_app.engine.cpu_lora_fix import register

    register()
    assert not applies_base_to_adapter(lora_ops.bgmv_shrink)
    from vllm.lora.punica_wrapper import punica_cpu

    # The wrapper calls the ops it imported by name: those are the mended ones too.
    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        assert getattr(punica_cpu, name) is getattr(lora_ops, name)


def test_the_router_serves_each_adapter_by_name() -> None:
    from types import SimpleNamespace

    from serve_app.ingress.backends import ModelBackend, ModelBackends

    def handle(name: str) -> Any:
        stand_in = SimpleNamespace(deployment_name=name)
        stand_in.options = lambda **_: stand_in
        return stand_in

    config = _config(lora_adapters={"sql": "/adapters/sql", "poet": "/adapters/poet"})
    backend = ModelBackend(
        config, handle("Preprocessor"), handle("Engine"), app_name="a", on_resubmit=print
    )
    backends = ModelBackends([backend])
    assert list(backend.servings) == ["tiny-qwen2", "sql", "poet"]
    # Chat, completions, tokenize and Batch API lines all look a name up here.
    assert backends.serving("poet").lora == LoraAdapter("poet", "/adapters/poet")
    assert backends.serving("tiny-qwen2").lora is None
    assert backends.get("sql") is backend
