"""Every way the toolkit can make a model attend, behind one protocol (:class:`Method`):

* the model's own attention (``full``) and every pattern of ``attn_patterns`` (S², SCCA,
  SDA, LongMixed, ``causal`` on the toolkit's kernels, ... and patterns registered later),
  the latter through one adapter (:class:`PatternMethod`): the training patterns;
* the training-free methods, one module each: Dual Chunk Attention (``dca``), LongHeads,
  ParallelComp, and PI / NTK / YaRN (``rope_scaling``).

    >>> from sparse_ft import methods
    >>> methods.names()                        # what recipes, --method and the experiment accept
    >>> method = methods.get("dca", chunk_size=192)
    >>> method.supports.training, method.supports.ppl
    >>> sparse_ft.use_attention(model, method)

A new method is one module with a ``@register``-ed :class:`Method` subclass, imported below
(docs/architecture.md walks through it). Names are resolved in :mod:`sparse_ft.methods.lookup`;
methods install themselves through ``sparse_ft.modeling.attention``, which never imports this package.
"""

from __future__ import annotations

from sparse_ft.methods.base import (METHODS, AlgorithmMethod, Method, Sampling, Supports, cached_generate, register,
                                    reprefill_generate)
from sparse_ft.methods.lookup import (as_method, check, check_training, for_training, get, names, supports,
                                      trainable_names)
from sparse_ft.methods.pattern import ModelAttention, PatternMethod
from sparse_ft.methods.dense_layers import (DenseLayers, dense_layer_indices, dense_layers_name, dense_layers_option,
                                            dense_layers_rule, dense_tail_start, with_dense_layers)

# the modules whose methods register themselves on import, in the order tables list them
from sparse_ft.methods import rope_scaling as _rope_scaling  # noqa: E402,F401
from sparse_ft.methods import dca as _dca  # noqa: E402,F401
from sparse_ft.methods import longheads as _longheads  # noqa: E402,F401
from sparse_ft.methods import parallelcomp as _parallelcomp  # noqa: E402,F401

__all__ = ["METHODS", "AlgorithmMethod", "DenseLayers", "Method", "ModelAttention", "PatternMethod", "Sampling", "Supports", "as_method",
           "cached_generate", "check", "check_training", "dense_layer_indices", "dense_layers_name", "dense_layers_option",
           "dense_layers_rule", "dense_tail_start",
           "for_training", "get", "names", "register", "reprefill_generate", "supports", "trainable_names", "with_dense_layers"]
