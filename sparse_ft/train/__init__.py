"""LoRA+ fine-tuning with position interpolation through a sparse attention pattern."""
