"""Sampling profiles of a target's processes while a load runs (``py-spy``, not pausing them).

``cpu_cost --profile`` says how much CPU each role spends per output token; this says where:
each role's samples holding the GIL (Python at work) folded by function, inclusive and self,
as µs per output token.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

RATE_HZ = 100
TOP = 25


@dataclass
class Recording:
    """py-spy recorders attached to some processes; ``stop`` makes them write their files."""

    files: dict[str, Path] = field(default_factory=dict)  # role -> raw folded stacks
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def stop(self) -> None:
        for proc in self._procs:
            proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT.
        for proc in self._procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def record(pids_by_role: dict[str, int], out: Path, label: str) -> Recording:
    """Start one py-spy per role (its first process) writing folded stacks under ``out``."""
    # Ray's dashboard brings py-spy; next to this Python when its venv is not on PATH.
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    recording = Recording()
    for role, pid in pids_by_role.items():
        path = out / f"{label}-{role.replace(' ', '_')}.folded"
        # --gil: samples holding the GIL only, i.e. Python at work; py-spy cannot tell a
        # thread blocked in native code (Ray's core worker, uvloop) from a busy one.
        cmd = [spy, "record", "--nonblocking", "--gil", "--nolineno", "-r", str(RATE_HZ)]
        cmd += ["-f", "raw"]
        cmd += ["-o", str(path), "--pid", str(pid)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        recording.files[role] = path
        recording._procs.append(proc)
    return recording


def fold(path: Path) -> tuple[int, Counter[str], Counter[str]]:
    """Busy samples in a raw py-spy file: total, per function inclusive (once per stack), and
    per function as the leaf (self)."""
    total, inclusive, leaf = 0, Counter[str](), Counter[str]()
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        total += count
        for frame in set(frames):
            inclusive[frame] += count
        if frames:
            leaf[frames[-1]] += count
    return total, inclusive, leaf


def summary(path: Path, output_tokens: int, top: int = TOP) -> str:
    """The top functions of one role, inclusive and self, in µs of CPU per output token."""
    if not path.exists():
        return f"(no profile at {path})"
    total, inclusive, leaf = fold(path)
    per_token = 1e6 / RATE_HZ / max(1, output_tokens)  # µs of CPU per sample per token

    def rows(counts: Counter[str]) -> list[str]:
        return [
            f"  {n * per_token:>8.1f}  {n / max(1, total):>6.1%}  {frame[:150]}"
            for frame, n in counts.most_common(top)
        ]

    return "\n".join(
        [
            f"{total} busy samples = {total * per_token:.0f} µs/token",
            "inclusive (µs/token, share):",
            *rows(inclusive),
            "self:",
            *rows(leaf),
        ]
    )
