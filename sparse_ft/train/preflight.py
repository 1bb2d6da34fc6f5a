"""The checks a training run makes before it loads weights or writes a file: whatever needs
the model's config, its module names, the tokenizer or the data's files, but no weights. A bad
input then ends the run in one line naming the recipe key or the file, instead of a traceback
after the weights have loaded. (The recipe's own checks ran when it loaded: config/schema.py.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from attn_patterns import kernels
from sparse_ft.config import Recipe
from sparse_ft.config.deepspeed_file import check_cuda_arch_list, check_with_deepspeed, read_deepspeed_config
from sparse_ft.config.bad_input import BadInput, fail, one_line
from sparse_ft.config.schema import check_sequence_parallel, lora_rank_rule
from sparse_ft.data.packing import check_source
from sparse_ft.modeling.dtypes import torch_dtype
from sparse_ft.modeling.families import geometry
from sparse_ft.modeling import rope
from sparse_ft.methods import Method, dense_layers_rule
from sparse_ft.methods.dense_layers import num_layers
from sparse_ft.modeling.model_io import is_repo_id, load_tokenizer
from sparse_ft.modeling.weight_files import model_files
from sparse_ft.train import checkpoint, validation
from sparse_ft.train.metrics import check_tensorboard_dir, check_trackers
from sparse_ft.modeling.tiny import is_built_in, tiny_llama_config, tiny_tokenizer


def preflight(recipe: Recipe, method: Method) -> validation.Validation:
    """Raise :class:`BadInput` for the first input this run cannot train with through
    ``method``. Loads no weights and writes nothing, so every rank runs it before the trainer
    starts; the data is read by the first rank only (a launcher stops the others when one
    fails). Returns the run's validation, its tasks prepared with the tokenizer (held-out
    tokens read, prompts built and checked against the lengths), which the trainer runs."""
    config = check_model(recipe, method)
    ds_config = read_deepspeed_config(recipe.deepspeed) if recipe.deepspeed is not None else None
    if ds_config is not None:
        try:
            check_with_deepspeed(ds_config, recipe.deepspeed)
            if torch.cuda.is_available():
                from deepspeed.git_version_info import installed_ops

                check_cuda_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"), installed_ops)
        except ValueError as err:
            raise BadInput(str(err)) from None
    validation.check(recipe, method, ds_config and ds_config.get("zero_optimization", {}).get("stage"))
    _check_lora(recipe, _skeleton(recipe, config))
    first = int(os.environ.get("RANK", "0")) == 0
    validating = recipe.validation.every_steps or recipe.validation.at_end
    tokenizer = _tokenizer(recipe) if first or validating else None  # a tokenizer loads in seconds, before any weight
    if first:  # one read of the data per run, not one per rank
        _check_data(recipe, tokenizer)
    return validation.Validation(recipe, tokenizer, method)


def check_model(recipe: Recipe, method: Method):
    """The checks of :func:`preflight` that any training of the recipe's model needs, adapters
    and data aside: the trackers, the checkpoint to resume, the backend, the model's config and
    heads. Returns the model's config."""
    check_trackers(recipe.train.report_to)
    check_tensorboard_dir(recipe.train.report_to, Path(recipe.train.output_dir))
    if recipe.train.resume not in ("auto", "never"):
        checkpoint.named_checkpoint(recipe.train.resume)
    att = recipe.attention
    for key, backend in (("attention.backend", att.backend), ("attention.params.backend", att.params.get("backend"))):
        if backend == "flash" and not kernels.flash_available():
            fail(key, "flash", "flash-attn cannot run here (it needs the flash-attn package and a CUDA device); "
                 "use sdpa, or auto (flash where it can run)")
        if backend == "flex" and not torch.cuda.is_available():
            fail(key, "flex", "FlexAttention has no backward on CPU in torch, and torch sees no CUDA device here; "
                 "use sdpa, or auto")
        if backend == "triton":
            device = "cuda" if torch.cuda.is_available() else "cpu"
            why = kernels.triton_unsupported(device, torch_dtype(recipe.model.dtype))
            if why is not None:
                fail(key, "triton", f"the block-sparse Triton kernel cannot run here: {why}; use sdpa, or auto")
    config = _model_config(recipe)
    _check_dense_layers(recipe, config)
    _check_heads(recipe, config, method)
    context = getattr(config, "max_position_embeddings", None)
    if not isinstance(context, int) or context < 1:
        fail(*_model_key(recipe), f"its max_position_embeddings={context!r}: extending the context needs a positive one")
    try:
        rope.set_native_length(config, recipe.model.native_length)
    except ValueError as err:
        fail("model.native_length", recipe.model.native_length, str(err))
    try:
        rope.check_factor(config, rope.extension_factor(config, recipe.model.target_length))
    except ValueError as err:
        fail("model.target_length", recipe.model.target_length, str(err))
    return config


def _model_key(recipe: Recipe) -> tuple[str, Any]:
    """The recipe key that decides the model's shape."""
    if is_built_in(recipe.model.name_or_path):
        return "model.tiny", recipe.model.tiny
    return "model.name_or_path", recipe.model.name_or_path


def _model_config(recipe: Recipe):
    """The model's config: a missing local directory is reported as one, not as a bad Hub id."""
    from transformers import AutoConfig

    name = recipe.model.name_or_path
    if is_built_in(name):
        return tiny_llama_config(**recipe.model.tiny)  # the schema has checked the overrides
    path = Path(name)  # as from_pretrained will read it
    if not path.exists() and not is_repo_id(name):
        fail("model.name_or_path", name, "no such local directory (a Hub model is named like meta-llama/Llama-2-7b-hf)")
    if path.exists() and not (path / "config.json").is_file():
        fail("model.name_or_path", name, "a local model is a directory with config.json; this has none")
    if path.exists():
        try:
            model_files(path, name)  # pickled weights refused, files cut short found, before anything loads
        except ValueError as err:
            fail("model.name_or_path", name, str(err))
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=recipe.model.trust_remote_code)
    except Exception as err:  # hub, file and remote-code errors come in many types
        where = "" if path.exists() else "not a local directory, and "
        offline = " (HF_HUB_OFFLINE=1 is set)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        fail("model.name_or_path", name, f"{where}its config cannot be read: {one_line(err)}{offline}")


def _check_dense_layers(recipe: Recipe, config) -> None:
    """``attention.dense_layers`` within the model's layers (its form was checked when the
    recipe loaded)."""
    rule = dense_layers_rule(recipe.attention.dense_layers, num_layers(config))
    if rule is not None:
        fail("attention.dense_layers", recipe.attention.dense_layers, rule)


def _check_heads(recipe: Recipe, config, method: Method) -> None:
    """Grouped-query attention, the pattern and sequence parallelism all divide the heads;
    unchecked, any fails in the first forward."""
    if getattr(config, "num_attention_heads", None) is not None:
        heads, kv_heads, _ = geometry(config)
        if heads % kv_heads:
            fail(*_model_key(recipe), f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        check_sequence_parallel(recipe.train.sequence_parallel_size, world, heads, kv_heads)
    try:
        method.check_model(config)
    except ValueError as err:
        fail("attention.params", recipe.attention.params, str(err))


def _skeleton(recipe: Recipe, config) -> torch.nn.Module:
    """The model's modules on the meta device: their names and types, without memory or weights."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    except Exception as err:  # a config its model class cannot be built from; the error types vary
        fail(*_model_key(recipe), f"a {config.model_type} model cannot be built from it ({type(err).__name__}: {one_line(err)})")


def _lora_layers() -> tuple[type, ...]:
    """The module types PEFT's LoRA wraps."""
    from transformers.pytorch_utils import Conv1D

    nn = torch.nn
    return nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, Conv1D


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _check_lora(recipe: Recipe, model: torch.nn.Module) -> None:
    """Every name in ``lora.target_modules`` and ``lora.extra_trainable`` matches modules the
    way PEFT matches them; PEFT itself ignores a name that matches nothing while another does."""
    lora, layers = recipe.lora, _lora_layers()
    modules = {name: module for name, module in model.named_modules() if name}
    for target in lora.target_modules:  # PEFT: the whole name, or its last dotted parts
        matched = [m for name, m in modules.items() if name == target or name.endswith("." + target)]
        if not matched or not all(isinstance(m, layers) for m in matched):
            found = "names no module" if not matched else f"names a {type(matched[0]).__name__}, which LoRA cannot adapt"
            names = sorted({_leaf(name) for name, m in modules.items() if isinstance(m, layers)})
            fail("lora.target_modules", lora.target_modules, f"{target!r} {found}; the model's layers LoRA can adapt: {', '.join(names)}")
    targets = [name for name in modules if any(name == t or name.endswith("." + t) for t in lora.target_modules)]
    rule = lora_rank_rule(lora.r, {name: tuple(modules[name].weight.shape[:2]) for name in targets
                                   if getattr(modules[name], "weight", None) is not None})
    if rule is not None:
        fail("lora.r", lora.r, rule)
    for suffix in lora.extra_trainable:  # PEFT modules_to_save: every module whose name ends with it
        matched = [name for name in modules if name.endswith(suffix)]
        if not matched:
            ends = sorted({_leaf(name) for name in modules if not _leaf(name).isdigit()})
            fail("lora.extra_trainable", lora.extra_trainable,
                 f"{suffix!r} ends no module name; the model's names end in: {', '.join(ends)}")
        holding = [name for name in matched if any(t.startswith(name + ".") for t in targets)]
        if holding:  # PEFT would copy it whole and leave LoRA nothing to adapt inside it
            fail("lora.extra_trainable", lora.extra_trainable,
                 f"{suffix!r} matches {holding[0]}, which holds LoRA's targets (lora.target_modules); "
                 "name the layers to train whole, e.g. embed_tokens, norm")


def _tokenizer(recipe: Recipe) -> Any:
    """The model's tokenizer, which the data check and validation's prompts need."""
    model = recipe.model
    try:
        return tiny_tokenizer() if is_built_in(model.name_or_path) else load_tokenizer(model.name_or_path, model.trust_remote_code)
    except Exception as err:  # tokenizer files and remote code fail in many types
        fail("model.name_or_path", model.name_or_path, f"its tokenizer cannot be loaded: {one_line(err)}")


def _check_data(recipe: Recipe, tokenizer: Any) -> None:
    """The data source, read through before anything loads (see ``check_source``); a broken
    file is reported by file and line."""
    try:
        check_source(recipe.data, tokenizer, recipe.seq_len)
    except (ValueError, OSError) as err:
        raise BadInput(str(err)) from None
