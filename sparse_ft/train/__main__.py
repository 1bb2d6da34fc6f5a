"""``python -m sparse_ft.train`` (``deepspeed --module sparse_ft.train``): ``train.py`` for an
installed package, which has no checkout to hold the script."""

from sparse_ft.cli import script

raise SystemExit(script("train", "python -m sparse_ft.train"))
