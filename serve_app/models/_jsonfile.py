"""Small post-save fix-ups of the JSON files transformers writes."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def update_json(path: Path, updates: Mapping[str, Any], drop: Iterable[str] = ()) -> None:
    """Set ``updates`` and remove ``drop`` keys in the JSON object at ``path``."""
    data = json.loads(path.read_text(encoding="utf-8"))
    for key in drop:
        data.pop(key, None)
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
