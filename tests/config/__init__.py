"""Tests of recipes: loading, validation, the shipped ones, every bad input (``sparse_ft.config``)."""
