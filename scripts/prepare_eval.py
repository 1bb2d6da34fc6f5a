"""Turn evaluation text into a flat token file for `sparse-ft eval ppl --data FILE.bin`:

    python scripts/prepare_eval.py --tokenizer meta-llama/Llama-2-7b-hf --source pg19 --output data/eval/pg19-val.bin
    python scripts/prepare_eval.py --tokenizer meta-llama/Llama-2-7b-hf --source proof-pile --output data/eval/proofpile-test.bin
    python scripts/prepare_eval.py --tokenizer tiny --source my_text.txt --output data/eval/mine.bin

Shortcuts: pg19 / pg19-test = the PG19 validation / test split (`emozilla/pg19`, a parquet copy
of `deepmind/pg19`, whose loading script current `datasets` no longer runs); proof-pile = the
Proof-pile test split (`hoskinson-center/proof-pile`). Anything else is an HF dataset id (with
--split) or a local text/jsonl/parquet file, directory or glob. Documents are joined by EOS;
the token width (uint16 / uint32) follows the vocabulary size and is recorded, with the token
count and the tokenizer, in a JSON sidecar beside the .bin.
"""

import argparse
import sys
from pathlib import Path

from sparse_ft.data.token_files import write_token_file
from sparse_ft.evaluation.tokens import text_tokens

SHORTCUTS = {
    "pg19": ("emozilla/pg19", "validation"),
    "pg19-test": ("emozilla/pg19", "test"),
    "proof-pile": ("hoskinson-center/proof-pile", "test"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="HF id or directory, or 'tiny' (byte-level)")
    parser.add_argument("--source", required=True, help=f"{', '.join(SHORTCUTS)}, an HF dataset id, or local files")
    parser.add_argument("--split", default=None, help="dataset split (default: the shortcut's, else validation)")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--output", type=Path, required=True, help="FILE.bin")
    args = parser.parse_args(argv)
    source, split = SHORTCUTS.get(args.source, (args.source, "validation"))
    try:
        if args.tokenizer == "tiny":
            from sparse_ft.modeling.tiny import tiny_tokenizer

            tokenizer = tiny_tokenizer()
        else:
            from sparse_ft.modeling.model_io import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer, args.trust_remote_code)
        tokens = text_tokens(source, tokenizer, args.split or split, args.text_column, max_tokens=args.max_tokens)
        if len(tokens) == 0:
            raise ValueError(f"--source {args.source} holds no text")
        path = write_token_file(tokens, args.output, len(tokenizer), args.tokenizer)
    except (ValueError, OSError) as err:
        print(f"prepare_eval: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(tokens)} tokens to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
