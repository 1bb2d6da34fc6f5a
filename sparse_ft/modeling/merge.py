"""``sparse-ft merge``: fold a trained adapter into its base and write a plain HF model whose
config carries the adapter's RoPE configuration, so it loads anywhere with no sparse-ft.

The output is checked before anything loads: it may not overlap the adapter or the base, and
it replaces only an earlier output of sparse-ft, with ``--overwrite``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from sparse_ft.modeling.dtypes import NAMES as DTYPES

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
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype the merge runs and saves in")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the base model's own code")
    p.set_defaults(func=main)


def merge(adapter: str, output: Path, base: Optional[str] = None, dtype: str = "float32", *,
          trust_remote_code: bool = False, overwrite: bool = False, allow_other_base: bool = False) -> Path:
    """The adapter and its base (checked: the weights it was trained on, unless
    ``allow_other_base``) merged into ``output``; every input checked before anything loads."""
    from sparse_ft.modeling.dtypes import torch_dtype
    from sparse_ft.modeling.model_io import (adapter_base, check_model_path, load_adapter_model, load_tokenizer,
                                             read_meta, resolve_model)
    from sparse_ft.files.outputs import atomic_directory, check_apart, check_output_dir

    output = Path(output)
    named = base or adapter_base(adapter, read_meta(adapter, "--adapter"))
    base = resolve_model(named)
    check_model_path(base, "--base")
    check_apart(output, "--output", {"--adapter": adapter, "the base model": base})
    check_output_dir(output, overwrite)
    model = load_adapter_model(adapter, named, torch_dtype(dtype), trust_remote_code,
                               allow_other_base=allow_other_base).merge_and_unload()
    tokenizer_dir = adapter if (Path(adapter) / "tokenizer_config.json").exists() else base
    with atomic_directory(output, "sparse-ft merge", overwrite, "--output") as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        load_tokenizer(str(tokenizer_dir), trust_remote_code).save_pretrained(str(tmp))
    return output


def main(args: argparse.Namespace) -> int:
    out = merge(args.adapter, args.output, args.base, args.dtype, trust_remote_code=args.trust_remote_code,
                overwrite=args.overwrite, allow_other_base=args.allow_other_base)
    print(f"merged model written to {out}")
    return 0
