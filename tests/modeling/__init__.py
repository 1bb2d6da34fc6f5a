"""Tests of the patterns inside transformers models (``sparse_ft.modeling``)."""
