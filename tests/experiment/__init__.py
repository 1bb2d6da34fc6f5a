"""Tests of the built-in experiment, its corpus, base model and tokenizer (``sparse_ft.experiment``)."""
