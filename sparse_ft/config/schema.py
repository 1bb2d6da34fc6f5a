"""The recipe's shape and its own checks: sections with types and defaults, the values each
key allows, and the checks across keys (a DeepSpeed file that would train differently
included), so that a bad recipe is refused when it loads, naming the dotted key, the value and
what is allowed, before any model is loaded."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from sparse_ft.files.outputs import file_in_the_way
from sparse_ft.config.bad_input import BadInput, fail, one_line
from sparse_ft.config.deepspeed_file import RECIPE_OWNED, is_auto, precision, read_deepspeed_config
from sparse_ft.modeling import dtypes
from sparse_ft.modeling.rope import SCALINGS
from sparse_ft.modeling.tiny import BUILT_IN, is_built_in


@dataclass
class ModelSection:
    name_or_path: str = BUILT_IN  # HF id, local directory, or "tiny": the built-in test model (random weights)
    dtype: str = "bfloat16"
    target_length: int = 8192
    rope_method: str = "linear"
    # the context the model was pretrained at, where its config.json says more (Qwen2.5-7B:
    # 131072 there, 32768 pretrained, YaRN beyond): RoPE extends from it; null: the config's
    native_length: Optional[int] = None
    trust_remote_code: bool = False
    quantization: str = "none"  # nf4: a bitsandbytes 4-bit base under the adapters (QLoRA), docs/training.md
    tiny: dict = field(default_factory=dict)  # LlamaConfig overrides for name_or_path=tiny


@dataclass
class AttentionSection:
    pattern: str = "scca_flow"  # any trainable name of sparse_ft.methods.names()
    params: dict = field(default_factory=dict)  # the pattern's parameters, checked against its signature
    backend: Optional[str] = None  # null = sdpa; auto = flash-attn where installed (CUDA, fp16/bf16), else sdpa
    # layers that attend fully (the pattern causal) while the rest run the pattern: indices, or "last n"
    dense_layers: Union[list[int], str] = field(default_factory=list)


@dataclass
class LoraSection:
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0  # LongLoRA fine-tune.py
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # LongLoRA's LoRA+: embeddings and normalisation layers train too (PEFT modules_to_save,
    # matched by name suffix: "norm" covers every RMSNorm).
    extra_trainable: list[str] = field(default_factory=lambda: ["embed_tokens", "norm"])


@dataclass
class DataSection:
    source: str = "hf://datasets/togethercomputer/RedPajama-Data-1T-Sample/*.jsonl"  # see sparse_ft/data/sources.py
    split: str = "train"
    text_column: str = "text"
    # 1: a blank row (no tokens) is no document; 0 keeps them (each a lone EOS, nothing to learn)
    min_tokens: int = 1
    seq_len: Optional[int] = None  # default: model.target_length
    cache_dir: str = ".cache/sparse-ft/data"
    streaming: bool = False
    max_documents: Optional[int] = None
    # blocks: documents joined with EOS and cut into samples, attending across documents;
    # padding_free: the same samples, positions restarting after each EOS, so that every
    # document attends to itself alone, with its own pattern (sparse_ft/data/packing.py)
    packing: str = "blocks"
    # text: documents, every token trained; chat ({messages: [...]}) or instruction
    # ({instruction, input, output}): the loss on the answers alone, each row packed whole and
    # padding-free (sparse_ft/data/conversations.py, docs/data.md#chat-and-instruction-data)
    format: str = "text"
    chat_template: Optional[str] = None  # format chat: a Jinja template, or a file holding one; null: the tokenizer's


@dataclass
class TrainSection:
    output_dir: str = "runs/default"
    max_steps: int = -1  # -1: num_epochs over the data
    num_epochs: int = 1
    lr: float = 2e-5
    weight_decay: float = 0.0
    weight_decay_on: str = "all"  # all trainable parameters, or matrices only (norm weights and biases never decay)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 20
    scheduler: str = "constant"
    min_lr_ratio: float = 0.0  # where linear / cosine decay ends, as a fraction of lr
    per_device_batch_size: int = 1
    gradient_accumulation_steps: int = 8
    gradient_checkpointing: bool = True
    # memory (docs/training.md#memory): the loss's head over chunks of tokens, the checkpointed
    # layer inputs in CPU memory, each MLP over tiles of the sequence (0: whole)
    loss: str = "chunked"
    loss_chunk_tokens: int = 2048
    offload_activations: bool = False
    mlp_tile_tokens: int = 0
    # DeepSpeed Ulysses: each sequence split over this many ranks, each attending with H/sp heads
    sequence_parallel_size: int = 1
    # the GPUs (processes) the recipe is written for: sparse-ft plan's world size (ZeRO's
    # partitions); the launcher decides how many a run gets. null: the sequence-parallel size
    gpus: Optional[int] = None
    max_grad_norm: float = 1.0
    # the last fraction of the steps with full attention in every layer, from step ceil((1 - f) * steps)
    dense_final_fraction: float = 0.0
    seed: int = 42
    save_steps: int = 1000
    save_minutes: float = 0.0  # also a checkpoint once this many minutes passed since the last; 0: off
    save_total_limit: int = 2
    log_steps: int = 1
    resume: str = "auto"  # auto | never | a checkpoint directory
    # with resume=never: delete the checkpoint-* directories an earlier run left in output_dir (nothing else)
    overwrite_output_dir: bool = False
    resume_allow_changes: list[str] = field(default_factory=list)  # RESUME_KEYS (or world_size) a resume may find changed
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    # W&B's project, entity, name, group, tags: each key given wins over its WANDB_* variable (metrics.py)
    wandb: dict = field(default_factory=dict)


@dataclass
class ValidationSection:
    """Evaluation while training (sparse_ft/train/validation.py); off unless every_steps or
    at_end. It never changes training, so no key of it is a resume key."""

    every_steps: int = 0  # validate after every N optimizer steps; 0: never during training
    at_end: bool = False  # also after the last step
    tasks: list[str] = field(default_factory=lambda: ["ppl"])  # names of sparse_ft.evaluation.tasks
    params: dict = field(default_factory=dict)  # a task's parameters by its name, e.g. {passkey: {trials: 2}}
    lengths: list[int] = field(default_factory=list)  # default: [model.target_length]
    attention: str = "full"  # full: as the adapter is used after training; training: the run's pattern
    data: Optional[str] = None  # held-out text/jsonl/parquet/.bin file or HF dataset id that ppl scores
    split: str = "validation"  # of an HF dataset id


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    attention: AttentionSection = field(default_factory=AttentionSection)
    lora: LoraSection = field(default_factory=LoraSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    validation: ValidationSection = field(default_factory=ValidationSection)
    deepspeed: Optional[str] = None  # a file in ds_configs/ (name or path), or null
    name: str = ""  # set from the recipe file

    @property
    def seq_len(self) -> int:
        return self.data.seq_len or self.model.target_length

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "model.dtype": dtypes.NAMES,
    "model.rope_method": tuple(SCALINGS),
    "model.quantization": ("none", "nf4"),
    "train.loss": ("chunked", "model"),
    "attention.backend": (None, "auto", "sdpa", "flash", "flex", "triton"),
    "data.packing": ("blocks", "padding_free"),
    "data.format": ("text", "chat", "instruction"),
    "train.scheduler": ("constant", "linear", "cosine"),
    "train.weight_decay_on": ("all", "matrices"),
    "validation.attention": ("full", "training"),
}
POSITIVE = {"model.target_length", "lora.r", "lora.alpha", "train.per_device_batch_size",
            "train.gradient_accumulation_steps", "train.sequence_parallel_size", "train.save_steps", "train.log_steps", "train.num_epochs",
            "train.loss_chunk_tokens"}
NON_NEGATIVE = {"train.warmup_steps", "train.weight_decay", "data.min_tokens", "validation.every_steps", "train.mlp_tile_tokens"}
REPORTERS = ("tensorboard", "wandb", "none")
WANDB_KEYS = {"project": str, "entity": str, "name": str, "group": str, "tags": list}  # train.wandb
# What a resume must find as the checkpoint recorded it (the model, its adapters and attention, the
# data and its order, the optimizer and its schedule): a change would continue another run.
RESUME_KEYS = ("model.name_or_path", "model.dtype", "model.quantization", "model.target_length", "model.rope_method",
               "model.native_length", "model.tiny",
               "attention.pattern", "attention.params", "attention.backend", "attention.dense_layers",
               "lora.r", "lora.alpha", "lora.dropout", "lora.target_modules", "lora.extra_trainable",
               "data.source", "data.split", "data.text_column", "data.min_tokens", "data.seq_len", "data.streaming",
               "data.max_documents", "data.packing", "data.format", "data.chat_template",
               "train.seed", "train.lr", "train.betas", "train.weight_decay", "train.weight_decay_on",
               "train.scheduler", "train.min_lr_ratio", "train.warmup_steps", "train.max_steps", "train.num_epochs",
               "train.per_device_batch_size", "train.gradient_accumulation_steps", "train.sequence_parallel_size",
               "train.max_grad_norm", "train.dense_final_fraction")
# not a recipe key: the number of processes a checkpoint was written by, which a resume may also be allowed to change
WORLD_SIZE = "world_size"


def validate(recipe: Recipe) -> None:
    """All of a typed recipe's checks; the first that fails raises. The recipe stays data:
    ``attention.backend: auto`` stays ``auto`` until the trainer resolves it on the machine
    that trains."""
    _check_finite(recipe.to_dict(), "")
    flat = _flatten(recipe.to_dict())
    for key, allowed in CHOICES.items():
        if flat[key] not in allowed:
            fail(key, flat[key], f"allowed: {', '.join(str(a) for a in allowed)}")
    for keys, lowest in ((POSITIVE, 1), (NON_NEGATIVE, 0)):
        for key in sorted(keys):
            if flat[key] < lowest:
                fail(key, flat[key], f"must be >= {lowest}")
    native = recipe.model.native_length
    if native is not None and (isinstance(native, bool) or not isinstance(native, int) or native < 1):
        fail("model.native_length", native, "a positive number of tokens (the model's pretraining context), or null for its config's")
    train = recipe.train
    if train.max_steps == 0 or train.max_steps < -1:
        fail("train.max_steps", train.max_steps, "must be >= 1, or -1 to run train.num_epochs")
    if train.lr <= 0:
        fail("train.lr", train.lr, "must be > 0")
    if not 0 <= train.min_lr_ratio <= 1:
        fail("train.min_lr_ratio", train.min_lr_ratio, "must be in [0, 1] (the decay's end, as a fraction of train.lr)")
    if train.min_lr_ratio and train.scheduler == "constant":
        fail("train.min_lr_ratio", train.min_lr_ratio, "only applies with train.scheduler linear or cosine, not constant")
    if train.max_grad_norm <= 0:
        fail("train.max_grad_norm", train.max_grad_norm, "must be > 0 (gradients are clipped to this norm)")
    if train.save_total_limit < 0:
        fail("train.save_total_limit", train.save_total_limit, "must be >= 1 (checkpoints kept), or 0 to keep every checkpoint")
    if train.save_minutes < 0:
        fail("train.save_minutes", train.save_minutes, "must be > 0 (minutes between checkpoints by the clock), or 0 for none")
    if train.offload_activations and not train.gradient_checkpointing:
        fail("train.offload_activations", True, "offloads the layer inputs gradient checkpointing keeps; "
             "set train.gradient_checkpointing=true")
    if len(train.betas) != 2 or not all(0 <= b < 1 for b in train.betas):
        fail("train.betas", train.betas, "two numbers in [0, 1)")
    for reporter in train.report_to:
        if reporter not in REPORTERS:
            fail("train.report_to", train.report_to, f"entries allowed: {', '.join(REPORTERS)}")
    for key, value in train.wandb.items():
        if (key not in WANDB_KEYS or not isinstance(value, WANDB_KEYS[key])
                or (key == "tags" and not all(isinstance(t, str) for t in value))):
            fail(f"train.wandb.{key}", value, "keys allowed: project, entity, name, group (each a string), tags (a list of strings)")
    _check_output_dir(recipe)
    if not 0 <= recipe.lora.dropout < 1:
        fail("lora.dropout", recipe.lora.dropout, "must be in [0, 1)")
    if not recipe.lora.target_modules:
        fail("lora.target_modules", recipe.lora.target_modules, "at least one module name, e.g. [q_proj, k_proj, v_proj, o_proj]")
    for key in ("lora.target_modules", "lora.extra_trainable"):
        names = getattr(recipe.lora, key.split(".")[1])
        if not all(name.strip() for name in names):
            fail(key, names, "module names, none empty (an empty name would match every module)")
    _check_lengths(recipe)
    _check_data(recipe)
    _check_tiny(recipe.model)
    _check_attention(recipe)
    _check_sequence_parallel(recipe)
    _check_validation(recipe)
    if recipe.deepspeed is not None:
        _check_deepspeed(recipe, read_deepspeed_config(recipe.deepspeed))


def _check_finite(value: Any, key: str) -> None:
    """No number anywhere in the recipe (nested ones in attention.params, model.tiny and lists
    included) may be inf or nan: every comparison with nan is false, so range checks let it
    through, and ``train.lr=.inf`` trained an all-NaN adapter."""
    if isinstance(value, dict):
        for name, item in value.items():
            _check_finite(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_finite(item, f"{key}[{index}]")
    elif isinstance(value, float) and not math.isfinite(value):
        fail(key, value, "must be a finite number (not .inf or .nan)")


def _check_output_dir(recipe: Recipe) -> None:
    """By the time the trainer reached the output directory it would have written into it.
    (The checkpoint ``train.resume`` names is the trainer's to check: its files are.) A run
    writes fixed names (log.jsonl, adapter/) and ``overwrite_output_dir`` deletes some, so the
    current directory (``""``, ``.``) or one holding it is never a run's."""
    from sparse_ft.files.outputs import check_apart

    train = recipe.train
    _check_directory("train.output_dir", train.output_dir)
    cwd, out = Path.cwd().resolve(), Path(train.output_dir).resolve()
    if out == cwd or out in cwd.parents:
        fail("train.output_dir", train.output_dir, f"a directory of the run's own (e.g. runs/NAME), not the current directory {cwd} "
             "or one holding it")
    try:
        model = None if is_built_in(recipe.model.name_or_path) else recipe.model.name_or_path
        check_apart(Path(train.output_dir), "train.output_dir", {"data.source": recipe.data.source, "model.name_or_path": model,
                                                                  "validation.data": recipe.validation.data})
    except ValueError as err:
        raise BadInput(str(err)) from None
    if train.overwrite_output_dir and train.resume != "never":
        fail("train.overwrite_output_dir", True, f"only applies with train.resume=never (a fresh run), not {train.resume!r}")
    for key in train.resume_allow_changes:
        if key not in (*RESUME_KEYS, WORLD_SIZE):
            fail("train.resume_allow_changes", train.resume_allow_changes, f"entries allowed: {', '.join((*RESUME_KEYS, WORLD_SIZE))}")


def _check_directory(key: str, value: str) -> None:
    """A directory a run writes into can be one: it, or the nearest of its parents that exists,
    is no file."""
    blocking = file_in_the_way(Path(value))
    if blocking is not None:
        where = "this is a file" if blocking == Path(value) else f"{blocking} is a file"
        fail(key, value, f"a directory (to be created, or an earlier run's); {where}")


def _check_lengths(recipe: Recipe) -> None:
    """Every length the recipe asks for within what any run can take
    (:func:`attn_patterns.checks.length_rule`), before a pattern or a data cache is built for it
    (``model.target_length`` and ``data.seq_len`` are checked above to be >= 1 and >= 2)."""
    from attn_patterns.checks import length_rule, short

    lengths = recipe.validation.lengths
    for key, value, longest in (("model.target_length", recipe.model.target_length, recipe.model.target_length),
                                ("data.seq_len", recipe.data.seq_len, recipe.data.seq_len or 0),
                                ("validation.lengths", lengths, max(lengths, default=0))):
        rule = length_rule(longest)
        if rule:
            fail(key, value if short(value) == str(value) else short(value), rule)  # 400 digits shown by their count


def _check_data(recipe: Recipe) -> None:
    data = recipe.data
    _check_directory("data.cache_dir", data.cache_dir)
    if data.max_documents is not None and data.max_documents < 1:
        fail("data.max_documents", data.max_documents, "must be >= 1, or null for all")
    if data.seq_len is not None and not 2 <= data.seq_len <= recipe.model.target_length:
        fail("data.seq_len", data.seq_len,
             f"must be in [2, model.target_length={recipe.model.target_length}], or null (= model.target_length)")
    if data.chat_template is not None:
        from sparse_ft.data.conversations import read_chat_template

        if data.format != "chat":
            fail("data.chat_template", data.chat_template, f"only applies with data.format=chat, not {data.format}")
        try:
            read_chat_template(data.chat_template)
        except ValueError as err:
            fail("data.chat_template", data.chat_template, str(err))


def _check_tiny(model: ModelSection) -> None:
    """``model.tiny`` overrides build the tiny model's config now (no weights), so a misspelt
    name or dimensions LlamaConfig refuses fail here rather than after the run has started."""
    if not model.tiny:
        return
    if not is_built_in(model.name_or_path):
        fail("model.tiny", model.tiny, "only applies with model.name_or_path=tiny")
    from sparse_ft.modeling.tiny import tiny_llama_config, tiny_size_rule

    try:
        rule = tiny_size_rule(tiny_llama_config(**model.tiny))
    except Exception as err:  # LlamaConfig's checks raise several types, not all ValueError
        fail("model.tiny", model.tiny, one_line(err))
    if rule is not None:
        fail("model.tiny", model.tiny, rule)


def _check_attention(recipe: Recipe) -> None:
    """The pattern, its parameters and the backend, checked without building the method: the
    names against its class's signature, the values by its class-level check (the one its
    constructor runs, e.g. ``chunks >= 1``), the backend against its class's ``supports``. The
    recipe stays data: the run builds the method once, and refuses there a sequence length
    it degenerates at. ``auto`` is checked as the default backend every method takes: which
    backend it becomes is the training machine's to say."""
    from sparse_ft import methods

    att = recipe.attention
    try:
        methods.check_training(att.pattern, att.params, att.backend)
    except (TypeError, ValueError) as err:
        raise BadInput(f"recipe key attention.pattern / attention.params: {err}") from None
    if att.backend == "flash" and recipe.model.dtype == "float32":
        fail("attention.backend", att.backend, "flash-attn computes in float16/bfloat16 only and model.dtype is float32; use sdpa or auto")
    _check_dense(recipe)


def _check_dense(recipe: Recipe) -> None:
    """``attention.dense_layers``' form and ``train.dense_final_fraction``'s range; the layers'
    range needs the model's config (the trainer's preflight, ``plan``). Full attention
    (``attention.pattern: full``) has no pattern to run densely instead."""
    from sparse_ft.methods import dense_layers_rule

    att, fraction = recipe.attention, recipe.train.dense_final_fraction
    rule = dense_layers_rule(att.dense_layers)
    if rule is not None:
        fail("attention.dense_layers", att.dense_layers, rule)
    if not 0 <= fraction <= 1:
        fail("train.dense_final_fraction", fraction, "must be in [0, 1] (the fraction of the steps, the last ones, "
             "trained with full attention in every layer)")
    for key, value in (("attention.dense_layers", att.dense_layers), ("train.dense_final_fraction", fraction)):
        if value and att.pattern == "full":
            fail(key, value, "applies to a sparse pattern; attention.pattern=full attends fully in every layer already")


def _check_sequence_parallel(recipe: Recipe) -> None:
    """What Ulysses needs that the recipe alone decides (``train.gpus``, where the recipe
    states it, included); the heads and the launched world size are checked where they are
    known (preflight)."""
    sp, gpus = recipe.train.sequence_parallel_size, recipe.train.gpus
    if gpus is not None and (gpus < 1 or gpus % sp):
        fail("train.gpus", gpus, f"a positive multiple of train.sequence_parallel_size={sp} (the GPUs the recipe is "
             "written for), or null")
    if sp == 1:
        return
    if recipe.deepspeed is None:
        fail("train.sequence_parallel_size", sp, "> 1 needs DeepSpeed (Ulysses is DeepSpeed's): set deepspeed to a config in ds_configs/")
    if recipe.seq_len % sp:
        fail("train.sequence_parallel_size", sp, f"must divide the sequence length data.seq_len={recipe.seq_len} "
                                                 "(each rank holds seq_len / sp tokens)")


def _check_validation(recipe: Recipe) -> None:
    """The validation section's own shape; its task names and parameters need the task
    registry, a layer above recipes (sparse_ft/train/validation.py checks them)."""
    v = recipe.validation
    if not v.tasks or len(set(v.tasks)) < len(v.tasks):
        fail("validation.tasks", v.tasks, "task names, at least one, each once (e.g. [ppl, passkey])")
    if any(n < 1 for n in v.lengths):
        fail("validation.lengths", v.lengths, "positive lengths in tokens, or [] for [model.target_length]")
    for name, params in v.params.items():
        if name not in v.tasks or not isinstance(params, dict):
            fail(f"validation.params.{name}", params, f"a mapping of parameters of a task in validation.tasks ({', '.join(v.tasks)})")
    if (v.every_steps or v.at_end) and "ppl" in v.tasks and v.data is None:
        fail("validation.data", None, "the held-out data ppl scores: a text/jsonl/json/parquet file or directory, "
             "a .bin token file, or an HF dataset id (with validation.split)")
    if (v.every_steps or v.at_end) and recipe.train.sequence_parallel_size > 1:
        fail("validation.every_steps" if v.every_steps else "validation.at_end", v.every_steps or v.at_end,
             "validation does not run under sequence parallelism (train.sequence_parallel_size > 1) yet")


def check_sequence_parallel(sp: int, world_size: int, heads: int, kv_heads: int) -> None:
    """DeepSpeed's rules for Ulysses, before anything loads (:func:`sequence_parallel_rule`)."""
    rule = sequence_parallel_rule(sp, world_size, heads, kv_heads)
    if rule is not None:
        fail("train.sequence_parallel_size", sp, rule)


def sequence_parallel_rule(sp: int, world_size: int, heads: int, kv_heads: int) -> Optional[str]:
    """The rule of Ulysses an ``sp`` breaks, None if none (``sparse-ft plan --sp`` asks too):
    the world splits into SP groups, each rank attends with heads / sp query heads, and K/V
    heads split the same way or are replicated."""
    if sp == 1:
        return None
    if heads % sp:
        return f"must divide the model's num_attention_heads={heads} (each rank attends with heads / sp)"
    if kv_heads % sp and sp % kv_heads:
        return (f"must divide the model's num_key_value_heads={kv_heads} or be a multiple of it "
                "(then K/V heads are replicated)")
    if world_size % sp:
        return f"must divide the number of processes, {world_size} (data parallelism runs across world / sp groups)"
    return None


def lora_rank_rule(r: int, shapes: dict[str, tuple[int, int]]) -> Optional[str]:
    """Why ``lora.r`` cannot adapt layers of ``shapes`` (a name -> the weight's two sides, of
    each layer LoRA targets), None if it can: ``B @ A`` has rank at most the smaller side of the
    weight, so a rank past it adds parameters (and memory: ``r=100000000`` asked for 25 GB)
    and no rank. Checked where the shapes are known: the training preflight (the model's
    modules on the meta device) and ``sparse-ft plan`` (its shape table)."""
    if not shapes:
        return None
    name, sides = min(shapes.items(), key=lambda item: min(item[1]))
    if r <= min(sides):
        return None
    return f"at most {min(sides):,}, the smaller side of {name} ({sides[0]:,} x {sides[1]:,}): a rank past it adds parameters, not rank"


def _check_deepspeed(recipe: Recipe, config: dict) -> None:
    """Refuse a DeepSpeed config that would train differently from the recipe. (LongLoRA's
    ZeRO-3 config carried its own optimizer and schedule, which the HF Trainer silently used
    instead of the command line's.)"""
    where = f"deepspeed config {recipe.deepspeed}"
    for key in ("optimizer", "scheduler"):
        if key in config and not is_auto(config[key]):
            raise BadInput(
                f"{where} sets {key!r}: the {key} is the recipe's (AdamW with train.lr, train.weight_decay, train.betas; "
                f"train.scheduler with train.warmup_steps); remove it or write \"auto\""
            )
    for key, owned in RECIPE_OWNED.items():
        if key in config and not is_auto(config[key]) and config[key] != owned(recipe.train):
            raise BadInput(f"{where} sets {key}={config[key]!r} but the recipe says {owned(recipe.train)!r}; write \"auto\" there")
    if recipe.model.quantization != "none" and config.get("zero_optimization", {}).get("stage") == 3:
        from sparse_ft.modeling.quantization import float_storage_refused

        why = float_storage_refused()
        if why is not None:
            fail("model.quantization", recipe.model.quantization, f"{where} is ZeRO-3, which partitions 4-bit weights only "
                 f"in a float storage dtype, and {why}; use a ZeRO-2 config (zero2_bf16, zero2_fp16) or deepspeed: null")
    trains_in = precision(config)
    if trains_in != recipe.model.dtype:
        fail("model.dtype", recipe.model.dtype, f"{where} trains in {trains_in}; use a matching config or model.dtype={trains_in}")


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("params", "tiny", "wandb"):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
