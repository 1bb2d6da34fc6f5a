"""docs/architecture.md, checked: the layers import only what the table allows, no module is
in an import cycle, and its two walkthroughs (a new pattern, a new training-free method) work end to end from one
registration each: use_attention, a recipe's training run and ``eval ppl``."""

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attn_patterns
from attn_patterns import Pattern
from attn_patterns.reference import dense_attention
from sparse_ft import methods, use_attention
from sparse_ft.cli import main
from sparse_ft.config import load_recipe
from sparse_ft.modeling.tiny import tiny_llama
from sparse_ft.train.trainer import train

ROOT = Path(__file__).resolve().parents[2]

# The layers of docs/architecture.md, lowest first, each a list of groups (a package or one
# module): a module may import its own group and lower layers, never a group beside it or a
# layer above. sparse_ft.modeling.attention sits below sparse_ft.methods: the seam is one-way.
LAYERS = [
    [("attn_patterns",), ("sparse_ft.console",)],
    [("sparse_ft.modeling.families",)],
    [("sparse_ft.modeling.rope",), ("sparse_ft.modeling.tiny",), ("sparse_ft.modeling.quantization",),
     ("sparse_ft.modeling.dtypes",), ("sparse_ft.modeling.attention",), ("sparse_ft.files.outputs",),
     ("sparse_ft.modeling.weight_files",), ("sparse_ft.modeling.devices",), ("sparse_ft.files.json_files",),
     ("sparse_ft.files.strict", "sparse_ft.files.keyvalue")],
    [("sparse_ft.methods",)],
    [("sparse_ft.modeling.model_io",), ("sparse_ft.data",)],
    [("sparse_ft.config",), ("sparse_ft.evaluation",)],  # recipes and evaluation know nothing of each other
    [("sparse_ft.train",)],  # validation during training runs the evaluation tasks
]


def _layer(module: str):
    for rank, layer in enumerate(LAYERS):
        for group in layer:
            if any(module == prefix or module.startswith(prefix + ".") for prefix in group):
                return rank, group
    return len(LAYERS), module  # applications: cli, merge, pretrain, experiment, bench


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted([*ROOT.glob("attn_patterns/**/*.py"), *ROOT.glob("sparse_ft/**/*.py")]):
        found[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, every import statement counted (inside
    functions and ``TYPE_CHECKING`` blocks too: a lazy import is still a dependency). An
    import of ``a.b.c`` is an edge to ``a.b.c``, the module whose code runs, and ``from a.b
    import c`` to ``a.b.c`` when that is a module, else to ``a.b``."""
    modules = _modules()

    def module_of(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(module_of(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets.update(module_of(f"{base}.{alias.name}") for alias in node.names)
        graph[module] = targets - {"", module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan): each holds at
    least one import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_every_module_imports_first():
    """No import cycle hides behind import order: each module imports in a fresh state."""
    import subprocess
    import sys

    names = [module for module in _modules() if not module.endswith("__main__")]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] in ('sparse_ft', 'attn_patterns')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_no_import_cycle_between_any_modules():
    """Checked module by module, so no group of the layer table can hide a cycle inside it."""
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_cycles_are_found():
    """The check itself: a lazy import back into a module's importer is a cycle."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_attention_imports_no_method():
    """The one-way seam: methods import the installer, which takes ready methods, knows no
    names and imports nothing of sparse_ft.methods, not even inside a function."""
    graph = _import_graph()
    assert "sparse_ft.modeling.attention" in graph["sparse_ft.methods.base"]
    assert not {t for t in graph["sparse_ft.modeling.attention"] if t.startswith("sparse_ft.methods")}


def test_layers_import_only_what_the_architecture_allows():
    """A module of a layer imports its own group and lower layers: never a group beside it, a
    layer above, or an application (the command line, the experiment, the benchmarks)."""
    wrong = []
    for module, targets in _import_graph().items():
        rank, group = _layer(module)
        for target in targets:
            t_rank, t_group = _layer(target)
            if t_group != group and t_rank >= rank and (t_rank < len(LAYERS) or rank < len(LAYERS)):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(set(wrong)))


# --- walkthrough 1: a pattern ------------------------------------------------------------------
class ToySink(Pattern):
    """The first key and the last ``window`` keys."""

    name = "toy_sink"

    def __init__(self, window: int = 8, backend=None):
        super().__init__(backend, window=window)
        self.window = window

    def rule(self, h, i, j, *, n, num_heads):
        return (j == 0) | (i - j < self.window)

    def forward(self, q, k, v, backend):  # a toy's fast path: the dense reference itself
        return dense_attention(q, k, v, self.mask(q.shape[2], q.shape[1]))


# --- walkthrough 2: a training-free method -----------------------------------------------------
class ToyWindow(methods.Method):
    """Causal attention over the last ``size`` keys, KV cache included."""

    name = "toy_window"
    supports = methods.Supports(training=False, ppl=True, kv_cache=True, padding=("right",))

    def __init__(self, size: int = 512):
        self.size = size

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        self.check_inputs(attention_mask, dropout)
        nq, nk = query.shape[2], key.shape[2]
        i = torch.arange(nk - nq, nk)[:, None]
        j = torch.arange(nk)[None, :]
        groups = query.shape[1] // key.shape[1]
        out = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                             attn_mask=(j <= i) & (i - j < self.size), scale=scaling)
        return out.transpose(1, 2).contiguous(), None


@pytest.fixture
def registered():
    attn_patterns.register(ToySink)
    methods.register(ToyWindow)
    yield
    attn_patterns.PATTERNS.remove("toy_sink")
    methods.METHODS.remove("toy_window")


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_new_pattern_and_method_reach_every_user_facing_path(registered, tmp_path, capsys):
    model = tiny_llama()
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    full = _logits(model, ids)
    assert {"toy_sink", "toy_window"} <= set(methods.names())
    # use_attention: both equal full attention while every key is in the window, and differ outside it
    for name, wide, narrow in (("toy_sink", {"window": 40}, {"window": 4}), ("toy_window", {"size": 40}, {"size": 4})):
        torch.testing.assert_close(_logits(use_attention(model, name, **wide), ids), full, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(_logits(use_attention(model, name, **narrow), ids), full, atol=1e-3)
    use_attention(model, "full")
    # a recipe trains through the pattern and refuses the method, which cannot train
    out = tmp_path / "run"
    recipe = load_recipe("tiny", [f"train.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", "train.report_to=[none]",
                                  "deepspeed=null", "train.max_steps=2", "attention.pattern=toy_sink",
                                  "attention.params={window: 16}"])
    summary = train(recipe)
    assert summary["steps"] == 2 and summary["final_loss"] > 0
    assert json.loads((out / "adapter" / "sparse_ft.json").read_text())["train_attention"] == {"pattern": "toy_sink", "window": 16}
    with pytest.raises(ValueError, match="toy_window.*cannot train"):
        load_recipe("tiny", ["deepspeed=null", "attention.pattern=toy_window", "attention.params={}"])
    # eval ppl takes the method by name, with its parameter
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    capsys.readouterr()
    assert main(["eval", "ppl", "--model", "tiny", "--data", str(text), "--lengths", "64", "--method", "toy_window",
                 "--method-arg", "size=16"]) == 0
    assert "| 64 |" in capsys.readouterr().out


def test_no_function_takes_more_than_four_positional_parameters():
    """docs/architecture.md, Conventions: the rest are keyword-only, so a call names what it
    passes. The exceptions are the five arguments transformers passes an attention function,
    Triton kernels (``@triton.jit`` takes no keyword-only parameters) and an autograd
    Function's ``forward(ctx, ...)``, which torch calls positionally."""
    attention_call = ("module", "query", "key", "value", "attention_mask")
    wrong = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                jit = any(getattr(d, "attr", None) == "jit" for d in node.decorator_list)
                autograd = node.name in ("forward", "backward") and names[:1] == ["ctx"]
                if len(names) > 4 and tuple(names) != attention_call and not jit and not autograd:
                    wrong.append(f"{module}.{node.name}({', '.join(names)})")
    assert not wrong, wrong
