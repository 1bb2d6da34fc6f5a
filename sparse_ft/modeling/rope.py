"""RoPE scaling through transformers' own configuration (4.x ``rope_scaling``, 5.x
``rope_parameters``), so that a saved model or adapter carries its final positions and every
RoPE model that transformers supports works without model-specific code.

Composition rule (the thing LongLoRA gets wrong by overwriting): extending a model whose
config says it handles ``M = max_position_embeddings`` tokens to ``T`` tokens multiplies the
scaling it already has by ``T / M``. A model already extended by linear factor 2 to 8k and
extended again to 16k ends with factor 4, not 2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # no torch at import: recipes and command-line parsers read METHODS
    import torch

# The ways sparse-ft extends RoPE, one table: each is the transformers rope_type it writes
# (what ``model.rope_method`` and ``sparse-ft experiment --rope-method`` accept, and what the
# training-free methods pi / ntk / yarn write), with the name result tables give it.
METHODS = {"linear": "PI", "dynamic": "dynamic NTK", "yarn": "YaRN"}
# RoPE types whose frequencies change with the input length: keys rotated at an earlier call
# (the KV cache) cannot be re-positioned exactly with other frequencies.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _uses_rope_parameters(config: Any) -> bool:
    """transformers 5.x keeps everything in ``rope_parameters``; 4.x in ``rope_scaling``."""
    return isinstance(getattr(config, "rope_parameters", None), dict)


def rope_parameters(config: Any) -> dict[str, Any]:
    """Normalised view of a config's RoPE: ``rope_type``, ``factor``, ``rope_theta`` and any
    other keys the config carries, identical for transformers 4.x and 5.x."""
    if _uses_rope_parameters(config):
        params = dict(config.rope_parameters)
        if params and all(isinstance(v, dict) for v in params.values()):
            raise ValueError(
                "rope_parameters is per layer type "
                f"({sorted(params)}); sparse-ft supports models with one RoPE configuration"
            )
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.pop("type", "default")) or "default"
    params.pop("type", None)
    params.setdefault("factor", 1.0)
    return params


def original_context(config: Any) -> int:
    """Pretraining context before any RoPE scaling."""
    params = rope_parameters(config)
    return int(params.get("original_max_position_embeddings") or config.max_position_embeddings)


def context_length(config: Any) -> int:
    """The context the config says the model handles now, existing scaling included."""
    return int(config.max_position_embeddings)


def _write(config: Any, params: dict[str, Any]) -> None:
    if _uses_rope_parameters(config):
        config.rope_parameters = params
        return
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    scaling["type"] = scaling["rope_type"]  # transformers < 4.45 reads "type"
    config.rope_scaling = None if scaling["rope_type"] == "default" else scaling


def restore(config: Any, params: dict[str, Any], max_position_embeddings: int) -> None:
    """Put back a RoPE configuration saved with an adapter (see :func:`rope_parameters`)."""
    _write(config, dict(params))
    config.max_position_embeddings = int(max_position_embeddings)


def scale_rope(config: Any, factor: float, method: str = "linear") -> dict[str, Any]:
    """Multiply the model's RoPE scaling by ``factor`` with ``method``; returns the new
    parameters, written into ``config`` in its own format. Call :func:`refresh_rotary` on a
    loaded model afterwards."""
    if method not in METHODS:
        raise ValueError(f"rope method={method!r} is not supported; allowed: {', '.join(METHODS)}")
    if not factor >= 1.0:
        raise ValueError(f"rope factor={factor} must be >= 1 (RoPE scaling only extends the context)")
    params = rope_parameters(config)
    current = params["rope_type"]
    if current not in ("default", method):  # compositions stay exact only within one kind
        raise ValueError(
            f"cannot compose rope method={method!r} with the model's existing rope_type={current!r}: "
            f"{method!r} composes only with 'default' or {method!r} scaling"
        )
    if factor == 1.0 and current == "default":
        return params
    old_context = context_length(config)
    params["original_max_position_embeddings"] = original_context(config)
    params["rope_type"] = method
    params["factor"] = float(params["factor"]) * float(factor)
    _write(config, params)
    if method != "dynamic":
        # dynamic NTK reads max_position_embeddings as the length where it starts to act.
        config.max_position_embeddings = int(round(old_context * factor))
    return params


def extend_to(config: Any, target_length: int, method: str = "linear") -> dict[str, Any]:
    """Extend the model to ``target_length`` tokens: factor = target ÷ current context,
    composed with any scaling it has. Within the current context nothing changes."""
    if not isinstance(target_length, int) or target_length < 1:
        raise ValueError(f"target_length={target_length!r} must be a positive integer")
    factor = max(1.0, target_length / context_length(config))
    return scale_rope(config, factor, method)


def refresh_rotary(model: torch.nn.Module) -> int:
    """Rebuild every rotary-embedding module of a loaded model from its (mutated) config,
    because transformers computes the frequencies once at construction. Returns how many
    modules were rebuilt; a model with none is not a RoPE model and gets a ValueError."""
    rebuilt = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not (hasattr(child, "inv_freq") and hasattr(child, "config")):
                continue
            # Constructor signatures differ across versions; all take the config.
            fresh = type(child)(config=child.config).to(child.inv_freq.device)
            setattr(parent, name, fresh)
            rebuilt += 1
    if rebuilt == 0:
        raise ValueError(
            f"{type(model).__name__} has no rotary-embedding module (no `inv_freq` buffer): "
            "sparse-ft's RoPE scaling needs a RoPE model"
        )
    return rebuilt


def rope_inv_freq(config: Any, method: str = "re-positioning") -> torch.Tensor:
    """The inverse frequencies a transformers model rotates with, computed from its config
    exactly as its rotary module does, for the methods that re-position rotated keys (DCA,
    LongHeads: ``attn_patterns.rotary.rotate``). Length-dependent scalings (dynamic NTK,
    LongRoPE) are refused: cached keys could not be re-positioned exactly."""
    from attn_patterns.rotary import default_inv_freq

    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise ValueError(
            f"{method}: rope_type={rope_type!r} changes RoPE frequencies with the input length, so keys cannot be "
            "re-positioned exactly; load the model without it (or use linear / yarn / llama3 scaling)"
        )
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"{method}: rope_type={rope_type!r} is unknown to transformers; allowed: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
        return ROPE_INIT_FUNCTIONS[rope_type](config, None)[0].float()
    from sparse_ft.modeling.families import geometry

    dim = int(geometry(config).head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    return default_inv_freq(dim, params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
