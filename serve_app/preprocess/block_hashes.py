"""Chained hashes of a prompt's block-aligned prefixes, computed once in the preprocessor.

The engine's request router matches them against what it sent to each replica: equal hash i
means an equal prefix up to block i, so the replica holding the deepest match holds the most
reusable KV cache for this prompt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def block_hashes(
    token_ids: Sequence[int], block_size: int, max_blocks: int = 512, salt: bytes = b""
) -> tuple[int, ...]:
    """64-bit hashes of the full ``block_size``-aligned blocks of ``token_ids``.

    Hash i covers tokens [0, (i+1) * block_size), like vLLM's chained block hashes. One
    incremental blake2b over the packed tokens gives every prefix digest in O(tokens), and the
    result is the same in every process (Python's str hash() is salted per process). ``salt``
    separates models or adapters; ``max_blocks`` bounds work and message size.
    """
    n = min(len(token_ids) // block_size, max_blocks)
    if n <= 0:
        return ()
    step = block_size * 4
    # Token ids packed as uint32 (array "I": 4 bytes on every platform Ray runs on).
    data = memoryview(array("I", token_ids[: n * block_size]).tobytes())
    digest = hashlib.blake2b(salt, digest_size=8)
    out = []
    for start in range(0, n * step, step):
        digest.update(data[start : start + step])
        out.append(int.from_bytes(digest.digest(), "little"))
    return tuple(out)
