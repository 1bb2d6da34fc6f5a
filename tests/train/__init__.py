"""Tests of training runs, single-process and DeepSpeed, their faults and resumes (``sparse_ft.train``)."""
