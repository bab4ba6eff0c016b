"""Runtime LoRA loading, pure logic: two routers over one store (stand-in for Ray's GCS), the
admin checks, limits and vLLM's error cases, with stand-in engine handles. The real stack is
tests/serve/test_lora.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from serve_app.config import AppConfig
from serve_app.config.security import SecurityConfig
from serve_app.errors import APIError, ErrorInfo
from serve_app.hops import LoraAdapter
from serve_app.ingress import adapters
from serve_app.ingress.adapters import MemoryStore, RuntimeAdapters
from serve_app.ingress.backends import ModelBackend, ModelBackends
from serve_app.ingress.lora_admin import (
    AdapterAdmin,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)


class FakeEngine:
    """A stand-in engine handle whose add_lora fails for paths under /missing."""

    deployment_name = "Engine"

    def __init__(self) -> None:
        self.loaded: list[LoraAdapter] = []
        self.add_lora = SimpleNamespace(remote=self._add_lora)

    def options(self, **_: Any) -> FakeEngine:
        return self

    async def _add_lora(self, adapter: LoraAdapter) -> ErrorInfo | None:
        if adapter.path.startswith("/missing"):
            return ErrorInfo("not found", status=404, param="lora_path")
        self.loaded.append(adapter)
        return None


def _router(store: MemoryStore, engine: FakeEngine, **model: Any) -> ModelBackends:
    config = AppConfig.model_validate(
        {"model": {"name": "tiny-qwen2", "max_runtime_adapters": 2} | model}
    )
    preprocessor = SimpleNamespace(deployment_name="Preprocessor")
    preprocessor.options = lambda **_: preprocessor
    backend = ModelBackend(config, preprocessor, engine, app_name="app", on_resubmit=print)  # type: ignore[arg-type]
    return ModelBackends([backend], RuntimeAdapters(store, "app", config.served_names))


def _load(name: str, path: str = "/adapters/a", **extra: Any) -> LoadLoRAAdapterRequest:
    return LoadLoRAAdapterRequest(lora_name=name, lora_path=path, **extra)


async def test_a_load_through_one_router_is_served_by_the_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, engine = MemoryStore(), FakeEngine()
    first, second = _router(store, engine), _router(store, engine)
    await second.fresh()  # The second router has looked before the load.
    admin = AdapterAdmin(first, SecurityConfig())
    assert "added successfully" in await admin.load(_load("sql"), tenant="")
    assert engine.loaded == [LoraAdapter("sql", "/adapters/a")]
    assert first.serving("sql").lora == LoraAdapter("sql", "/adapters/a")
    with pytest.raises(APIError):  # Its view is less than REFRESH_S old.
        second.serving("sql")
    monkeypatch.setattr(adapters, "REFRESH_S", 0.0)
    await second.fresh()
    assert second.serving("sql").lora == LoraAdapter("sql", "/adapters/a")
    assert [s.model_name for s in second.servings_of(next(iter(second)))] == ["tiny-qwen2", "sql"]
    # Unloaded through the second: a 404 naming what is served, on both routers.
    await AdapterAdmin(second, SecurityConfig()).unload(
        UnloadLoRAAdapterRequest(lora_name="sql"), ""
    )
    await first.fresh()
    for router in (first, second):
        with pytest.raises(APIError) as caught:
            router.serving("sql")
        assert caught.value.info.status == 404 and "tiny-qwen2" in caught.value.info.message


async def test_vllms_error_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapters, "REFRESH_S", 0.0)
    store, engine = MemoryStore(), FakeEngine()
    admin = AdapterAdmin(_router(store, engine, lora_adapters={"cfg": "/a"}), SecurityConfig())

    async def status(call: Any) -> tuple[int, str | None]:
        with pytest.raises(APIError) as caught:
            await call
        return caught.value.info.status, caught.value.info.param

    await admin.load(_load("sql"), "")
    assert await status(admin.load(_load("sql"), "")) == (400, "lora_name")  # Already loaded.
    await admin.load(_load("sql", "/adapters/b", load_inplace=True), "")  # In place: a reload.
    assert engine.loaded[-1].path == "/adapters/b" and engine.loaded[-1].revision > 0
    assert await status(admin.load(_load("tiny-qwen2"), "")) == (400, "lora_name")
    assert await status(admin.load(_load("cfg"), "")) == (400, "lora_name")
    assert await status(admin.load(_load("bad name"), "")) == (400, "lora_name")
    assert await status(admin.load(_load("gone", "/missing/x"), "")) == (404, "lora_path")
    assert await status(admin.load(_load("x", base_model_name="gpt-4"), "")) == (404, "model")
    await admin.load(_load("second"), "")
    assert await status(admin.load(_load("third"), "")) == (400, "lora_name")  # The limit: 2.
    unload = UnloadLoRAAdapterRequest
    assert await status(admin.unload(unload(lora_name="cfg"), "")) == (400, "lora_name")
    assert await status(admin.unload(unload(lora_name="nope"), "")) == (404, "lora_name")


async def test_with_keys_only_admin_keys_may_load() -> None:
    admin = AdapterAdmin(_router(MemoryStore(), FakeEngine()), SecurityConfig(admin_keys=["ops"]))
    with pytest.raises(APIError) as caught:
        await admin.load(_load("sql"), tenant="team-a")
    assert caught.value.info.status == 403 and caught.value.info.type == "permission_error"
    assert "added" in await admin.load(_load("sql"), tenant="ops")


async def test_runtime_loading_is_off_unless_the_model_allows_it() -> None:
    admin = AdapterAdmin(
        _router(MemoryStore(), FakeEngine(), max_runtime_adapters=0), SecurityConfig()
    )
    with pytest.raises(APIError, match="max_runtime_adapters"):
        await admin.load(_load("sql"), "")


def test_a_read_that_overlapped_a_local_load_does_not_undo_it() -> None:
    class LoadDuringRead(MemoryStore):
        def keys(self, prefix: bytes) -> list[bytes]:
            found = super().keys(prefix)  # Read before the load below lands.
            if hook:
                hook.pop()()
            return found

    store = LoadDuringRead()
    view = RuntimeAdapters(store, "app", ["m"])
    hook = [lambda: view.add("m", LoraAdapter("b", "/b"), replace=False, limit=4)]
    view._refresh()
    assert view.get("b") is not None  # The stale read was dropped, not applied.
    view._refresh()  # The next read sees it in the store.
    assert view.get("b") == adapters.RuntimeAdapter("m", LoraAdapter("b", "/b"))
    other = RuntimeAdapters(store, "app", ["m"])
    assert other.add("m", LoraAdapter("b", "/c"), replace=False, limit=4) == "taken"


async def test_a_reload_in_place_reaches_the_other_router(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same name, new weights: the other router must send the new revision, or its engines
    would keep running the old weights they cached."""
    monkeypatch.setattr(adapters, "REFRESH_S", 0.0)
    store, engine = MemoryStore(), FakeEngine()
    first, second = _router(store, engine), _router(store, engine)
    admin = AdapterAdmin(first, SecurityConfig())
    await admin.load(_load("sql"), "")
    await second.fresh()
    assert second.serving("sql").lora == LoraAdapter("sql", "/adapters/a")
    await admin.load(_load("sql", "/adapters/b", load_inplace=True), "")
    await second.fresh()
    assert second.serving("sql").lora == engine.loaded[-1]
    assert engine.loaded[-1].path == "/adapters/b" and engine.loaded[-1].revision > 0


def test_loads_racing_at_the_limit_never_pass_it() -> None:
    """Two routers see 1 of 2 and both create: whoever counts 3 backs out, so the store
    never holds more than the limit once each load has returned."""
    hook: list[Any] = []

    class Racing(MemoryStore):
        def create(self, key: bytes, value: bytes, *, replace: bool) -> bool:
            made = super().create(key, value, replace=replace)
            if hook:
                hook.pop()()  # The other router's create lands between ours and our count.
            return made

    store = Racing()
    view = RuntimeAdapters(store, "app", ["m"])
    assert view.add("m", LoraAdapter("x", "/x"), replace=False, limit=2) == "added"
    racer = RuntimeAdapters(store, "app", ["m"])
    results: list[str] = []
    hook.append(
        lambda: results.append(racer.add("m", LoraAdapter("z", "/z"), replace=False, limit=2))
    )
    results.append(view.add("m", LoraAdapter("y", "/y"), replace=False, limit=2))
    assert len(store.keys(b"lora/app/m/")) <= 2
    # Here the racer counted while both keys were in and backed out; ours then fit.
    assert results == ["full", "added"]
    assert sorted(store.keys(b"lora/app/m/")) == [b"lora/app/m/x", b"lora/app/m/y"]


async def test_batch_lines_see_adapters_loaded_through_another_router(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from serve_app.batch_api.service import BatchService
    from serve_app.batch_api.store import BatchStore

    store, engine = MemoryStore(), FakeEngine()
    first, second = _router(store, engine), _router(store, engine)
    await second.fresh()  # Looked before the load; its view is fresh for REFRESH_S.
    await AdapterAdmin(first, SecurityConfig()).load(_load("sql"), "")
    config = next(iter(second)).config
    line = {"model": "sql", "prompt": "hi", "max_tokens": 1}
    unrefreshed = BatchService(second.serving, config, BatchStore(tmp_path / "a"))
    refreshed = BatchService(
        second.serving, config, BatchStore(tmp_path / "b"), refresh=second.fresh
    )
    monkeypatch.setattr(adapters, "REFRESH_S", 0.0)
    _, body = await unrefreshed._call("/v1/completions", line)
    assert body["error"]["code"] == "model_not_found"
    _, body = await refreshed._call("/v1/completions", line)  # Fails later, at the fake engine.
    assert body["error"]["code"] != "model_not_found", body
