"""Tests of perplexity, passkey, RULER, the harness, generation and serving (``sparse_ft.evaluation``)."""
