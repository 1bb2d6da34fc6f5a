"""Train the tiny base's byte-level BPE tokenizer (sparse_ft/experiment/tokenizer.py) on the
training split of this Python's standard library, the corpus's text, and save it as a
transformers tokenizer (tokenizer.json; AutoTokenizer loads the folder offline):

    python scripts/train_tokenizer.py                    # assets/tiny-bpe, 4096 ids
    python scripts/train_tokenizer.py --vocab-size 8192 --output /tmp/bpe8k

Deterministic: the same Python (the same stdlib) writes the same bytes.
"""

import argparse
import platform
from pathlib import Path

from sparse_ft.experiment.tokenizer import TOKENIZER_DIR, VOCAB_SIZE, save, train_bpe, training_texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=TOKENIZER_DIR, help=f"default: {TOKENIZER_DIR}")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="ids, the 2 special tokens and 256 bytes included")
    parser.add_argument("--val-percent", type=float, default=5.0, help="share of modules held out (by content hash), "
                        "as scripts/build_corpus.py holds them out")
    args = parser.parse_args()
    texts = list(training_texts(val_percent=args.val_percent))
    save(train_bpe(texts, args.vocab_size), args.output, "scripts/train_tokenizer.py")
    print(f"wrote {args.output}: {args.vocab_size} ids from {len(texts)} stdlib modules "
          f"({sum(map(len, texts)):,} characters) of Python {platform.python_version()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
