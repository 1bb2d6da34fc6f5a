"""sparse-ft: extend the context of RoPE language models.

Heavy imports (transformers, deepspeed) stay inside the submodules so that
``import sparse_ft`` and the CLI's ``--help`` are instant.
"""

from typing import Any

__version__ = "0.1.0"


def use_attention(model: Any, name: Any, **params: Any) -> Any:
    """Switch every attention layer of a loaded transformers model to pattern ``name``."""
    from sparse_ft.attention import use_attention as _use_attention

    return _use_attention(model, name, **params)


__all__ = ["use_attention", "__version__"]
