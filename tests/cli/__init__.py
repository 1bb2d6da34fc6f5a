"""Tests of the command line: help, the console, stdout (``sparse_ft.cli``)."""
