"""``sparse-ft merge``: fold a trained adapter into its base and write a plain HF model whose
config carries the adapter's RoPE configuration, so it loads anywhere with no sparse-ft: in
transformers without a warning (only the RoPE keys its ``rope_type`` takes,
``rope.portable``), in vLLM and SGLang by the keys they read (docs/serving.md).
``--method dca`` adds Qwen's ``dual_chunk_attention_config``, which those engines serve for the
Qwen families (``sparse_ft.methods.dca.engine_config``).

The output is checked before anything loads: it may not overlap the adapter or the base, and
it replaces only an earlier output of sparse-ft, with ``--overwrite``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from sparse_ft.files.keyvalue import parse_assignments
from sparse_ft.modeling import dtypes

HELP = "merge a trained adapter into its base model"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter", required=True, help="adapter directory written by sparse-ft train")
    p.add_argument("--base", default=None, help="base model: HF id, local directory or 'tiny' (default: the one the "
                   "adapter was trained on)")
    p.add_argument("--allow-other-base", action="store_true",
                   help="merge into a --base with other weights than the base the adapter was trained on")
    p.add_argument("--output", required=True, type=Path,
                   help="directory for the merged model (safetensors); new, empty, or an earlier output with --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace --output when it holds an earlier sparse-ft output")
    p.add_argument("--dtype", choices=dtypes.NAMES, default="float32", help="dtype the merge runs and saves in")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the base model's own code")
    p.add_argument("--method", choices=("dca",), default=None,
                   help="also write Qwen's dual_chunk_attention_config, which SGLang serves for Qwen2/Qwen3 models (default: none)")
    p.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="with --method dca: chunk_size, local_window, pretraining_length, logit_scale (qwen or none); "
                   "repeatable (default: the qwen variant's defaults from the model's context)")
    p.add_argument("--context-length", type=int, default=None,
                   help="with --method dca (and required there): the length the merged config declares as "
                   "max_position_embeddings (default: the adapter's)")
    p.set_defaults(func=main)


def _export_dca(config, method_args: dict, context_length: Optional[int]) -> None:
    """Add the engines' DCA configuration to ``config`` and declare ``context_length``."""
    from sparse_ft.methods.dca import CONFIG_KEY, engine_config

    if not isinstance(context_length, int) or context_length < 1:
        raise ValueError(f"--method dca needs --context-length N, the length engines may then serve (given: {context_length}; "
                         "Qwen2.5-1M declares 1010000)")
    setattr(config, CONFIG_KEY, engine_config(config, method_args))
    config.max_position_embeddings = context_length


def engine_lengths(config) -> dict[str, int]:
    """The longest input vLLM and SGLang derive from ``config`` when not told: vLLM
    multiplies max_position_embeddings by the RoPE factor (yarn: original_max_position_embeddings
    by it; llama3 / longrope: no factor), SGLang likewise unless the scaling names
    original_max_position_embeddings (``_get_and_verify_max_len`` in vllm/config/model.py,
    ``get_context_length`` in sglang/srt/utils/hf_transformers_utils.py)."""
    from sparse_ft.modeling.rope import rope_parameters

    params = rope_parameters(config)
    kind, factor, length = params["rope_type"], float(params.get("factor") or 1.0), int(config.max_position_embeddings)
    scaled = kind not in ("default", "llama3", "longrope")
    vllm = (params["original_max_position_embeddings"] if kind == "yarn" else length) * (factor if scaled else 1.0)
    sglang = length * (factor if kind not in ("llama3",) and "original_max_position_embeddings" not in params else 1.0)
    return {"vLLM": int(vllm), "SGLang": int(sglang)}


def merge(adapter: str, output: Path, base: Optional[str] = None, dtype: str = "float32", *,
          trust_remote_code: bool = False, overwrite: bool = False, allow_other_base: bool = False,
          method: Optional[str] = None, method_args: Optional[dict] = None, context_length: Optional[int] = None) -> Path:
    """The adapter and its base (checked: the weights it was trained on, unless
    ``allow_other_base``) merged into ``output``; every input checked before anything loads.
    ``method="dca"`` also writes the engines' DCA configuration (``method_args``) and declares
    ``context_length``."""
    from sparse_ft.modeling.dtypes import torch_dtype
    from sparse_ft.modeling import rope
    from sparse_ft.modeling.model_io import (adapter_base, base_config_for, check_model_path, load_adapter_model,
                                             load_tokenizer, read_meta, resolve_model)
    from sparse_ft.files.outputs import atomic_directory, check_apart, check_output_dir

    output = Path(output)
    named = base or adapter_base(adapter, read_meta(adapter, "--adapter"))
    base = resolve_model(named)
    check_model_path(base, "--base")
    check_apart(output, "--output", {"--adapter": adapter, "the base model": base})
    check_output_dir(output, overwrite)
    if method != "dca" and (method_args or context_length is not None):
        raise ValueError("--method-arg and --context-length go with --method dca")
    base, config = base_config_for(adapter, named, trust_remote_code, allow_other_base=allow_other_base)
    if method == "dca":  # refused before the weights load
        _export_dca(config, method_args or {}, context_length)
    model = load_adapter_model(adapter, base, torch_dtype(dtype), trust_remote_code, config=config).merge_and_unload()
    rope.make_portable(model.config)
    tokenizer_dir = adapter if (Path(adapter) / "tokenizer_config.json").exists() else base
    with atomic_directory(output, "sparse-ft merge", overwrite, "--output") as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        load_tokenizer(str(tokenizer_dir), trust_remote_code).save_pretrained(str(tmp))
    return output


def main(args: argparse.Namespace) -> int:
    out = merge(args.adapter, args.output, args.base, args.dtype, trust_remote_code=args.trust_remote_code,
                overwrite=args.overwrite, allow_other_base=args.allow_other_base, method=args.method,
                method_args=dict(parse_assignments(args.method_arg, "--method-arg")), context_length=args.context_length)
    print(f"merged model written to {out}")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(out, trust_remote_code=args.trust_remote_code)
    derived = engine_lengths(config)
    if any(n != config.max_position_embeddings for n in derived.values()):
        print(f"note: vLLM / SGLang derive {derived['vLLM']} / {derived['SGLang']} tokens from this config, not its "
              f"max_position_embeddings {config.max_position_embeddings}: serve it with --max-model-len "
              f"{config.max_position_embeddings} (vLLM) / --context-length {config.max_position_embeddings} (SGLang); "
              "docs/serving.md", file=sys.stderr)
    return 0
