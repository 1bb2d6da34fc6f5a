"""sparse-ft: extend the context of RoPE language models.

Heavy imports (transformers, deepspeed) stay inside the submodules so that
``import sparse_ft`` and the CLI's ``--help`` are instant.
"""

from typing import Any

__version__ = "0.1.0"


def use_attention(model: Any, spec: Any, **params: Any) -> Any:
    """Switch every attention layer of a loaded transformers model to ``spec``: a name with
    ``params`` (any of ``sparse_ft.methods.names()``), a Method, or a Pattern object.
    ``"full"`` switches back to the model's own attention, logits bit-identical to before.
    Returns the model. The name is resolved by the methods, the method installed by
    ``sparse_ft.modeling.attention``, which knows no names."""
    from sparse_ft import methods
    from sparse_ft.modeling import attention

    return attention.install_method(model, methods.as_method(spec, "pattern", **params))


def load(adapter_dir: Any, base: Any = None, **kwargs: Any) -> Any:
    """An adapter written by ``sparse-ft train`` over its base, with the RoPE configuration it
    was trained with and the base's weights checked: ``sparse_ft.modeling.model_io.load_adapter_model``
    (``kwargs``: its dtype, trust_remote_code, allow_other_base, from_pretrained arguments)."""
    from sparse_ft.modeling.model_io import load_adapter_model

    return load_adapter_model(adapter_dir, base, **kwargs)


__all__ = ["load", "use_attention", "__version__"]
