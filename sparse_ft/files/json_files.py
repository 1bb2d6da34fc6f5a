"""JSON files that hold one object (an adapter's config and metadata, a token file's sidecar),
read so that a damaged or hand-edited one fails in one line naming it, not in a ``KeyError`` or
``AttributeError`` wherever its first key is read."""

from __future__ import annotations

import json
from pathlib import Path


def json_object(path: Path, what: str) -> dict:
    """The JSON object in ``path``; ``ValueError`` "``what``: <name> is not valid JSON / holds a
    JSON list, not an object" otherwise."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{what}: {Path(path).name} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what}: {Path(path).name} holds a JSON {type(value).__name__}, not an object")
    return value
