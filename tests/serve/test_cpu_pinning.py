"""The launcher's core split on the real app: the model worker has cores nothing else uses."""

from __future__ import annotations

import os

import psutil
import pytest


def test_model_worker_runs_on_cores_of_its_own(base_url: str) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to split")
    workers, others = [], []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        title = " ".join([proc.info["name"] or "", *(proc.info["cmdline"] or [])])
        try:
            cores = set(proc.cpu_affinity())
        except psutil.Error:
            continue
        if "VLLM::Worker" in title:
            workers.append(cores)
        elif any(mark in title for mark in ("ServeReplica:llm:", "ProxyActor", "EngineCore")):
            others.append(cores)
    assert workers, "no vLLM model worker found"
    assert len(others) >= 4, others  # router, preprocessor, engine replica, proxy, scheduler
    worker_cores = set().union(*workers)
    other_cores = set().union(*others)
    assert not worker_cores & other_cores, (worker_cores, other_cores)
