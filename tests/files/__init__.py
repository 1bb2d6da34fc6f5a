"""Tests of what the commands write and never overwrite (``sparse_ft.files``)."""
