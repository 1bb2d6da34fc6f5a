"""Tests of the training-free methods' model glue (``sparse_ft.methods``)."""
