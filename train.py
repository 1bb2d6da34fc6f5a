"""Fine-tune a RoPE model to a longer context through a sparse attention pattern: the same
command as ``sparse-ft train`` (``sparse_ft/train/cli.py``), kept as a script for the launchers.

    deepspeed [--num_gpus N] [--hostfile H] train.py recipe=NAME [dotted.key=value ...]
    python train.py recipe=NAME [dotted.key=value ...]
    torchrun --nproc_per_node N train.py recipe=NAME ...
"""

import sys

from sparse_ft.cli import script


def main() -> int:
    return script("train", "train.py", sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
