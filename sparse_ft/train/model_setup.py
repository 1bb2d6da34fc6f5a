"""The model a recipe trains: base weights, position interpolation composed with the model's
own RoPE scaling, LoRA+ adapters, and the attention method it trains through, built here once
per run from the recipe's names (the recipe itself stays data)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from sparse_ft import methods
from sparse_ft.modeling import rope
from sparse_ft.modeling.attention import install_method
from sparse_ft.config import LoraSection, Recipe
from sparse_ft.config.bad_input import fail
from sparse_ft.methods import Method
from sparse_ft.modeling.dtypes import torch_dtype
from sparse_ft.modeling.tiny import is_built_in
from sparse_ft.train.activations import reduce_activation_memory

BASE_DIR = "base-model"  # in train.output_dir: the built-in tiny model, written once as a checkpoint

_KEEP_ALIVE: list = []  # transformers reads the ZeRO-3 config through a weak global reference


def training_method(recipe: Recipe) -> Method:
    """The method the run trains through, built once per run. ``attention.backend: auto`` is
    resolved here, on the machine that trains, and written into ``recipe``, so that the saved
    recipe and the checkpoints' fingerprint name the backend that ran. The recipe's names and
    values were checked when it loaded; what needs the built method is checked here, before
    anything loads: the sequence length it trains at (chunks of one token would switch
    attention off). With ``attention.dense_layers`` or ``train.dense_final_fraction`` the method
    routes those layers, or the dense tail, to full attention (``methods.DenseLayers``)."""
    att = recipe.attention
    method, att.backend = methods.for_training(att.pattern, att.params, att.backend, recipe.model.dtype)
    try:
        method.check_length(recipe.seq_len)
    except ValueError as err:
        fail("attention.params", att.params, f"{err} (the sequence length is data.seq_len, else model.target_length)")
    if att.dense_layers or recipe.train.dense_final_fraction:
        return methods.with_dense_layers(method, att.dense_layers)
    return method


def base_model_path(recipe: Recipe) -> str:
    if is_built_in(recipe.model.name_or_path):
        return str(Path(recipe.train.output_dir) / BASE_DIR)
    return recipe.model.name_or_path


def extended_config(path: str, target_length: int, method: str, *, trust_remote_code: bool = False,
                    native_length: Optional[int] = None):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    rope.extend_to(config, target_length, method, native_length)
    config.use_cache = False
    return config


def build_model(recipe: Recipe, path: str, method: Method, ds_config: Optional[dict] = None):
    """Base model with position interpolation, LoRA+ and the training ``method``, its
    activations kept as the recipe's memory keys say."""
    model = add_adapters(load_base(recipe, path, ds_config), recipe.lora, method, recipe.train.gradient_checkpointing)
    return reduce_activation_memory(model, recipe.train)


def load_base(recipe: Recipe, path: str, ds_config: Optional[dict] = None):
    """The base model at ``path`` in the recipe's dtype, extended to ``model.target_length``;
    under ZeRO-3 its weights load partitioned; with ``model.quantization: nf4`` its linear
    layers load as bitsandbytes NF4 on this process's device, under ZeRO-3 stored in
    ``model.dtype`` so that DeepSpeed partitions them when it initialises (the layers are
    planned before ZeRO-3's config is registered: its ``zero.Init`` cannot build the meta
    model the plan reads)."""
    from transformers import AutoModelForCausalLM

    config = extended_config(path, recipe.model.target_length, recipe.model.rope_method,
                             trust_remote_code=recipe.model.trust_remote_code, native_length=recipe.model.native_length)
    quantized = nf4_loading(recipe, config) if recipe.model.quantization == "nf4" else {}
    if ds_config is not None and ds_config.get("zero_optimization", {}).get("stage") == 3:
        from transformers.integrations import HfDeepSpeedConfig

        if quantized:
            quantized["quantization_config"].bnb_4bit_quant_storage = torch_dtype(recipe.model.dtype)
            del quantized["device_map"]
        _KEEP_ALIVE.append(HfDeepSpeedConfig(ds_config))  # weights load partitioned (zero.Init)
    return AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch_dtype(recipe.model.dtype), trust_remote_code=recipe.model.trust_remote_code,
        **quantized
    )


def nf4_loading(recipe: Recipe, config) -> dict:
    """``from_pretrained``'s arguments for QLoRA's base: NF4 with double quantisation, computing
    in ``model.dtype``, on this process's device (bitsandbytes quantises as the weights move
    there). The layers the installed bitsandbytes cannot quantise on that device stay in
    ``model.dtype``, named on stderr by rank 0 (``sparse_ft.modeling.quantization``)."""
    import importlib.util
    import os
    import sys

    import torch

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError("recipe key model.quantization='nf4' needs bitsandbytes: pip install bitsandbytes")
    from sparse_ft.modeling import quantization

    local = int(os.environ.get("LOCAL_RANK", 0))
    device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    dtype = torch_dtype(recipe.model.dtype)
    plan, refused = quantization.plan(config, 4, device, dtype, compute_dtype=dtype,
                                      trust_remote_code=recipe.model.trust_remote_code)
    if refused and int(os.environ.get("RANK", 0)) == 0:
        print(quantization.describe(refused, 4, device, dtype, asked_by="model.quantization=nf4"), file=sys.stderr, flush=True)
    return {"quantization_config": plan, "device_map": {"": device}}


def train_through(model, method: Method, gradient_checkpointing: bool):
    """``model`` attending through the training ``method``, with gradient checkpointing when
    asked: what every trained model gets, its adapters or not."""
    install_method(model, method)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def add_adapters(model, lora: LoraSection, method: Method, gradient_checkpointing: bool):
    """The training method, gradient checkpointing and LoRA+ on a loaded base model: what a
    recipe trains, in one place, so that ``sparse-ft bench train`` measures the same step."""
    from peft import LoraConfig, get_peft_model

    train_through(model, method, gradient_checkpointing)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        modules_to_save=list(lora.extra_trainable) or None,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)
