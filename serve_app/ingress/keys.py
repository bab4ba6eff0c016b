"""API keys: loaded on the router from an environment variable and/or a file, kept as digests.

Keys never come from the Serve config (the Ray dashboard shows it). Only SHA-256 digests are
kept in memory, every presented key is compared against every stored digest with
``hmac.compare_digest``, and logs only ever name a key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from serve_app.config.security import NAME_RE, SecurityConfig

logger = logging.getLogger("serve_app.security")

# Printable ASCII without spaces or commas: a key must survive an HTTP header and the env list.
_KEY_RE = re.compile(r"[\x21-\x2b\x2d-\x7e]{8,512}")


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class KeyRing:
    """Named API keys, held as SHA-256 digests so every comparison has the same length."""

    names: tuple[str, ...] = ()
    digests: tuple[bytes, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.digests)

    def match(self, presented: bytes) -> str | None:
        """The name of the key presented, or None; compares against every key, no early exit."""
        digest = _digest(presented)
        hits = [hmac.compare_digest(digest, stored) for stored in self.digests]
        return next((name for name, hit in zip(self.names, hits, strict=True) if hit), None)


def parse_keys(entries: list[str], source: str) -> list[tuple[str, str]]:
    """(name, key) pairs from `name:key` or bare-key entries; bare keys are named source-N."""
    pairs = []
    for index, raw in enumerate(entries, start=1):
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        name, sep, key = entry.partition(":")
        if not (sep and NAME_RE.fullmatch(name)):
            name, key = f"{source}-{index}", entry
        if not _KEY_RE.fullmatch(key):
            # The message names the entry, never the key itself.
            raise ValueError(
                f"API key {name!r} from {source}: keys are 8-512 printable ASCII characters "
                "without spaces or commas"
            )
        pairs.append((name, key))
    return pairs


def load_keys(config: SecurityConfig, environ: Mapping[str, str] | None = None) -> KeyRing:
    environ = os.environ if environ is None else environ
    pairs = parse_keys(environ.get(config.api_keys_env, "").split(","), "env")
    if config.api_keys_file is not None:
        path = config.api_keys_file
        try:
            text = path.read_text()
            mode = path.stat().st_mode
        except OSError as exc:
            raise ValueError(f"security.api_keys_file {path}: {exc.strerror}") from exc
        if mode & 0o077:
            logger.warning("API key file %s is readable by others; chmod 600 it", path)
        pairs += parse_keys(text.splitlines(), "file")
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(
            f"duplicate API key names: {sorted({n for n in names if names.count(n) > 1})}"
        )
    digests = [_digest(key.encode()) for _, key in pairs]
    if len(set(digests)) != len(digests):
        raise ValueError("the same API key is listed twice (under different names)")
    if not pairs:
        logger.warning(
            "No API keys configured (%s, api_keys_file): /v1 is open", config.api_keys_env
        )
    for field in ("key_rate_limits", "key_priorities"):
        for name in getattr(config, field):
            if name not in names:  # A typo would silently leave that key at the defaults.
                logger.warning("security.%s names unknown key %r", field, name)
    return KeyRing(tuple(names), tuple(digests))
