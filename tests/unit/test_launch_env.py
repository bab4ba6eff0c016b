"""``init_local_ray``: the environment Ray's processes inherit, set before Ray starts."""

from __future__ import annotations

import os
from typing import Any

import pytest

from serve_app import launch

ENV = ("RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S", "RAY_SERVE_ENABLE_HA_PROXY")


def _env_at_init(monkeypatch: pytest.MonkeyPatch, apps: list[dict[str, Any]]) -> dict[str, str]:
    import ray

    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    before = set(os.environ)
    seen: dict[str, str] = {}
    monkeypatch.setattr(ray, "init", lambda **_: seen.update({n: os.environ[n] for n in ENV}))
    launch.init_local_ray(apps, dashboard=False)
    for name in set(os.environ) - before:  # It sets them for good; keep the next tests' clean.
        os.environ.pop(name)
    return seen


def test_haproxy_outlasts_the_routers_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    # Default request_timeout_s 600 -> routers drain 610 s; HAProxy's default 120 s would cut.
    assert _env_at_init(monkeypatch, [{}])["RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"] == "610"
    apps = [
        {"request_timeout_s": 30},
        {"request_timeout_s": 60, "router": {"graceful_shutdown_timeout_s": 200.5}},
    ]
    assert _env_at_init(monkeypatch, apps)["RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"] == "201"
    short = [{"request_timeout_s": 20}]
    assert _env_at_init(monkeypatch, short)["RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"] == "120"
