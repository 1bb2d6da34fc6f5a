"""Dual Chunk Attention inside a transformers model (the maths: ``attn_patterns.dca``).

One path serves prefill, chunked prefill and cached decoding: the call's ``Nq`` queries are
the last of ``Nk`` positions, everything rotated at its true position with the model's own
RoPE frequencies (so DCA composes with any scaling in them), and DCA needs no state. Each
sequence of a padded batch (left padding, as ``generate`` pads) and each document of a
packed row runs alone, counted from its own first token (:mod:`sparse_ft.methods.sequences`).
The model supplies what the pure algorithm cannot know: ``c`` defaults to the context it
handles now (``config.max_position_embeddings``) and the frequencies come from its config.

Models that ship DCA (Qwen2.5-1M, Qwen3-2507) say so in ``dual_chunk_attention_config``,
which transformers keeps as a plain attribute and never reads: without this, such a model
silently runs plain attention. Asked for ``dca`` with no variant (or ``variant="qwen"``),
the method takes that config's values as the serving engines do; parameters the user gives
override them one by one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Optional

import torch

from attn_patterns.dca import DualChunkAttention, dca_attention
from attn_patterns.kernels import LSE_BACKENDS
from sparse_ft.methods.base import AlgorithmMethod, Supports, register
from sparse_ft.methods.sequences import algorithm_spans, per_span
from sparse_ft.modeling.rope import rope_inv_freq

logger = logging.getLogger(__name__)

CONFIG_KEY = "dual_chunk_attention_config"
# The engines' fallbacks for absent keys (vLLM / SGLang ``dual_chunk_attention_config.get``).
CONFIG_DEFAULTS = {"chunk_size": 8192, "local_size": 1024, "original_max_position_embeddings": 0}
# Read and ignored: the engines' vertical-slash sparse prefill, an approximation of DCA past
# the threshold; this method computes DCA exactly at every length.
SPARSE_KEYS = ("sparse_attention_config", "sparse_attention_enabled", "sparse_attention_threshold",
               "sparse_attention_last_q")


def model_dca_config(config: Any) -> Optional[dict[str, Any]]:
    """The model's ``dual_chunk_attention_config`` as a dict (transformers 4.x and 5.x keep
    the JSON object as a dict attribute; an object with attributes is accepted too), or None.
    Anything else (a list, a string) is refused naming the key."""
    raw = getattr(config, CONFIG_KEY, None)
    if raw is None:
        return None
    if isinstance(raw, Mapping):
        return dict(raw)
    if hasattr(raw, "to_dict"):
        return dict(raw.to_dict())
    if not hasattr(raw, "__dict__"):  # a list, a string, a number
        raise ValueError(f"the model's config.json {CONFIG_KEY}={raw!r} is a {type(raw).__name__}, not an object "
                         "(e.g. {\"chunk_size\": 262144, \"local_size\": 8192, \"original_max_position_embeddings\": 262144})")
    return dict(vars(raw))


def params_from_config(dca_config: dict[str, Any]) -> dict[str, Any]:
    """``variant='qwen'`` with the config's chunk_size, local_size (our local_window) and
    original_max_position_embeddings (our pretraining_length: the length the logit scale
    counts from; 0 turns the scale off, as in the engines)."""
    values = CONFIG_DEFAULTS | {k: dca_config[k] for k in CONFIG_DEFAULTS if k in dca_config}
    params: dict[str, Any] = {"variant": "qwen", "chunk_size": values["chunk_size"], "local_window": values["local_size"]}
    original = values["original_max_position_embeddings"]
    if original:
        params["pretraining_length"] = original
    else:
        params["logit_scale"] = "none"
    return params


# The model families whose serving code passes dual_chunk_attention_config to its rotary embedding and
# attention (vLLM and SGLang ``models/qwen2.py``, ``qwen3.py``, ``qwen3_moe.py``; docs/serving.md).
SERVED_FAMILIES = ("qwen2", "qwen3", "qwen3_moe")
# what an export takes: the qwen variant's sizes and whether its logit scale is on
EXPORT_PARAMS = ("chunk_size", "local_window", "pretraining_length", "logit_scale")


def engine_config(config: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The ``dual_chunk_attention_config`` that makes the serving engines run DCA with
    ``params`` (``EXPORT_PARAMS``) on a model with ``config``: the inverse of
    :func:`params_from_config`, sizes from the ``qwen`` variant (the engines' DCA) with the
    model's context as c. The engines rotate DCA's positions with plain RoPE
    (``DualChunkRotaryEmbedding``: ``rope_theta`` only), so a model with RoPE scaling is refused
    rather than served with other positions than it was trained with."""
    from sparse_ft.modeling.rope import rope_parameters

    unknown = sorted(set(params) - set(EXPORT_PARAMS))
    if unknown:
        raise ValueError(f"--method dca: --method-arg {', '.join(unknown)} cannot be exported; allowed: {', '.join(EXPORT_PARAMS)}")
    family = getattr(config, "model_type", None)
    if family not in SERVED_FAMILIES:
        raise ValueError(f"--method dca: model_type={family!r}: the engines read {CONFIG_KEY} only for "
                         f"{', '.join(SERVED_FAMILIES)} (vLLM / SGLang model code); other models need sparse-ft's --method dca")
    rope_type = rope_parameters(config)["rope_type"]
    if rope_type != "default":
        raise ValueError(f"--method dca: the model has rope_type={rope_type!r}, which the engines' DCA drops (it rotates "
                         "with plain RoPE and rope_theta): export DCA only from a model without RoPE scaling")
    algorithm = DualChunkAttention(variant="qwen", **params)
    if algorithm.logit_scale not in ("qwen", "none"):
        raise ValueError(f"--method dca: logit_scale={algorithm.logit_scale!r} is not the engines'; allowed: qwen, none")
    s, w, c = algorithm.sizes(int(config.max_position_embeddings))
    return {"chunk_size": s, "local_size": w, "original_max_position_embeddings": c if algorithm.logit_scale == "qwen" else 0}


def sparse_prefill_enabled(dca_config: dict[str, Any]) -> bool:
    """Whether the engines would switch to sparse prefill (their rule: enabled unless said
    otherwise as soon as a sparse_attention_config is given)."""
    return bool(dca_config.get("sparse_attention_enabled", dca_config.get("sparse_attention_config") is not None))


@register
class DualChunk(AlgorithmMethod):
    name = "dca"
    algorithm_class = DualChunkAttention
    supports = Supports(training=False, ppl=True, kv_cache=True, backends=(None, *LSE_BACKENDS))

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.given = params
        # the last model DCA config asked about and the algorithm it gives: every layer's
        # every call asks, almost always with the same config
        self._last_config: Optional[dict[str, Any]] = None
        self._last_algorithm = self.algorithm

    def algorithm_for(self, config: Any) -> DualChunkAttention:
        """The algorithm a model with ``config`` runs: the model's own DCA configuration under
        the user's parameters when it has one and no other variant was asked for."""
        dca_config = model_dca_config(config)
        if dca_config is None or self.given.get("variant", "qwen") != "qwen":
            return self.algorithm
        if self._last_config != dca_config:
            try:
                algorithm = DualChunkAttention(**(params_from_config(dca_config) | self.given))
            except (TypeError, ValueError) as err:
                raise ValueError(f"the model's config.json {CONFIG_KEY}={dca_config}: {err}") from None
            self._last_config, self._last_algorithm = dca_config, algorithm
        return self._last_algorithm

    def describe(self, config: Any) -> str:
        algorithm = self.algorithm_for(config)
        s, w, c = algorithm.sizes(int(config.max_position_embeddings))
        dca_config = model_dca_config(config)
        if dca_config is None:
            source = "no dual_chunk_attention_config in the model"
        elif algorithm is self.algorithm:
            source = f"the model's dual_chunk_attention_config is not used with variant={algorithm.variant!r}"
        else:
            given = ", ".join(sorted(self.given)) or "nothing"
            read = ", ".join(f"{k}={dca_config[k]}" for k in CONFIG_DEFAULTS if k in dca_config)
            source = f"from the model's dual_chunk_attention_config ({read}); given: {given}"
        return (f"dca: variant={algorithm.variant} chunk_size={s} local_window={w} pretraining_length={c} "
                f"logit_scale={algorithm.logit_scale} ({source})")

    def check_model(self, config: Any) -> None:
        algorithm = self.algorithm_for(config)
        logger.info(self.describe(config))
        dca_config = model_dca_config(config)
        if algorithm is not self.algorithm and sparse_prefill_enabled(dca_config):
            threshold = dca_config.get("sparse_attention_threshold", 32768)
            logger.warning(
                "dca: the model's dual_chunk_attention_config enables the serving engines' vertical-slash sparse "
                f"prefill beyond sparse_attention_threshold={threshold} tokens; sparse-ft does not implement it and "
                f"computes DCA exactly at every length (read and ignored: {', '.join(SPARSE_KEYS)})"
            )

    def __call__(self, module, query, key, value, attention_mask, *, scaling: Optional[float] = None,
                 dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
        nk = key.shape[2]
        self.check_inputs(attention_mask, dropout)
        window = kwargs.get("sliding_window")
        if window is not None and window < nk:
            raise ValueError(
                f"dca: sliding_window={window} is shorter than the sequence ({nk}); DCA assumes global causal attention"
            )
        spans = algorithm_spans(attention_mask, kwargs, q=query, k=key, owner="dca")
        config = module.config
        algorithm = self.algorithm_for(config)
        context = int(config.max_position_embeddings)
        s, w, c = algorithm.sizes(context)
        inv_freq = rope_inv_freq(config, "dca").to(query.device)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _group: object) -> torch.Tensor:
            # one factor per sequence from its whole length, as the sources compute it
            scale = algorithm.scale(k.shape[2], q.shape[-1], context, scaling)
            return dca_attention(q, k, v, inv_freq=inv_freq, chunk_size=s, local_window=w, pretraining_length=c,
                                 scale=scale, backend=algorithm.backend, variant=algorithm.variant,
                                 pieces=algorithm.pieces)

        out = per_span(attend, query, key, value, spans=spans)
        return out.transpose(1, 2).contiguous(), None

