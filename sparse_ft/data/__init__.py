"""Dataset preparation: text sources, tokenisation with a cache, packing."""
