"""Tests of the project as a whole: layering, docs, lock, packaging, registries, integrations."""
