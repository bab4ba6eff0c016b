"""Cluster tier: real multi-node Ray clusters on this machine (slow; real vLLM CPU + SmolLM2)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster: a real multi-node Ray cluster (minutes)")
