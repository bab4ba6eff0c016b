"""What this machine's CPU computes natively (read from /proc/cpuinfo, no torch import)."""

from __future__ import annotations

from pathlib import Path

# /proc/cpuinfo names: x86 "flags" (AVX512-BF16, AMX-BF16), Arm "Features" (BF16).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def host_cpu_flags() -> set[str]:
    """This machine's CPU feature flags; empty where /proc/cpuinfo can't tell."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_bf16(flags: set[str] | None = None) -> bool | None:
    """True/False: the CPU does/doesn't multiply bf16 natively; None: the flags are unknown.
    Without it (AVX2-only x86) torch emulates bf16 and a matmul runs ~6x slower than fp32."""
    flags = host_cpu_flags() if flags is None else flags
    return bool(flags & NATIVE_BF16_FLAGS) if flags else None
