"""The laptop-scale experiment: the tiny base's corpus and pretraining, the experiment that
extends it with every method, and its report."""
