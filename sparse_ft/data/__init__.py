"""Training data: text sources (sources.py), tokenisation with a cache and packing to fixed
length (packing.py), and the standard-library text behind the offline corpora (stdlib_text.py)."""

from sparse_ft.data.packing import PackedDataset, build_train_dataset, load_meta
from sparse_ft.data.sources import iter_texts

__all__ = ["PackedDataset", "build_train_dataset", "iter_texts", "load_meta"]
