"""Core lists in the form VLLM_CPU_OMP_THREADS_BIND takes ('0-3,5'; one list per worker)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator


def core_list(cores: list[int]) -> str:
    """The form VLLM_CPU_OMP_THREADS_BIND takes: '0,1,2'."""
    return ",".join(str(c) for c in cores)


def parse_core_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5] (VLLM_CPU_OMP_THREADS_BIND's form for one worker)."""
    cores: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"not a core list: {text!r} (expected e.g. '0-3' or '0,2')") from None
        if low < 0 or high < low:
            raise ValueError(f"not a core list: {text!r} (expected e.g. '0-3' or '0,2')")
        cores.update(range(low, high + 1))
    return sorted(cores)


def check_threads_bind(value: str) -> str:
    """A valid VLLM_CPU_OMP_THREADS_BIND: 'auto', 'nobind' or one core list per worker."""
    if value not in ("auto", "nobind"):
        for worker_cores in value.split("|"):  # '0-3|4-7': one list per worker.
            parse_core_list(worker_cores)
    return value


ThreadsBind = Annotated[str, AfterValidator(check_threads_bind)]
