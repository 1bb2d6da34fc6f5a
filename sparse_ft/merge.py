"""``sparse-ft merge``: fold a trained adapter into its base and write a plain HF model whose
config carries the adapter's RoPE configuration, so it loads anywhere with no sparse-ft."""

from __future__ import annotations

import argparse
from pathlib import Path

from sparse_ft.models import DTYPES, atomic_directory, load_adapter_model, load_tokenizer


def add_parser(sub) -> None:
    p = sub.add_parser("merge", help="merge a trained adapter into its base model")
    p.add_argument("--adapter", required=True, help="adapter directory written by train.py")
    p.add_argument("--base", default=None, help="base model (default: the one the adapter was trained on)")
    p.add_argument("--output", required=True, type=Path, help="directory for the merged model (safetensors)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype the merge runs and saves in")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the base model's own code (off by default)")
    p.set_defaults(func=main)


def merge(adapter: str, output: Path, base: str | None = None, dtype: str = "float32", trust_remote_code: bool = False) -> Path:
    model = load_adapter_model(adapter, base, DTYPES[dtype], trust_remote_code).merge_and_unload()
    tokenizer_dir = adapter if (Path(adapter) / "tokenizer_config.json").exists() else model.config._name_or_path
    with atomic_directory(output) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        load_tokenizer(str(tokenizer_dir), trust_remote_code).save_pretrained(str(tmp))
    return output


def main(args: argparse.Namespace) -> int:
    out = merge(args.adapter, args.output, args.base, args.dtype, args.trust_remote_code)
    print(f"merged model written to {out}")
    return 0
