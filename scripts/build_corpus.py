"""Build the tiny base model's corpus from this Python's standard library plus synthetic
passkey documents (see sparse_ft/experiment/corpus.py):

    python scripts/build_corpus.py                       # data/corpus/ctx256: train.bin, val.bin, corpus.json
    python scripts/build_corpus.py --context 1024 --output data/corpus/ctx1024
"""

import argparse
import json
from pathlib import Path

from sparse_ft.experiment.corpus import RETRIEVAL_FRACTION, build_corpus
from sparse_ft.modeling.tiny import tiny_tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None, help="default: data/corpus/ctx<CONTEXT>")
    parser.add_argument("--context", type=int, default=256, help="tokens per training block")
    parser.add_argument("--retrieval-fraction", type=float, default=RETRIEVAL_FRACTION,
                        help="share of blocks that open with a retrieval document (a passkey one: this script builds passkeys only)")
    parser.add_argument("--val-percent", type=float, default=5.0, help="share of modules held out (by content hash)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    output = args.output or Path(__file__).resolve().parent.parent / "data" / "corpus" / f"ctx{args.context}"
    manifest = build_corpus(output, tiny_tokenizer(), args.context, args.retrieval_fraction,
                            val_percent=args.val_percent, seed=args.seed)
    print(json.dumps(manifest, indent=1))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
