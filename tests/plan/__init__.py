"""Tests of the memory planner (``sparse_ft.plan``)."""
