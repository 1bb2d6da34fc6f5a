"""Tests of the training data pipeline (``sparse_ft.data``)."""
