"""Turn evaluation text into a flat token file for `sparse-ft eval ppl --data FILE.bin`:

    python data/prepare_eval.py --tokenizer meta-llama/Llama-2-7b-hf --source pg19 --output data/eval/pg19-val.bin
    python data/prepare_eval.py --tokenizer meta-llama/Llama-2-7b-hf --source proof-pile --output data/eval/proofpile-test.bin
    python data/prepare_eval.py --tokenizer tiny --source my_text.txt --output data/eval/mine.bin

Shortcuts: pg19 = the PG19 validation split (`emozilla/pg19`, as LongLoRA's eval data),
proof-pile = the Proof-pile test split (`hoskinson-center/proof-pile`). Anything else is an
HF dataset id (with --split) or a local text/jsonl/parquet file or directory.
"""

import argparse
from pathlib import Path

from sparse_ft.evaluation.tokens import text_tokens, write_token_file

SHORTCUTS = {"pg19": ("emozilla/pg19", "validation"), "proof-pile": ("hoskinson-center/proof-pile", "test")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="HF id or directory, or 'tiny' (byte-level)")
    parser.add_argument("--source", required=True)
    parser.add_argument("--split", default=None)
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    source, split = SHORTCUTS.get(args.source, (args.source, args.split or "validation"))
    if args.tokenizer == "tiny":
        from sparse_ft.tiny import tiny_tokenizer

        tokenizer = tiny_tokenizer()
    else:
        from sparse_ft.train.model_setup import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    tokens = text_tokens(source, tokenizer, args.split or split, args.text_column, args.max_tokens)
    if args.max_tokens:
        tokens = tokens[: args.max_tokens]
    path = write_token_file(tokens, args.output, len(tokenizer), args.tokenizer)
    print(f"wrote {len(tokens)} tokens to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
