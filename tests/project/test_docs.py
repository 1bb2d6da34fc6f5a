"""The docs name only what exists: every repository path (``sparse_ft/...py``, ``scripts/...``,
``results/...``, ``docs/...``), dotted name (``sparse_ft.x.y``), command (``sparse-ft VERB
[KIND]``), recipe (``recipe=NAME``) and relative link that README.md and docs/*.md show in code
or link to resolves in this tree. Names are read from the source files (``ast``), not by
importing them, so the check costs well under a second; only a name a module makes at import
time (PEP 562) is looked up by importing it. A placeholder (``runs/...``, ``NAME``,
``<gpu>``, ``*``) names no file and is skipped."""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import itertools
import re
import subprocess
from pathlib import Path

import pytest

from sparse_ft.cli import build_parser
from sparse_ft.config.loader import find_recipe

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the folders of the repository whose files the docs name by path; data/ and runs/ are written by runs
TOP = ("sparse_ft", "attn_patterns", "scripts", "recipes", "docs", "results", "tests", "assets", "ds_configs")
PACKAGES = ("sparse_ft", "attn_patterns")
# Other projects' files, cited by their own paths: RULER's (docs/evaluation.md's table of which
# facts come from where), Qwen3's docs (your-model.md), vLLM's and SGLang's (dca.md, serving.md),
# LongHeads' code (longheads.md).
ELSEWHERE = ("scripts/synthetic.yaml", "scripts/data/", "scripts/eval/", "scripts/pred/", "docs/source/", "vllm/",
             "python/sglang/", "modeling_longheads/")
# the wheel's copy of recipes/, ds_configs/, assets/ and data/tiny (pyproject.toml), made when it is built
BUILT = "sparse_ft/_data"
PLACEHOLDER = re.compile(r"[*<>\[\]…]|\.\.\.|(?<![\w-])(?:[A-Z][A-Z_]*|my_\w+)(?![\w-])")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP)})/(?:\{{[^}}\s]*\}}|[^\s`'\"(),;|{{])*)")
DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)")
COMMAND = re.compile(r"(?:^|&&|;|\$|\|)\s*(sparse-ft(?: [a-z][\w-]*)*)", re.M)  # where a command starts
# a module by its path inside a package, e.g. bench/dca.py for sparse_ft/bench/dca.py
INNER = re.compile(rf"(?<![\w./-])((?!(?:{'|'.join(TOP)})/)(?:[a-z_]\w*/)+\w+\.py)\b")
IMPORT = re.compile(rf"^\s*from ((?:{'|'.join(PACKAGES)})[\w.]*) import \(?([\w, ]+)", re.M)
OUTPUT = re.compile(r"--(?:output|plot|heatmap) (\S+)")  # what a command the doc shows writes
RECIPE = re.compile(r"(?<![\w.-])recipe=([\w./-]+)")
EXAMPLE_NAME = re.compile(r"""^\s*name = ["'](\w+)["']""", re.M)
KINDS = {"path": PATH, "inner": INNER, "name": DOTTED, "command": COMMAND, "recipe": RECIPE}
# A diagram (a fence drawn with box characters) names modules by their path inside a package,
# ``rope.extend_to`` for sparse_ft.modeling.rope.extend_to.
DIAGRAM = re.compile(r"^```\n(?=[^`]*[─└▼])(.*?)^```", re.S | re.M)
SHORT = re.compile(r"(?<![\w./-])([a-z_]\w*(?:\.[A-Za-z_]\w*)+)")
FILE_SUFFIXES = {"json", "yaml", "yml", "md", "py", "txt", "bin", "sh"}


def _code(text: str) -> list[str]:
    """Fenced blocks and inline code spans: where the docs show names, paths and commands."""
    blocks = FENCE.findall(text)
    return blocks + SPAN.findall(FENCE.sub("", text))


def _braces(path: str) -> list[str]:
    """``a.{json,md}`` as ``a.json`` and ``a.md``."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


@functools.lru_cache(maxsize=None)
def _tree() -> frozenset[str]:
    """Files git tracks or would add (not ignored), and their folders."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\n")
    files = {f for f in listed if f and (ROOT / f).exists()}
    folders = {str(parent) for f in files for parent in Path(f).parents if str(parent) != "."}
    return frozenset(files | folders)


def _module_file(dotted: list[str]) -> Path | None:
    """The source file of the module ``dotted`` names, if it is one of the tree."""
    path = ROOT.joinpath(*dotted)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def _top_level(path: Path) -> dict[str, ast.AST]:
    """A module's top-level names (definitions, assignments, imports, ``__all__``) to their nodes."""
    tree = ast.parse(path.read_text())
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in getattr(node, "targets", [])):
                names.update({value: node for value in ast.literal_eval(node.value)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(alias.asname or alias.name).split(".")[0]: node for alias in node.names})
    return names


def _dotted_resolves(name: str) -> bool:
    """The longest module prefix is a file of the tree; the rest a top-level name of it (a
    class's own attribute after that), or, for a module with ``__getattr__``, an attribute once
    imported."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(parts[:cut])
        if path is not None:
            break
    rest = parts[cut:]
    if not rest:
        return True
    node = _top_level(path).get(rest[0])
    if node is not None and (len(rest) == 1 or not isinstance(node, ast.ClassDef)):
        return True
    if isinstance(node, ast.ClassDef):
        body = {getattr(n, "name", None) for n in node.body} | {
            t.id for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        if rest[1] in body:
            return True
    if "__getattr__" not in _top_level(path):  # no name made at import time (PEP 562)
        return False
    obj = importlib.import_module(".".join(parts[:cut]))
    try:
        for attr in rest:
            obj = getattr(obj, attr)
    except AttributeError:
        return False
    return True


def _in_code(text: str) -> list[tuple[str, str]]:
    """(kind, mention) of every path, dotted name, command and recipe shown in ``text``'s code."""
    found = [(kind, m.group(1))
             for code in _code(text) for kind, pattern in KINDS.items() for m in pattern.finditer(code)]
    found += [("short", m.group(1)) for diagram in DIAGRAM.findall(text) for m in SHORT.finditer(diagram)
              if m.group(1).split(".")[0] in _modules() and not m.group(1).startswith(PACKAGES)]
    return found + [("name", f"{m.group(1)}.{name.strip()}") for code in FENCE.findall(text)
                    for m in IMPORT.finditer(code) for name in m.group(2).split(",") if name.strip()]


@functools.lru_cache(maxsize=None)
def _modules() -> dict[str, list[str]]:
    """Each module's and package's last name to the dotted names of the modules so called."""
    found: dict[str, list[str]] = {}
    for f in sorted(_tree()):
        if f.startswith(PACKAGES) and f.endswith(".py") and not f.endswith("__main__.py"):
            dotted = f.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            found.setdefault(dotted.rsplit(".", 1)[-1], []).append(dotted)
    return found


def _mentions() -> list[tuple[str, str, str]]:
    """(doc, kind, mention) of every mention, relative links included, but the files a
    command the same doc shows writes (``--output results/x.json``)."""
    found = []
    for doc in DOCS:
        text, where = doc.read_text(), doc.relative_to(ROOT).as_posix()
        written = {path for code in _code(text) for path in OUTPUT.findall(code)}
        found += [(where, kind, mention) for kind, mention in _in_code(text) if mention not in written]
        found += [(where, "link", target) for target in LINK.findall(text)]
    return found


@functools.lru_cache(maxsize=None)
def _examples() -> frozenset[str]:
    """Names the docs' own walk-throughs register (``name = "toy_echo"``): their commands exist
    once the reader has added them."""
    return frozenset(name for doc in DOCS for code in FENCE.findall(doc.read_text())
                     for name in EXAMPLE_NAME.findall(code))


def _example(mention: str) -> bool:
    """A module or file of a walk-through's example (``attn_patterns/sink.py`` for ``name = "sink"``)."""
    return re.split(r"[./]", mention.removesuffix(".py"))[-1] in _examples()


@functools.lru_cache(maxsize=None)
def _parser():
    return build_parser()


def _subcommands(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _stale(doc: str, kind: str, text: str) -> str | None:
    """Why the mention does not resolve, or None."""
    if kind == "link":
        target = text.split("#")[0]
        if not target or "://" in target or target.startswith("mailto:"):
            return None
        resolved = ((ROOT / doc).parent / target).resolve()
        return None if resolved.exists() else f"links to {target}, which does not exist"
    if kind == "path":
        path = re.split(r"::|:(?=[A-Za-z_])", text.rstrip(".:"))[0].rstrip("/")
        if PLACEHOLDER.search(path) or path.startswith((*ELSEWHERE, BUILT)) or _example(path):
            return None
        missing = [p for p in _braces(path) if p not in _tree()]
        return f"names {', '.join(missing)}, not in the repository" if missing else None
    if kind == "inner":
        if text.startswith(ELSEWHERE) or any(f.endswith(f"/{text}") for f in _tree() if f.startswith(PACKAGES)):
            return None
        return f"names {text}, no module of {' or '.join(PACKAGES)}"
    if kind == "name":
        if text.rsplit(".", 1)[-1] in FILE_SUFFIXES or _example(text):  # a file name such as sparse_ft.json
            return None
        return None if _dotted_resolves(text) else f"names {text}, which does not resolve"
    if kind == "short":
        first, _, rest = text.partition(".")
        if text.rsplit(".", 1)[-1] in FILE_SUFFIXES or any(_dotted_resolves(f"{m}.{rest}") for m in _modules()[first]):
            return None
        return f"names {text}, which is no name of {' or '.join(_modules()[first])}"
    if kind == "recipe":
        if PLACEHOLDER.search(text):
            return None
        try:
            find_recipe(text)
        except (ValueError, FileNotFoundError):
            return f"names recipe={text}, which is no recipe"
        return None
    words, parser = text.split(), _parser()
    for depth, word in enumerate(words[1:3]):
        choices = _subcommands(parser)
        if not choices:
            return None
        if word not in choices:
            return None if depth and word in _examples() else f"runs {' '.join(words[:depth + 2])}, no such command"
        parser = choices[word]
    return None


def test_the_docs_mention_something_of_every_kind():
    kinds = {kind for _, kind, _ in _mentions()}
    assert kinds == {"path", "inner", "name", "short", "command", "recipe", "link"}


def test_every_name_path_command_and_recipe_in_the_docs_exists():
    stale = sorted({f"{doc}: {why}" for doc, kind, text in _mentions() if (why := _stale(doc, kind, text))})
    assert not stale, "\n".join(stale)


@pytest.mark.parametrize("text, expected", [
    ("`sparse_ft/bench/dca_prefill.py`", "names sparse_ft/bench/dca_prefill.py, not in the repository"),
    ("made by `bench/dca_prefill.py`", "names bench/dca_prefill.py, no module of sparse_ft or attn_patterns"),
    ("`sparse_ft.models.load_adapter_model`", "names sparse_ft.models.load_adapter_model, which does not resolve"),
    ("```\n  └─ models.load_adapter_model\n```", "names models.load_adapter_model, which is no name of "
     "sparse_ft.bench.models"),
    ("`sparse-ft frobnicate`", "runs sparse-ft frobnicate, no such command"),
    ("`sparse-ft bench frobnicate`", "runs sparse-ft bench frobnicate, no such command"),
    ("`train.py recipe=no_such_recipe`", "names recipe=no_such_recipe, which is no recipe"),
    ("```python\nfrom attn_patterns.patterns import no_such_name\n```",
     "names attn_patterns.patterns.no_such_name, which does not resolve"),
    ("`runs/x/checkpoint-400` `results/plan/<recipe>.md` `recipe=NAME` `recipe=OUTPUT_DIR/x.yaml`", None),
    ("`sparse-ft eval TASK` `scripts/data/synthetic/niah.py` `vllm/config/model.py`", None),
])
def test_a_stale_mention_is_found_and_a_placeholder_is_not(text, expected):
    found = [why for kind, mention in _in_code(text) if (why := _stale("README.md", kind, mention))]
    assert found == ([expected] if expected else [])
