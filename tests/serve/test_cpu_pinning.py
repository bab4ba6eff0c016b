"""The launcher's core split on the real app: the model worker has cores nothing else uses."""

from __future__ import annotations

import os

import psutil
import pytest


def _title(proc: psutil.Process) -> str:
    return " ".join([proc.name(), *proc.cmdline()])


def test_model_worker_runs_on_cores_of_its_own(base_url: str) -> None:
    """Only the shared app's processes count: other tests' apps (or a job a test killed) are
    not what the launcher split."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to split")
    replicas, proxies = [], []
    for proc in psutil.process_iter():
        try:
            title = _title(proc)
        except psutil.Error:
            continue
        if "ServeReplica:llm:" in title:
            replicas.append(proc)
        elif "ProxyActor" in title:
            proxies.append(proc)
    engines = [proc for proc in replicas if "ServeReplica:llm:Engine" in _title(proc)]
    assert engines, "the shared app's engine replica is not running"
    workers, others = [], [set(proc.cpu_affinity()) for proc in replicas + proxies]
    for child in (c for engine in engines for c in engine.children(recursive=True)):
        try:
            title, cores = _title(child), set(child.cpu_affinity())
        except psutil.Error:  # A helper process that just exited.
            continue
        (workers if "VLLM::Worker" in title else others).append(cores)
    assert workers, "no vLLM model worker under the engine replica"
    assert len(others) >= 4, others  # router, preprocessor, engine replica, proxy, scheduler
    worker_cores = set().union(*workers)
    other_cores = set().union(*others)
    assert not worker_cores & other_cores, (worker_cores, other_cores)
