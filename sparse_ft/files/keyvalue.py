"""``key=value`` arguments, read the same way wherever a command line takes them (recipe
overrides, ``--method-arg``): the value is YAML, so numbers, booleans, ``null`` and lists
arrive typed."""

from __future__ import annotations

from typing import Any, Iterable

import yaml

from sparse_ft.files.strict import yaml_value


def parse_assignments(items: Iterable[str], flag: str, shape: str = "key=value") -> list[tuple[str, Any]]:
    """``["a=1", "b=[x, y]", "c="]`` -> ``[("a", 1), ("b", ["x", "y"]), ("c", "")]``, in order.

    A value YAML cannot read (a glob such as ``*.jsonl``, an unbalanced bracket) stays text:
    whoever takes the key checks the value and names it. A value the strict reader refuses (an
    anchor, a key given twice: ``sparse_ft.files.strict``) is a ``ValueError``, never text.
    ``flag`` and ``shape`` name the argument in the error."""
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {item!r} must look like {shape}")
        try:
            value = yaml_value(raw, f"{flag} {item!r}") if raw else ""
        except yaml.YAMLError:
            value = raw
        out.append((key, value))
    return out
