"""Benchmarks: each prints a ratio against the dense baseline measured in the same run."""
