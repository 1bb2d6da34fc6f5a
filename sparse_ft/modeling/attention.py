"""Install a ready method into any transformers causal LM through its AttentionInterface.

No model class is patched: one attention function named ``sparse_ft`` is registered with
transformers, the model is switched to it with its own ``set_attn_implementation``, and each
attention layer carries the method it uses (so two models in one process can differ). The
mask interface hands the function the 2-D padding mask instead of an N×N one.

The seam is one-way: ``sparse_ft.methods`` imports this module, never the reverse. This
module installs objects and knows no names; turning a name into a method is the methods'
job (``sparse_ft.methods.get``), and ``sparse_ft.use_attention`` does both in one call.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Protocol

import torch

IMPLEMENTATION = "sparse_ft"
_METHOD_ATTR = "_sparse_ft_method"
_ORIGINAL_ATTR = "_sparse_ft_original_attn"


class AttentionMethod(Protocol):
    """What the installer needs of a method (``sparse_ft.methods.Method`` is one), stated
    here so that this module needs nothing above it. transformers calls the method as its
    attention function, the first five arguments positionally."""

    name: str
    replaces_attention: bool  # False: the model's own attention runs, restored on install

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, None]: ...

    def check_model(self, config: Any) -> None: ...


class AttentionNotCalled(ValueError):
    """A layer the toolkit's method was installed on did not call it (the model attended
    another way), or runs the toolkit's attention function with no method."""


def sparse_ft_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls: the layer's method does the work."""
    return _method_of(module)(module, query, key, value, attention_mask, **kwargs)


def _method_of(module: torch.nn.Module) -> AttentionMethod:
    method = getattr(module, _METHOD_ATTR, None)
    if method is None:
        raise AttentionNotCalled(
            f"{type(module).__name__} runs attn_implementation={IMPLEMENTATION!r} but has no method; "
            "switch models with sparse_ft.use_attention(model, name)"
        )
    return method


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, sparse_ft_attention)
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import flash_attention_mask
    except ImportError:  # transformers < 4.53 builds its own 4-D mask; the pattern adapter reads it
        return
    AttentionMaskInterface.register(IMPLEMENTATION, flash_attention_mask)


# --- switching a model ----------------------------------------------------------------------
def pretrained(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers PreTrainedModel inside a possible PEFT / DeepSpeed wrapper, whose config
    and rotary embeddings are the ones to read and change; a model that contains none is
    returned as it is. The one unwrapping helper of the toolkit."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Self-attention modules: the ones transformers calls the attention interface from."""
    layers = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "head_dim") and hasattr(m, "config")]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no attention layers calling transformers' AttentionInterface "
            "(modules with layer_idx, head_dim and config); sparse-ft supports Llama-style decoder models"
        )
    return layers


def _check_supported(base: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    if not any(hasattr(m, "inv_freq") for m in base.modules()):
        raise ValueError(
            f"{type(base).__name__} has no rotary embedding (no module with inv_freq): sparse-ft patterns are for "
            "RoPE models such as Llama, Mistral and Qwen2"
        )
    if not getattr(base.config, "is_causal", True) or not all(getattr(m, "is_causal", True) for m in layers):
        raise ValueError(f"{type(base).__name__} has non-causal attention layers; patterns are for causal decoders")


def install_method(model: torch.nn.Module, method: AttentionMethod) -> torch.nn.Module:
    """Switch every attention layer of ``model`` to a ready ``method``. A method that leaves
    attention to the model (``replaces_attention = False``: the method ``full``, RoPE
    scaling) switches back to the model's own implementation (sdpa, eager, ...), whose
    logits are then bit-identical to before. Names go through ``sparse_ft.use_attention``.
    Returns the model."""
    from transformers import PreTrainedModel

    if not (callable(method) and hasattr(method, "replaces_attention") and hasattr(method, "check_model")):
        raise ValueError(
            f"sparse_ft.modeling.attention.install_method installs a ready method (a sparse_ft.methods.Method), got {method!r}; "
            "a name or a pattern goes through sparse_ft.use_attention(model, name, **params)"
        )
    base = pretrained(model)
    if not isinstance(base, PreTrainedModel):
        raise ValueError(f"{type(model).__name__} contains no transformers PreTrainedModel")
    layers = attention_layers(base)
    _check_supported(base, layers)
    method.check_model(base.config)  # fail now, not mid-forward
    if not method.replaces_attention:
        restore_own_attention(model)
        return model
    _register()
    current = base.config._attn_implementation
    if current != IMPLEMENTATION:
        setattr(base, _ORIGINAL_ATTR, current)
        _set_implementation(base, IMPLEMENTATION)
    for layer in layers:
        setattr(layer, _METHOD_ATTR, method)
    return model


def restore_own_attention(model: torch.nn.Module) -> None:
    """Drop any method installed in ``model``: its own implementation (sdpa, eager, ...) again,
    logits bit-identical to never having switched. A no-op on a model that never had one,
    whatever its architecture (the method ``full`` evaluates any model)."""
    base = pretrained(model)
    for layer in base.modules():
        if hasattr(layer, _METHOD_ATTR):
            delattr(layer, _METHOD_ATTR)
    original = getattr(base, _ORIGINAL_ATTR, None)
    if original is not None:
        _set_implementation(base, original)
        delattr(base, _ORIGINAL_ATTR)


def _set_implementation(model, implementation: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(implementation)
    else:  # older transformers: the layers read config._attn_implementation at every call
        model.config._attn_implementation = implementation


def current_method(model: torch.nn.Module) -> Optional[AttentionMethod]:
    """The method the model's layers use, or None for the model's own attention."""
    return getattr(attention_layers(pretrained(model))[0], _METHOD_ATTR, None)


# --- the method installed is the method that ran --------------------------------------------
class _Counted:
    """A layer's method while :func:`checked_calls` counts its calls; anything else read from
    it is the method's."""

    def __init__(self, method: AttentionMethod) -> None:
        self.method = method
        self.calls = 0

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, None]:
        self.calls += 1
        return self.method(module, query, key, value, attention_mask, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.method, name)


@contextmanager
def checked_calls(model: torch.nn.Module, *, when: str) -> Iterator[None]:
    """Raise :class:`AttentionNotCalled` after the block (a forward) unless every attention
    layer of ``model`` called the method installed in it. A library that picks its own
    backend (the model switched back to sdpa, a layer replaced) would otherwise route
    attention around the method and train or score another kernel with no error (axolotl
    PR #3928). Each layer's method is wrapped in a counter for the block only, so later
    forwards cost nothing; a model running its own attention (``full``) is not checked."""
    layers = attention_layers(pretrained(model))
    counters = {layer: _Counted(getattr(layer, _METHOD_ATTR)) for layer in layers if hasattr(layer, _METHOD_ATTR)}
    if not counters:
        yield
        return
    for layer, counter in counters.items():
        setattr(layer, _METHOD_ATTR, counter)
    try:
        yield
    finally:
        for layer, counter in counters.items():
            if getattr(layer, _METHOD_ATTR, None) is counter:  # not if the block switched methods itself
                setattr(layer, _METHOD_ATTR, counter.method)
    missed = [layer for layer in layers if layer not in counters or counters[layer].calls == 0]
    if missed:
        method = next(iter(counters.values())).method
        ran = sorted({f"{type(layer).__name__} with attn_implementation={getattr(layer.config, '_attn_implementation', None)!r}"
                      for layer in missed})
        raise AttentionNotCalled(
            f"{when}: attention layer(s) {', '.join(str(layer.layer_idx) for layer in missed)} of {len(layers)} did not "
            f"call the installed method {method.name!r} (they ran {'; '.join(ran)}): something switched the model's "
            "attention or replaced those layers after sparse-ft installed it, so another kernel would run"
        )


class FirstForwardCheck:
    """:func:`checked_calls` around the first forward of ``model``'s decoder (what the causal
    LM's forward, generation and the chunked scoring all run) that runs with a method
    installed, through two hooks removed after it: evaluation's check, whose tasks install
    their method per length inside."""

    def __init__(self, model: torch.nn.Module, *, when: str) -> None:
        self.model = model
        self.when = when
        self.check: Optional[Any] = None  # the open check of the forward in progress
        base = pretrained(model)
        self.layers = attention_layers(base)
        decoder = base.get_decoder()
        self.hooks = [decoder.register_forward_pre_hook(self._enter), decoder.register_forward_hook(self._leave)]

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if any(hasattr(layer, _METHOD_ATTR) for layer in self.layers):
            self.check = checked_calls(self.model, when=self.when)
            self.check.__enter__()

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.check is not None:
            for hook in self.hooks:
                hook.remove()
            self.check.__exit__(None, None, None)
