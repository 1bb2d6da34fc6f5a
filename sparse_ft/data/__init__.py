"""Data, below training and evaluation (it imports neither): text sources (sources.py),
tokenisation with a cache and packing to fixed length (packing.py), chat and instruction rows
with their answer masks (conversations.py) packed whole (turn_packing.py), the standard-library text
behind the offline corpora and RULER's default haystack (stdlib_text.py; the corpus is
sparse_ft/experiment/corpus.py) and flat token files (token_files.py)."""

from sparse_ft.data.packing import PackedDataset, build_train_dataset, load_meta
from sparse_ft.data.sources import iter_texts

__all__ = ["PackedDataset", "build_train_dataset", "iter_texts", "load_meta"]
