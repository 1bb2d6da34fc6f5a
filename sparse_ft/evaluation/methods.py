"""``--method``: what the model attends with at evaluation, applied per evaluated length.

* ``full`` — the model as loaded (an adapter's trained RoPE included);
* any attention-pattern name — the pattern through ``use_attention``. Training patterns
  (S2, SCCA, ...) define attention over a whole sequence, not for one decoded token against a
  KV cache, so passkey generation with them re-runs the whole prompt for every new token:
  exact, and cheap for a 5-digit answer. Patterns that implement KV-cache decoding
  (``attend_hf``: DCA, LongHeads) generate with the cache;
* ``pi`` / ``ntk`` / ``yarn`` — training-free RoPE scaling (transformers' ``linear``,
  ``dynamic`` and ``yarn`` rope types) through :func:`sparse_ft.rope.extend_to`: factor =
  evaluated length ÷ the model's current context, composed with any scaling it already has
  (an adapter's), and 1 — no change — within the context. ``--method-arg factor=F`` fixes the
  factor for every length instead (LongLoRA's eval scales by ``ceil(context / original)``);
* methods other modules provide (Dual Chunk Attention, LongHeads, ParallelComp): one line in
  :data:`PLUGINS`, or :func:`register` at import time.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable, Optional

import torch

import attn_patterns
from sparse_ft import rope
from sparse_ft.attention import use_attention

# name -> "module" (importing it registers an attention pattern of that name) or
# "module:factory" (factory(**method_args) returns a Method). Imported on first use only.
PLUGINS = {
    "dca": "attn_patterns.dca",
    "longheads": "attn_patterns.longheads",
    "parallelcomp": "sparse_ft.parallelcomp:method",
}


class Method:
    """Prepares ``model`` for sequences of ``length`` tokens (:meth:`apply`).

    ``generate(model, tokenizer, context_ids, question_ids, max_new_tokens) -> new ids``
    (optional) takes over passkey generation; None means transformers' ``generate`` with the
    KV cache. ``supports_ppl = False`` makes ``eval ppl`` refuse with ``why_no_ppl``."""

    name = "full"
    supports_ppl = True
    why_no_ppl = ""
    generate: Optional[Callable] = None

    def __init__(self, **params: Any) -> None:
        if params:
            raise ValueError(f"--method {self.name} takes no --method-arg; got {', '.join(sorted(params))}")

    def apply(self, model: torch.nn.Module, length: int) -> None:
        pass


class PatternMethod(Method):
    def __init__(self, name: str, **params: Any) -> None:
        self.name = name
        self.pattern = attn_patterns.get(name, **params)
        if not hasattr(self.pattern, "attend_hf"):
            self.generate = reprefill_generate

    def apply(self, model, length):
        use_attention(model, self.pattern)


class RopeMethod(Method):
    """The factor follows the evaluated length, so the configuration the model was loaded
    with (an adapter's included) is restored before each length and scaled from there."""

    KINDS = {"pi": "linear", "ntk": "dynamic", "yarn": "yarn"}

    def __init__(self, name: str, factor: Optional[float] = None) -> None:
        if factor is not None and not (isinstance(factor, (int, float)) and factor >= 1):
            raise ValueError(f"--method-arg factor={factor!r} must be a number >= 1")
        self.name, self.kind, self.factor = name, self.KINDS[name], factor
        self._loaded: Optional[tuple[dict, int]] = None

    def apply(self, model, length):
        base = _base(model)
        config = base.config
        if self._loaded is None:
            self._loaded = (rope.rope_parameters(config), config.max_position_embeddings)
        rope.restore(config, *self._loaded)
        if self.factor is None:
            rope.extend_to(config, length, self.kind)
        else:
            rope.scale_rope(config, float(self.factor), self.kind)
        rope.refresh_rotary(base)


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@torch.inference_mode()
def reprefill_generate(model, tokenizer, context_ids: list[int], question_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding without a KV cache: each new token from a forward over the whole
    sequence, so a pattern defined on whole sequences is applied exactly as defined."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(context_ids) + list(question_ids)], device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        new.append(token)
        if token == tokenizer.eos_token_id:
            break
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
    return new


_REGISTRY: dict[str, Callable[..., Method]] = {
    "full": Method,
    **{name: (lambda n: lambda **p: RopeMethod(n, **p))(name) for name in RopeMethod.KINDS},
}


def register(name: str, factory: Callable[..., Method]) -> None:
    """Make ``--method name`` build ``factory(**method_args)``."""
    _REGISTRY[name] = factory


def _plugin_available(name: str) -> bool:
    module = PLUGINS[name].partition(":")[0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _load_plugin(name: str) -> None:
    module, _, factory = PLUGINS[name].partition(":")
    loaded = importlib.import_module(module)
    if factory:
        register(name, getattr(loaded, factory))


def names() -> list[str]:
    plugins = {name for name in PLUGINS if _plugin_available(name)}
    return sorted(set(_REGISTRY) | set(attn_patterns.names()) | plugins)


def get(name: str, **params: Any) -> Method:
    """The method called ``name``; unknown names or parameters raise ValueError."""
    if name in PLUGINS and name not in _REGISTRY and name not in attn_patterns.names() and _plugin_available(name):
        _load_plugin(name)
    if name in _REGISTRY:
        try:
            return _REGISTRY[name](**params)
        except TypeError as err:
            raise ValueError(f"--method {name}: bad --method-arg ({err})") from None
    if name in attn_patterns.names():
        try:
            return PatternMethod(name, **params)
        except TypeError as err:
            raise ValueError(f"--method {name}: bad --method-arg ({err})") from None
    raise ValueError(f"--method {name!r} is unknown; allowed: {', '.join(names())}")


def apply_method(model: torch.nn.Module, name: str, eval_length: int, **params: Any) -> Method:
    """Switch ``model`` to method ``name`` for sequences of ``eval_length`` tokens."""
    method = get(name, **params)
    method.apply(model, eval_length)
    return method
