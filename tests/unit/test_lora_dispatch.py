"""Dispatch on `model`, the shared adapter registry, the load/unload verbs and an engine's
adapter loads, with fakes for the engines (no Ray, no vLLM engine)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from serve_app.config import AppConfig
from serve_app.config.routing import RoutingConfig
from serve_app.engine.lora import EngineAdapters
from serve_app.engine.routing.policy import RoutingPolicy
from serve_app.errors import APIError, ErrorInfo
from serve_app.graph.adapter_registry import AdapterRegistry, AdapterTable, LocalTable
from serve_app.hops import (
    AdapterRef,
    EngineChunk,
    EngineRequest,
    EngineStep,
    PreprocessRequest,
    PreprocessResult,
    TokenizedPrompt,
    adapter_block,
    adapter_hashes,
)
from serve_app.ingress.adapter_routes import AdapterAdmin
from serve_app.openai import chat
from serve_app.openai.dispatch import AdapterEntry, ServedModels
from serve_app.openai.protocol import ChatCompletionRequest
from serve_app.openai.protocol.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from serve_app.openai.serving import OpenAIServing, RequestStats

CONFIG = AppConfig.model_validate(
    {
        "models": [
            {
                "model": {"name": "org/chat"},
                "lora": {"adapters": {"support": "/adapters/support"}, "runtime_loading": True},
            },
            {"model": {"name": "org/coder"}, "lora": {"max_runtime_adapters": 1}},
        ]
    }
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def backend(
    name: str, sent: list[EngineRequest]
) -> tuple[Any, Any]:  # (preprocess, generate) of one fake model
    async def preprocess(request: PreprocessRequest) -> PreprocessResult:
        prompt = TokenizedPrompt([1] * 70, block_hashes=(11,))
        return PreprocessResult(prompts=[prompt], sampling=request.sampling.with_max_tokens(2))

    async def generate(request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
        sent.append(request)
        chunk = EngineChunk(0, name, [1], finish_reason="stop")
        yield EngineStep([chunk], prompt_tokens=70, finished=True)

    return preprocess, generate


def served(registry: AdapterRegistry, sent: list[EngineRequest]) -> ServedModels:
    servings = [
        OpenAIServing(CONFIG.for_model(i), *backend(block.model.name, sent))
        for i, block in enumerate(CONFIG.models)
    ]
    return ServedModels(servings, registry)


def ask(model: str) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    )


async def test_requests_reach_their_model_or_adapter_through_the_primary_serving() -> None:
    sent: list[EngineRequest] = []
    models = served(AdapterRegistry(CONFIG, LocalTable()), sent)
    for name, text in [
        ("org/chat", "org/chat"),
        ("org/coder", "org/coder"),
        ("support", "org/chat"),
    ]:
        response: Any = await chat.chat_completion(
            models.primary, ask(name), RequestStats("c", "x")
        )
        assert response.model == name and response.choices[0].message.content == text
    base, coder, adapter = sent
    assert base.lora is None and coder.lora is None and base.block_hashes == (11,)
    assert adapter.lora == AdapterRef("support", "/adapters/support", 0)
    assert adapter.block_hashes == adapter_hashes(adapter.lora, (11,))
    with pytest.raises(APIError) as info:
        await chat.chat_completion(models.primary, ask("nope"), RequestStats("c", "x"))
    assert info.value.info.status == 404 and info.value.info.code == "model_not_found"
    assert "org/chat, org/coder, support" in info.value.info.message


async def test_models_lists_adapters_with_their_parent() -> None:
    models = served(AdapterRegistry(CONFIG, LocalTable()), [])
    listing = await models.model_list({"org/chat": 4096, "org/coder": 2048})
    cards = {card.id: card.model_dump(exclude_unset=True) for card in listing.data}
    assert list(cards) == ["org/chat", "org/coder", "support"]
    assert cards["support"] | {"created": 0} == {
        "id": "support",
        "object": "model",
        "created": 0,
        "owned_by": "serve_app",
        "root": "/adapters/support",
        "parent": "org/chat",
        "max_model_len": 4096,
    }


def test_adapter_blocks_keep_an_adapters_traffic_on_the_replica_holding_it() -> None:
    policy = RoutingPolicy(RoutingConfig(), seed=0)
    policy.set_replicas(["a", "b", "c"])
    banana, zebra = AdapterRef("banana", "/b", 1), AdapterRef("zebra", "/z", 1)
    first = policy.choose(adapter_hashes(banana, ()), {"a": 0, "b": 0, "c": 0})
    # Short prompts (no prompt block) of the same adapter follow it while within the margin.
    for load in range(3):
        queues = {"a": load, "b": load, "c": load} | {first.replica: load + 2}
        again = policy.choose(adapter_hashes(banana, ()), queues)
        assert (again.replica, again.reason) == (first.replica, "affinity")
    assert adapter_hashes(banana, (5, 6))[0] == adapter_block(banana)
    assert set(adapter_hashes(banana, (5, 6))).isdisjoint(adapter_hashes(zebra, (5, 6)))
    assert adapter_hashes(None, (5, 6)) == (5, 6)
    assert adapter_block(banana) != adapter_block(AdapterRef("banana", "/b", 2))  # A reload.


async def test_the_registry_is_shared_cached_and_reseeded() -> None:
    table, clock = LocalTable(), Clock()
    one = AdapterRegistry(CONFIG, table, clock=clock)
    two = AdapterRegistry(CONFIG, table, clock=clock)
    assert await two.lookup("support") is not None  # From the config, for everyone.
    assert await two.lookup("sql") is None
    ref = AdapterRef("sql", "/adapters/sql", await one.next_generation())
    assert await one.register(AdapterEntry(ref, "org/chat", 1), inplace=False) is None
    assert await one.register(AdapterEntry(ref, "org/chat", 1), inplace=False) == "exists"
    assert await two.lookup("sql") is None  # Two read the table less than ttl_s ago.
    clock.now += 1
    assert (await two.lookup("sql")) == AdapterEntry(ref, "org/chat", 1)
    assert await two.unregister("support")  # A config adapter: unloaded everywhere too.
    clock.now += 1
    assert await one.lookup("support") is None
    assert not await one.unregister("support")
    # The registry's owner went away: a fresh table is seeded with what the replicas saw.
    table.table = AdapterTable()
    clock.now += 1
    assert [e.name for e in await one.entries()] == ["sql"]
    assert table.table.version > 0 and table.table.generations >= ref.generation
    coder = AdapterEntry(AdapterRef("c1", "/c1", 1), "org/coder")
    assert await one.register(coder, inplace=False) is None
    full = AdapterEntry(AdapterRef("c2", "/c2", 2), "org/coder")
    assert await one.register(full, inplace=False) == "full"  # max_runtime_adapters 1.


def admin(
    keys: bool = False,
    loaded: list[AdapterRef] | None = None,
    error: ErrorInfo | None = None,
    admins: tuple[str, ...] | None = None,
) -> AdapterAdmin:
    """``admins``: security.admin_keys (default: ``ops`` with keys, none without)."""
    config = CONFIG.model_copy(deep=True)
    config.security.admin_keys = list(admins if admins is not None else ("ops",) * keys)

    async def load(ref: AdapterRef) -> ErrorInfo | None:
        if loaded is not None:
            loaded.append(ref)
        return error

    registry = AdapterRegistry(config, LocalTable(), ttl_s=0)
    return AdapterAdmin(config, registry, {"org/chat": load, "org/coder": load}, lambda: keys)


async def test_load_and_unload_answer_as_vllm_does() -> None:
    loaded: list[AdapterRef] = []
    verbs = admin(loaded=loaded)
    body = LoadLoRAAdapterRequest(lora_name="sql", lora_path="/adapters/sql")
    assert await verbs.load(body, None) == "Success: LoRA adapter 'sql' added successfully."
    assert [r.name for r in loaded] == ["sql"] and loaded[0].generation > 0
    entry = await verbs.registry.lookup("sql")
    assert entry is not None and entry.ref == loaded[0] and entry.base == "org/chat"
    with pytest.raises(APIError, match="set 'load_inplace' to True"):
        await verbs.load(body, None)
    await verbs.load(body.model_copy(update={"load_inplace": True}), None)
    assert loaded[1].generation > loaded[0].generation  # New weights, new generation.
    bad = [
        ({"lora_name": "", "lora_path": "/x"}, 400, "must be provided"),
        ({"lora_name": "org/coder", "lora_path": "/x"}, 400, "conflicts with a served base"),
        ({"lora_name": "x", "lora_path": "rel/a/b"}, 400, "absolute directory"),
        ({"lora_name": "x", "lora_path": "/x", "base_model_name": "org/coder"}, 400, "is off"),
        ({"lora_name": "x", "lora_path": "/x", "base_model_name": "org/none"}, 404, "No model"),
    ]
    for fields, status, fragment in bad:
        with pytest.raises(APIError, match=fragment) as info:
            await verbs.load(LoadLoRAAdapterRequest.model_validate(fields), None)
        assert info.value.info.status == status
    unload = UnloadLoRAAdapterRequest(lora_name="sql")
    assert await verbs.unload(unload, None) == "Success: LoRA adapter 'sql' removed successfully."
    with pytest.raises(APIError, match="cannot be found") as info:
        await verbs.unload(unload, None)
    assert info.value.info.status == 404
    assert await verbs.unload(UnloadLoRAAdapterRequest(lora_name="support"), None)  # Config's.
    assert await verbs.registry.lookup("support") is None


async def test_a_failed_load_registers_nothing() -> None:
    missing = ErrorInfo("no adapter found at /nope", status=404, code="adapter_not_found")
    verbs = admin(error=missing)
    with pytest.raises(APIError) as info:
        await verbs.load(LoadLoRAAdapterRequest(lora_name="x", lora_path="/nope"), None)
    assert info.value.info == missing
    assert await verbs.registry.lookup("x") is None


async def test_with_api_keys_only_admin_keys_change_adapters() -> None:
    verbs = admin(keys=True)
    body = LoadLoRAAdapterRequest(lora_name="sql", lora_path="/adapters/sql")
    for key in ("tenant", None):
        with pytest.raises(APIError) as info:
            await verbs.load(body, key)
        assert (info.value.info.status, info.value.info.code) == (403, "admin_key_required")
    await verbs.load(body, "ops")
    with pytest.raises(APIError, match=r"security\.admin_keys"):
        await verbs.unload(UnloadLoRAAdapterRequest(lora_name="sql"), "tenant")


async def test_admins_named_without_keys_keep_the_routes_closed() -> None:
    verbs = admin(keys=False, admins=("ops",))  # The keys' secret was never mounted.
    body = LoadLoRAAdapterRequest(lora_name="sql", lora_path="/adapters/sql")
    for key in ("ops", None):
        with pytest.raises(APIError, match="no API keys are configured") as info:
            await verbs.load(body, key)
        assert (info.value.info.status, info.value.info.code) == (403, "admin_key_required")


class FakeLLM:
    """add_lora / remove_lora of an engine: slow, failing for paths under /bad."""

    def __init__(self) -> None:
        self.added: list[Any] = []
        self.removed: list[int] = []

    async def add_lora(self, request: Any) -> bool:
        await asyncio.sleep(0.01)
        if request.lora_path.startswith("/bad"):
            raise RuntimeError(f"Loading lora x failed: No adapter found for {request.lora_path}")
        if request.lora_path.startswith("/rank"):
            raise ValueError("LoRA rank 64 is greater than max_lora_rank 8")
        self.added.append(request)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True


async def test_an_engine_loads_each_adapter_once_with_fresh_ids(tmp_path: Any) -> None:
    llm = FakeLLM()
    adapters = EngineAdapters(llm.add_lora, llm.remove_lora, capacity=2)
    a1 = AdapterRef("a", str(tmp_path), 1)
    got = await asyncio.gather(*(adapters.request_for(a1) for _ in range(10)))
    assert len(llm.added) == 1 and all(r is got[0] for r in got)  # Never twice at once.
    assert got[0].lora_name == "a@1" and got[0].lora_path == str(tmp_path)
    a2 = AdapterRef("a", str(tmp_path), 2)  # Reloaded: new id, the old one removed.
    assert (await adapters.request_for(a2)).lora_int_id != got[0].lora_int_id
    assert llm.removed == [got[0].lora_int_id] and adapters.loaded() == ["a@2"]
    for name in ("b", "c"):  # Beyond capacity: the least recently used is removed.
        await adapters.request_for(AdapterRef(name, str(tmp_path), 1))
    assert adapters.loaded() == ["b@1", "c@1"]
    ids = [r.lora_int_id for r in llm.added]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(
    ("source", "status", "code"),
    [("/bad/x", 404, "adapter_not_found"), ("/rank/x", 400, "invalid_adapter")],
)
async def test_an_adapter_that_cannot_load_is_an_error_not_a_dead_engine(
    source: str, status: int, code: str
) -> None:
    adapters = EngineAdapters(FakeLLM().add_lora, FakeLLM().remove_lora)
    with pytest.raises(APIError) as info:
        await adapters.request_for(AdapterRef("x", source, 1))
    assert (info.value.info.status, info.value.info.code) == (status, code)
    assert adapters.loaded() == []


async def test_adapter_files_removed_after_loading_are_a_404(tmp_path: Any) -> None:
    folder = tmp_path / "adapter"
    folder.mkdir()
    llm = FakeLLM()
    adapters = EngineAdapters(llm.add_lora, llm.remove_lora)
    ref = AdapterRef("x", str(folder), 1)
    await adapters.request_for(ref)
    folder.rmdir()  # vLLM would reload it from here after an eviction, and die.
    with pytest.raises(APIError) as info:
        await adapters.request_for(ref)
    assert info.value.info.status == 404


async def test_models_without_runtime_loading_keep_their_adapters() -> None:
    config = AppConfig.model_validate({"lora": {"adapters": {"fixed": "/adapters/fixed"}}})
    verbs = AdapterAdmin(config, AdapterRegistry(config, LocalTable()), {}, lambda: False)
    with pytest.raises(APIError, match="Runtime LoRA loading is off"):
        await verbs.unload(UnloadLoRAAdapterRequest(lora_name="fixed"), None)
    with pytest.raises(APIError, match="Runtime LoRA loading is off"):
        await verbs.load(LoadLoRAAdapterRequest(lora_name="x", lora_path="/x"), None)
    assert await verbs.registry.lookup("fixed") is not None
