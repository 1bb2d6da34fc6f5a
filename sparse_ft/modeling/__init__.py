"""What sparse-ft knows of transformers' models: RoPE configuration, model I/O and
adapters, the tiny models, 4-/8-bit loading, dtypes, and the attention seam (a method
installed into any model through ``AttentionInterface``)."""
