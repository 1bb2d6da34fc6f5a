"""Tests of the benchmarks (``sparse_ft.bench``)."""
