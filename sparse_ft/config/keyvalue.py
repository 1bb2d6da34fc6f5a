"""``key=value`` arguments, read the same way wherever a command line takes them (recipe
overrides, ``--method-arg``): the value is YAML, so numbers, booleans, ``null`` and lists
arrive typed."""

from __future__ import annotations

from typing import Any, Iterable

import yaml


def parse_assignments(items: Iterable[str], flag: str, shape: str = "key=value") -> list[tuple[str, Any]]:
    """``["a=1", "b=[x, y]", "c="]`` -> ``[("a", 1), ("b", ["x", "y"]), ("c", "")]``, in order.

    A value YAML cannot read (a glob such as ``*.jsonl``, an unbalanced bracket) stays text:
    whoever takes the key checks the value and names it. ``flag`` and ``shape`` name the
    argument in the error for an item without ``=``."""
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {item!r} must look like {shape}")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        out.append((key, value))
    return out
