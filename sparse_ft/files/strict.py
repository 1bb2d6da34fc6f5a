"""The one reader of the YAML and JSON a user hands this toolkit (recipe files and every file of
their ``inherit:`` chain, ``key=value`` values, DeepSpeed configs, ``--metadata``): what parses
is what the user meant, and reading it is bounded by the size of the text.

* **YAML anchors are refused** (``&a``; so no alias ``*a`` can resolve). An alias repeats a
  node by reference, so nine levels of ``&a [*a, *a, ...]`` in 430 bytes expand to 9^9 items
  wherever the value is copied or walked (the recipe's merge and typing grew past 1 GB). A
  fixed expansion budget would be one more number to tune, and one a legitimate file could
  still hit; refusing is one clear rule, the one StrictYAML and most config linters apply, and
  a recipe shares values through ``inherit:``, which needs no aliases.
* **Duplicate keys are refused**, at any depth, naming the key and both places: YAML and JSON
  both keep the last one silently (``lr: 1.0e-3`` then ``lr: 5.0`` trained at 5.0).
* **Nesting is bounded** (``MAX_DEPTH``): a recipe is three levels deep, and ten thousand
  brackets would otherwise be a ``RecursionError`` traceback here or in a later copy.

Each refusal is a ``ValueError`` of one line starting with the caller's ``where``."""

from __future__ import annotations

import json
import re
from typing import Any, Optional

import yaml

MAX_DEPTH = 100  # nesting levels of lists and mappings; generous for any configuration


class _Refused(yaml.YAMLError):
    """What the strict reader refuses, raised inside PyYAML's composer (an anchor) or by the walk
    after it (a key given twice, too deep); ``yaml_value`` prefixes the caller's ``where``."""


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` refusing anchors as they are composed, before any node is repeated."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if not isinstance(event, yaml.AliasEvent) and getattr(event, "anchor", None) is not None:
            mark = event.start_mark
            raise _Refused(f"YAML anchor &{event.anchor} at line {mark.line + 1}, column {mark.column + 1} is refused "
                           f"(anchors and aliases can expand a few lines into gigabytes); write the value out")
        return super().compose_node(parent, index)


def yaml_value(text: str, where: str) -> Any:
    """The value of the YAML document ``text`` (``None`` when empty), read with ``SafeLoader``'s
    types; ``ValueError`` "``where``: ..." for an anchor, a key given twice or nesting deeper than
    ``MAX_DEPTH``; ``yaml.YAMLError`` for text that is not YAML (the caller words that)."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_node(loader, node, "", 0)
        return loader.construct_document(node)
    except _Refused as err:
        raise ValueError(f"{where}: {err}") from None
    except RecursionError:  # the composer recurses per level: far past MAX_DEPTH
        raise ValueError(f"{where}: nested deeper than {MAX_DEPTH} levels of lists and mappings") from None
    finally:
        loader.dispose()


def _check_node(loader: _StrictLoader, node: yaml.Node, path: str, depth: int) -> None:
    """``node`` and all below it: no mapping holds a key twice, nothing deeper than ``MAX_DEPTH``."""
    if depth > MAX_DEPTH:
        mark = node.start_mark
        raise _Refused(f"nested deeper than {MAX_DEPTH} levels of lists and mappings (at line {mark.line + 1}, "
                       f"column {mark.column + 1})")
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_node(loader, item, f"{path}[{i}]", depth + 1)
    elif isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key_node, value_node in node.value:
            # a list or mapping as a key is unhashable: SafeLoader refuses it when it constructs
            key = loader.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode) else key_node
            name = f"{path}.{key}" if path else str(key)
            if key in seen:
                raise _Refused(f"key {name} is given twice, {_places(seen[key], key_node.start_mark)}; "
                               f"keep one (YAML would silently keep the last)")
            seen[key] = key_node.start_mark
            _check_node(loader, value_node, name, depth + 1)


def _places(first: Any, second: Any) -> str:
    """Two positions (PyYAML marks, or (line, column) from 0) as a reader finds them."""
    (l1, c1), (l2, c2) = ((m.line, m.column) if hasattr(m, "line") else m for m in (first, second))
    return f"at line {l1 + 1}, columns {c1 + 1} and {c2 + 1}" if l1 == l2 else f"at lines {l1 + 1} and {l2 + 1}"


def json_value(text: str, where: str) -> Any:
    """The value of the JSON ``text``; ``ValueError`` "``where``: ..." for a key given twice in
    one object (naming it and both places) or nesting past Python's recursion limit;
    ``json.JSONDecodeError`` for text that is not JSON (the caller words that)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply to read") from None
    twice = _first_duplicate(text)
    if twice is not None:
        name, first, second = twice
        raise ValueError(f"{where}: key {name} is given twice, {_places(first, second)}; "
                         f"keep one (JSON would silently keep the last)")
    return value


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:,]')


def _first_duplicate(text: str) -> Optional[tuple[str, tuple[int, int], tuple[int, int]]]:
    """The first key that repeats within one object of the valid JSON ``text``: its dotted path
    and both (line, column) positions, from 0 (``json.loads`` keeps no positions). Valid JSON
    needs tokens alone: strings and punctuation; numbers and literals are skipped. One pass."""
    objects: list[Optional[dict]] = []  # per open bracket: an object's keys -> position, None for a list
    paths: list[str] = []  # the dotted path of each open bracket
    named = ""  # the path of the value being read
    string = (None, 0)  # the last string read and its offset: the key, when ":" follows
    line, line_start, counted = 0, 0, 0  # newlines before offset `counted`, and where the last began
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token.startswith('"'):
            string = (json.loads(token), match.start())
            continue
        if token == ":":
            key, at = string
            line += text.count("\n", counted, at)
            line_start, counted = max(line_start, text.rfind("\n", counted, at) + 1), at
            named = f"{paths[-1]}.{key}" if paths[-1] else key
            if key in objects[-1]:
                return named, objects[-1][key], (line, at - line_start)
            objects[-1][key] = (line, at - line_start)
        elif token in "{[":
            objects.append({} if token == "{" else None)
            paths.append(named)
        else:  # "," ends a value, "}" or "]" a container
            if token != ",":
                objects.pop()
                paths.pop()
            named = paths[-1] if paths else ""
    return None
