"""RoPE scaling through transformers' own configuration (4.x ``rope_scaling``, 5.x
``rope_parameters``), so that a saved model or adapter carries its final positions and every
RoPE model that transformers supports works without model-specific code.

Composition rule (the thing LongLoRA gets wrong by overwriting): extending a model whose
config says it handles ``M = max_position_embeddings`` tokens to ``T`` tokens multiplies the
scaling it already has by ``T / M``. A model already extended by linear factor 2 to 8k and
extended again to 16k ends with factor 4, not 2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # no torch at import: recipes and command-line parsers read SCALINGS
    import torch

# The ways sparse-ft extends RoPE, one table: each is the transformers rope_type it writes
# (what ``model.rope_method`` and ``sparse-ft experiment --rope-method`` accept, and what the
# training-free methods pi / ntk / yarn write), with the name result tables give it.
SCALINGS = {"linear": "PI", "dynamic": "dynamic NTK", "yarn": "YaRN"}
# The largest RoPE scaling factor (target length / the model's pretraining context, composed
# with any scaling it has) sparse-ft writes: published extensions go to 16-32x (PI: LLaMA 2k to
# 32k; YaRN: Llama 2 4k to 128k), so 64x is twice the furthest, and a factor past it is a length
# typed wrong, not an extension anyone has shown to work (it is refused, with no key to force it).
MAX_FACTOR = 64
# RoPE types whose frequencies change with the input length: keys rotated at an earlier call
# (the KV cache) cannot be re-positioned exactly with other frequencies.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


# The keys transformers takes for each rope_type (5.x ``RotaryEmbeddingConfigMixin._validate_*_rope_parameters``
# in ``transformers/modeling_rope_utils.py``; 4.x's ``rope_scaling`` takes the same less ``rope_theta``, which it
# keeps at the top level). Any other key draws "Unrecognized keys in `rope_parameters`" when the config is
# loaded; sparse-ft keeps ``original_max_position_embeddings`` in memory for every type (``original_context``),
# and :func:`portable` drops it where transformers does not take it, for configs written for others.
TRANSFORMERS_KEYS = {
    "default": {"rope_type", "rope_theta"},
    "linear": {"rope_type", "factor", "rope_theta"},
    "dynamic": {"rope_type", "factor", "rope_theta"},
    "yarn": {"rope_type", "factor", "original_max_position_embeddings", "rope_theta", "attention_factor",
             "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"},
    "longrope": {"rope_type", "short_factor", "long_factor", "original_max_position_embeddings", "rope_theta",
                 "attention_factor", "factor"},
    "llama3": {"rope_type", "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
               "rope_theta"},
}
_EVERY_TYPE_KEYS = {"partial_rotary_factor"}  # taken by every rope_type


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
    """Pretraining context before any RoPE scaling; a config that says none is refused (every
    length the evaluation and the extension methods derive, C and its multiples, starts here)."""
    params = rope_parameters(config)
    known = params.get("original_max_position_embeddings") or getattr(config, "max_position_embeddings", None)
    if not known:
        raise ValueError(f"the model's config ({type(config).__name__}) has no max_position_embeddings: its pretraining "
                         "context is unknown; set max_position_embeddings in its config.json")
    return int(known)


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


def portable(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` (as :func:`rope_parameters` gives them) with only the keys transformers takes
    for their ``rope_type``; a type it does not list here keeps every key."""
    allowed = TRANSFORMERS_KEYS.get(params.get("rope_type", "default"))
    return dict(params) if allowed is None else {k: v for k, v in params.items() if k in allowed | _EVERY_TYPE_KEYS}


def make_portable(config: Any) -> None:
    """Rewrite ``config``'s RoPE with only the keys transformers takes (:func:`portable`), so
    that a config saved from it loads without a warning in transformers 4.x and 5.x."""
    _write(config, portable(rope_parameters(config)))


def restore(config: Any, params: dict[str, Any], max_position_embeddings: int) -> None:
    """Put back a RoPE configuration saved with an adapter (see :func:`rope_parameters`)."""
    _write(config, dict(params))
    config.max_position_embeddings = int(max_position_embeddings)


def scale_rope(config: Any, factor: float, method: str = "linear") -> dict[str, Any]:
    """Multiply the model's RoPE scaling by ``factor`` with ``method``; returns the new
    parameters, written into ``config`` in its own format. Call :func:`refresh_rotary` on a
    loaded model afterwards."""
    if method not in SCALINGS:
        raise ValueError(f"rope method={method!r} is not supported; allowed: {', '.join(SCALINGS)}")
    if not factor >= 1.0:
        raise ValueError(f"rope factor={factor} must be >= 1 (RoPE scaling only extends the context)")
    check_factor(config, factor)
    params = rope_parameters(config)
    if factor == 1.0:  # within the model's context (Llama-3.1's llama3 128k at 64k): nothing to compose
        return params
    current = params["rope_type"]
    if current not in ("default", method):  # compositions stay exact only within one kind
        raise ValueError(
            f"cannot compose rope method={method!r} with the model's existing rope_type={current!r}: "
            f"{method!r} composes only with 'default' or {method!r} scaling"
        )
    old_context = context_length(config)
    params["original_max_position_embeddings"] = original_context(config)
    params["rope_type"] = method
    params["factor"] = float(params["factor"]) * float(factor)
    _write(config, params)
    if method != "dynamic":
        # dynamic NTK reads max_position_embeddings as the length where it starts to act.
        config.max_position_embeddings = int(round(old_context * factor))
    return params


def check_factor(config: Any, factor: float) -> None:
    """Refuse scaling ``config``'s RoPE by ``factor`` when that, composed with the scaling it
    has, goes past :data:`MAX_FACTOR`; what :func:`scale_rope` does first, and a run's
    preflight with :func:`extension_factor`, before any weights load."""
    has = float(rope_parameters(config)["factor"])
    total = has * float(factor)
    if total > MAX_FACTOR:
        context = original_context(config)
        # the longest length extend_to takes: the context it scales from times what is left of the limit
        longest = int(context_length(config) * MAX_FACTOR / has)
        raise ValueError(f"RoPE factor {total:,.6g} (the model's pretraining context of {context:,} tokens extended "
                         f"{total:,.6g}x) is above {MAX_FACTOR}: published PI / YaRN extensions reach 16-32x; at most "
                         f"{longest:,} tokens on this model")


def extension_factor(config: Any, target_length: int) -> float:
    """The factor :func:`extend_to` scales by: target ÷ current context, 1 within it."""
    return max(1.0, target_length / context_length(config))


def set_native_length(config: Any, native_length: Optional[int]) -> None:
    """Take ``native_length`` as the context the model was pretrained at, where its config says
    more without saying how (Qwen2.5-7B's config.json: 131,072; pretrained at 32,768 and
    extended by YaRN, per its model card): :func:`extend_to` then scales from it. ``None``
    keeps the config's ``max_position_embeddings``. A model that already carries RoPE scaling
    states its own window (``original_max_position_embeddings``) and is refused."""
    if native_length is None:
        return
    params, context = rope_parameters(config), context_length(config)
    if params["rope_type"] != "default":
        raise ValueError(f"native_length={native_length} is for a model with plain RoPE; this one has "
                         f"rope_type={params['rope_type']!r}, which states its own pretraining window")
    if not isinstance(native_length, int) or not 1 <= native_length <= context:
        raise ValueError(f"native_length={native_length!r} must be a positive integer up to the config's "
                         f"max_position_embeddings={context:,}")
    config.max_position_embeddings = native_length


def extend_to(config: Any, target_length: int, method: str = "linear", native_length: Optional[int] = None) -> dict[str, Any]:
    """Extend the model to ``target_length`` tokens: factor = target ÷ current context (or
    ÷ ``native_length``, :func:`set_native_length`), composed with any scaling it has. Within
    the context nothing changes."""
    if not isinstance(target_length, int) or target_length < 1:
        raise ValueError(f"target_length={target_length!r} must be a positive integer")
    set_native_length(config, native_length)
    return scale_rope(config, extension_factor(config, target_length), method)


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
            raise ValueError(f"{method}: rope_type={rope_type!r} is unknown to transformers; "
                             f"allowed: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
        return ROPE_INIT_FUNCTIONS[rope_type](config, None)[0].float()
    from sparse_ft.modeling.families import geometry

    dim = int(geometry(config).head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    return default_inv_freq(dim, params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
