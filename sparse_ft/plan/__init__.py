"""``sparse-ft plan``: peak GPU memory of a recipe by arithmetic, and the longest context that fits."""
