"""Keep a CPU box's model worker on cores of its own.

vLLM on CPU runs the model in one worker process whose OpenMP threads are bound to cores;
everything else (Ray's GCS and raylet, Serve's proxy and controller, our three replicas, vLLM's
scheduler process) otherwise competes for those same cores, and every time slice it takes
stalls a whole engine step. On a single machine ``serve_app.launch`` confines Ray to the last
core (the one vLLM reserves for its scheduler anyway); each engine replica binds its model
worker to the cores Ray is not on (``engine_isolation``). Measured on 2 cores: +12-15 % output
tokens/s at c=32. Ray starts on every core, so its services and the replicas' imports run in
parallel, and is confined once the apps answer (``confine_ray``): the replicas read the split
from ``RAY_CORES_ENV`` meanwhile. Offline Ray Data jobs do not split: their CPU engines run
in-process (``serve_app/offline/inproc_engine.py``) with the model on every core; with vLLM's
separate processes, putting the Ray Data driver and actor on the scheduler's core measured 16 %
slower.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import psutil

from serve_app.config.cores import core_list, parse_core_list

if TYPE_CHECKING:
    from serve_app.config import EngineConfig

logger = logging.getLogger("serve_app.cpu_pinning")
# vLLM names its model worker processes so (setproctitle); they keep their OpenMP binding.
WORKER_TITLE = "VLLM::Worker"
# The cores the launcher confines Ray to, in the environment Ray's processes inherit.
RAY_CORES_ENV = "SERVE_APP_RAY_CORES"


def split_cores(allowed: set[int] | list[int]) -> tuple[list[int], list[int]] | None:
    """(model worker cores, cores for everything else), or None with fewer than 2 cores."""
    cores = sorted(allowed)
    if len(cores) < 2:
        return None
    return cores[:-1], cores[-1:]


def ray_cores(engines: list[EngineConfig]) -> list[int] | None:
    """Cores to start a new single-machine Ray cluster on, when every engine is a CPU engine
    bound automatically; None: start Ray on every core as usual."""
    for engine in engines:
        if engine.resolved_device() != "cpu" or engine.cpu_threads_bind != "auto":
            return None
    split = split_cores(os.sched_getaffinity(0))
    return split[1] if split else None


def in_process_cores(threads_bind: str) -> tuple[list[int], bool]:
    """(cores, bind) for a model running in this process: an explicit list binds to it;
    'auto' and 'nobind' use every core this process may run on, unbound."""
    if threads_bind in ("auto", "nobind"):
        return sorted(os.sched_getaffinity(0)), False
    return parse_core_list(threads_bind), True


def pin_tree(root_pid: int, cores: list[int]) -> int:
    """Pin every thread of ``root_pid`` and its descendants to ``cores``, except vLLM's model
    workers (bound by OpenMP to their own cores). Returns how many processes moved."""
    root = psutil.Process(root_pid)
    moved = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            if WORKER_TITLE in " ".join([proc.name(), *proc.cmdline()]):
                continue
            for thread in proc.threads():
                with contextlib.suppress(OSError):  # A thread that just exited.
                    os.sched_setaffinity(thread.id, cores)
            moved += 1
        except psutil.Error:
            continue
    logger.info("Pinned %d processes to cores %s", moved, cores)
    return moved


def confine_ray(cores: list[int]) -> int:
    """Pin Ray's processes started by this one (GCS, raylet, dashboard and every worker and
    replica under them) to ``cores``, model workers aside; workers started later inherit it
    from the raylet. This process stays as it is. Returns how many processes moved."""
    moved = 0
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if "ray" in " ".join(child.cmdline()):
                moved += pin_tree(child.pid, cores)
    return moved


def per_rank(cores: list[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``ranks`` model workers: ``cores`` split evenly, one list
    per rank ('0-1|2-3'; the last takes any rest); with fewer cores than ranks they share."""
    if ranks <= 1:
        return core_list(cores)
    if len(cores) < ranks:
        return "|".join(str(cores[rank % len(cores)]) for rank in range(ranks))
    size = len(cores) // ranks
    groups = [cores[rank * size : (rank + 1) * size] for rank in range(ranks - 1)]
    return "|".join(core_list(g) for g in [*groups, cores[(ranks - 1) * size :]])


@contextlib.contextmanager
def engine_isolation(threads_bind: str, ranks: int = 1) -> Iterator[None]:
    """Around starting vLLM in an engine replica. When the launcher confined Ray (and so this
    replica) to some cores, the model workers get all the others: bind them there, then move
    this replica and vLLM's scheduler process back. Otherwise vLLM binds as configured, except
    that several ranks (tensor/pipeline parallel) get an explicit split: vLLM's own 'auto'
    wants a NUMA node per rank, which most single-socket machines do not have."""
    from_launcher = os.environ.get(RAY_CORES_ENV)
    confined = parse_core_list(from_launcher) if from_launcher else sorted(os.sched_getaffinity(0))
    if threads_bind != "auto":
        yield
        return
    # Widening succeeds for the cores this container may use (the cgroup's cpuset).
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
    allowed = sorted(os.sched_getaffinity(0))
    worker = [c for c in allowed if c not in confined]
    if not worker:
        os.sched_setaffinity(0, confined)
        if ranks > 1:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = per_rank(allowed, ranks)
        yield
        return
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = per_rank(worker, ranks)
    logger.info("Model worker on cores %s; Ray and this replica on %s", worker, confined)
    try:
        yield
    finally:
        pin_tree(os.getpid(), confined)
