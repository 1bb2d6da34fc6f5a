"""Tests of the patterns, DCA, LongHeads and their kernels (``attn_patterns``)."""
