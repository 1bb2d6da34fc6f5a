"""The shapes the memory planner needs, from a local config, the built-in tiny model, or a
table of known Hugging Face ids: no hub is reachable offline, and a plan should not need the
weights. The table's numbers are the ``config.json`` fields of each repository (read there by
hand; the parameter counts they give match the model cards: 6.74B, 8.03B, 7.24B, 7.25B, 7.62B, 8.19B),
with the context and RoPE scaling the planner checks a length's RoPE factor against, as ``train``
does before loading (``ModelShape.rope_config``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

# What sparse_ft.modeling.rope reads of a config's RoPE scaling to bound a length's factor
ROPE_KEYS = ("rope_type", "factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool  # the output head is the embedding matrix
    source: str  # where the numbers come from, for the report
    context: int  # the config's max_position_embeddings: the context it handles now, its scaling included
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # the config's RoPE scaling (ROPE_KEYS), () for plain RoPE

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """A decoder layer's projections as (in, out), by the module names LoRA targets."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q_width), "k_proj": (h, self.kv_width), "v_proj": (h, self.kv_width),
                "o_proj": (self.q_width, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in self.linear_shapes().values())

    def norm_params(self) -> int:
        """Two RMSNorms per layer and the final one."""
        return (2 * self.layers + 1) * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    def params(self) -> int:
        return (self.layers * self.layer_linear_params() + self.norm_params() + self.embedding_params()
                + self.head_params())

    def cut(self, layers: int) -> "ModelShape":
        return replace(self, layers=layers, source=f"{self.source}, cut to {layers} layers")

    def rope_config(self) -> SimpleNamespace:
        """A config as ``sparse_ft.modeling.rope`` reads it (its context and RoPE scaling), for
        its checks of a length's factor; a new one each call, as ``set_native_length`` edits it."""
        return SimpleNamespace(max_position_embeddings=self.context, rope_scaling=dict(self.rope_scaling) or None)


def _hf(repo: str, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
        context: int, rope_scaling: Optional[dict] = None) -> ModelShape:
    return ModelShape(layers, hidden, heads, kv_heads, hidden // heads, intermediate, vocab, False,
                      f"built-in table: {repo}/config.json", context, tuple((rope_scaling or {}).items()))


def _same(shape: ModelShape, repo: str, context: int) -> ModelShape:
    """``shape``'s weights in another repository whose config.json states ``context`` and no
    RoPE scaling."""
    return replace(shape, source=f"built-in table: {repo}/config.json", context=context, rope_scaling=())


_LLAMA2_7B = _hf("meta-llama/Llama-2-7b-hf", layers=32, hidden=4096, heads=32, kv_heads=32, intermediate=11008, vocab=32000,
                 context=4096)
_LLAMA31_8B = _hf("meta-llama/Llama-3.1-8B", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
                  context=131072, rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192})
# Mistral-7B-v0.3 is v0.1's shape with the vocabulary extended to 32768 (its model card); Qwen2.5's
# QKV biases and Qwen3's per-head q/k norms are under 0.01% of the weights and left out; Qwen3-8B's
# head_dim 128 is its hidden 4096 / 32 heads. Contexts: Llama-3-8B states 8192 with no scaling
# (3.1 added llama3 x8 to 131072); Qwen2.5-7B states 131072, its Instruct 32768; Qwen3-8B states
# 40960, its Base 32768 (both pretrained at 32768: recipes set model.native_length, which the
# planner honours as train does).
_MISTRAL_V03 = _hf("mistralai/Mistral-7B-v0.3", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=32768,
                   context=32768)
_QWEN25_7B = _hf("Qwen/Qwen2.5-7B", layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944, vocab=152064,
                 context=131072)
_QWEN3_8B = _hf("Qwen/Qwen3-8B", layers=36, hidden=4096, heads=32, kv_heads=8, intermediate=12288, vocab=151936,
                context=40960)
KNOWN: dict[str, ModelShape] = {
    "meta-llama/Llama-2-7b-hf": _LLAMA2_7B,
    "meta-llama/Llama-2-7b-chat-hf": _LLAMA2_7B,
    "meta-llama/Llama-3.1-8B": _LLAMA31_8B,
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA31_8B,
    "meta-llama/Meta-Llama-3.1-8B": _LLAMA31_8B,
    "meta-llama/Meta-Llama-3-8B": _same(_LLAMA31_8B, "meta-llama/Meta-Llama-3-8B", 8192),
    "mistralai/Mistral-7B-v0.1": _hf("mistralai/Mistral-7B-v0.1", layers=32, hidden=4096, heads=32, kv_heads=8,
                                     intermediate=14336, vocab=32000, context=32768),
    "mistralai/Mistral-7B-v0.3": _MISTRAL_V03,
    "mistralai/Mistral-7B-Instruct-v0.3": _MISTRAL_V03,
    "Qwen/Qwen2.5-7B": _QWEN25_7B,
    "Qwen/Qwen2.5-7B-Instruct": _same(_QWEN25_7B, "Qwen/Qwen2.5-7B-Instruct", 32768),
    "Qwen/Qwen3-8B": _QWEN3_8B,
    "Qwen/Qwen3-8B-Base": _same(_QWEN3_8B, "Qwen/Qwen3-8B-Base", 32768),
}


def from_config(config, source: str) -> ModelShape:
    """A transformers config's shapes (heads and head width as the attention layers read them),
    its context and RoPE scaling."""
    from sparse_ft.modeling import rope
    from sparse_ft.modeling.families import geometry

    g = geometry(config)
    params = rope.rope_parameters(config)
    scaling = () if params["rope_type"] == "default" else tuple((k, params[k]) for k in ROPE_KEYS if k in params)
    return ModelShape(config.num_hidden_layers, config.hidden_size, g.heads, g.kv_heads, g.head_dim,
                      config.intermediate_size, config.vocab_size, bool(getattr(config, "tie_word_embeddings", False)),
                      source, int(config.max_position_embeddings), scaling)


def model_shape(name_or_path: str, *, trust_remote_code: bool = False, tiny: Optional[dict] = None) -> ModelShape:
    """``tiny`` (with the recipe's ``model.tiny`` overrides), a local model directory (its
    config.json), or an id of :data:`KNOWN`; anything else is refused with what is known, since
    the hub cannot be asked."""
    from sparse_ft.modeling.tiny import is_built_in, tiny_llama_config

    if is_built_in(name_or_path):
        return from_config(tiny_llama_config(**(tiny or {})), "built-in tiny model")
    if Path(name_or_path).expanduser().is_dir():
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        return from_config(config, f"{name_or_path}/config.json")
    if name_or_path in KNOWN:
        return KNOWN[name_or_path]
    raise ValueError(f"model.name_or_path={name_or_path!r} has no shapes here: the planner reads a local model "
                     f"directory, 'tiny', or one of {', '.join(KNOWN)}")
