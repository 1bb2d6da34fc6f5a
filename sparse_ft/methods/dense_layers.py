"""Full causal attention where it pays: in some layers while the others run the training
pattern (``attention.dense_layers``), and in every layer for the last steps of a run
(``train.dense_final_fraction``, a dense tail). MoBA and InfLLM-v2 report that either narrows
the gap between a model trained through a sparse pattern and the same model run with full
attention.

One method object routes each attention call by its layer's ``layer_idx``, so the model is
installed once, by the one installer (``install_method``), and the tail is a flag the trainer
sets (:attr:`DenseLayers.everywhere`), not a reinstall: validation, which reinstalls the
training method after its tasks, puts back the same object with the flag as it was. The dense
layers run the pattern ``causal`` on the training pattern's backend, which finds packed
documents and padding as the pattern does (the model's own attention would not, under the
toolkit's 2-D mask)."""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Optional, Union

import torch

from sparse_ft.methods.base import Method
from sparse_ft.methods.lookup import get

DenseSpec = Union[list, tuple, str]  # layer indices, or "last n"
_LAST = re.compile(r"last\s*(\d+)")
FORM = "a list of layer indices (e.g. [0, 5]) or 'last n' (e.g. 'last 2')"


def _last(spec: str) -> Optional[int]:
    found = _LAST.fullmatch(spec.strip().lower())
    return int(found.group(1)) if found else None


def dense_layers_rule(spec: Any, layers: Optional[int] = None) -> Optional[str]:
    """Why ``spec`` is no ``attention.dense_layers`` value (for a model of ``layers`` layers,
    when the count is known), None if it is one: its form where the count is not known yet (a
    recipe that loads), its range where it is (the model's config, before the weights load)."""
    within = "" if layers is None else f" (the model has {layers} layers)"
    if isinstance(spec, str):
        n = _last(spec)
        if n is None:
            return FORM
        if n < 1 or (layers is not None and n > layers):
            top = "the model's layers" if layers is None else layers
            return f"'last n' with n in [1, {top}]{within}"
        return None
    if not isinstance(spec, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
        return FORM
    top = "the model's layers - 1" if layers is None else layers - 1
    if any(i < 0 or (layers is not None and i >= layers) for i in spec) or len(set(spec)) < len(spec):
        return f"layer indices in [0, {top}], each once{within}, or 'last n'"
    return None


def dense_layers_option(text: str, flag: str, layers: Optional[int] = None) -> DenseSpec:
    """A command line's ``flag`` (``--dense-layers``: a comma list of indices, or 'last n') as
    ``attention.dense_layers`` takes it, checked by :func:`dense_layers_rule` (against the
    model's ``layers`` when known); ``ValueError`` "FLAG 'text' is invalid: why" otherwise."""
    try:
        spec: DenseSpec = text if text.strip().lower().startswith("last") else [int(i) for i in text.split(",") if i.strip()]
    except ValueError:
        spec = text  # neither form: the rule names both
    rule = dense_layers_rule(spec, layers)
    if rule is not None:
        raise ValueError(f"{flag} {text!r} is invalid: {rule}")
    return spec


def dense_layers_name(pattern: str, layers: DenseSpec) -> str:
    """``pattern`` with ``layers`` attending fully, as tables name it."""
    return f"{pattern} + full in {layers if isinstance(layers, str) else list(layers)}"


@functools.lru_cache(maxsize=64)
def _indices(spec: Union[tuple, str], layers: int) -> frozenset[int]:
    rule = dense_layers_rule(spec, layers)
    if rule is not None:
        raise ValueError(f"attention.dense_layers={spec!r}: {rule}")
    if isinstance(spec, str):
        return frozenset(range(layers - _last(spec), layers))
    return frozenset(spec)


def dense_layer_indices(spec: DenseSpec, layers: int) -> list[int]:
    """The indices ``spec`` names in a model of ``layers`` layers, sorted; ``ValueError`` naming
    the key when it names none of them."""
    return sorted(_indices(tuple(spec) if isinstance(spec, list) else spec, layers))


def dense_tail_start(fraction: float, steps: int) -> int:
    """The first step (0-based) a run of ``steps`` optimizer steps takes with full attention in
    every layer: ``ceil((1 - fraction) * steps)``, so the last ``fraction`` of the steps (``steps``
    itself for none). Rounded to 9 digits first: ``(1 - 0.3) * 10`` is 7.000000000000001 in
    floating point, and the tail of 3 steps must not become 2."""
    return math.ceil(round((1 - fraction) * steps, 9))


def num_layers(config: Any) -> int:
    """A model's decoder layers, from its config."""
    return int(config.num_hidden_layers)


class DenseLayers(Method):
    """``method`` in every layer but ``layers`` (a :data:`DenseSpec`), which attend fully
    (``dense``: the pattern ``causal``); every layer attends fully while :attr:`everywhere`."""

    def __init__(self, method: Method, dense: Method, layers: DenseSpec) -> None:
        self.method, self.dense = method, dense
        self.layers = tuple(layers) if isinstance(layers, list) else layers
        self.everywhere = False  # the dense tail: set by the trainer from its switch step on
        self.supports = method.supports

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.method.name

    def __repr__(self) -> str:
        return f"{self.method!r} with full attention in layers {self.layers!r}{' (every layer now)' if self.everywhere else ''}"

    @property
    def backend(self) -> Optional[str]:
        return self.method.backend

    def check_model(self, config: Any) -> None:
        self.method.check_model(config)
        self.dense.check_model(config)
        dense_layer_indices(self.layers, num_layers(config))

    def check_length(self, seq_len: int) -> None:
        self.method.check_length(seq_len)

    def check_device(self, device: str, dtype: torch.dtype) -> None:
        self.method.check_device(device, dtype)
        self.dense.check_device(device, dtype)

    def attends_fully(self, module: torch.nn.Module) -> bool:
        """Whether the attention layer ``module`` attends fully now."""
        return self.everywhere or module.layer_idx in _indices(self.layers, num_layers(module.config))

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, None]:
        chosen = self.dense if self.attends_fully(module) else self.method
        return chosen(module, query, key, value, attention_mask, **kwargs)


def with_dense_layers(method: Method, layers: DenseSpec) -> DenseLayers:
    """``method`` with full causal attention in ``layers`` (the pattern ``causal`` on
    ``method``'s backend), ready for a dense tail."""
    backend = method.backend
    return DenseLayers(method, get("causal", "pattern", **({} if backend is None else {"backend": backend})), layers)
