"""Full-parameter training through the :class:`Trainer`: the loop, optimizer, schedule, data
order, logging and checkpoints stay the fine-tuning ones, so pretraining has no loop or
schedule of its own; only what is trained, and on what, differs. ``sparse-ft pretrain`` trains
the tiny base model this way: the recipe's model (the tiny model fresh from ``train.seed``, or
a checkpoint to continue) with every weight trainable and no adapters, on token blocks already
cut to the context (a pretraining corpus), in one plain-torch process."""

from __future__ import annotations

import numpy as np
import torch

from sparse_ft.config import Recipe
from sparse_ft.config.bad_input import fail
from sparse_ft.data.packing import TokenBlocks
from sparse_ft.train.activations import reduce_activation_memory
from sparse_ft.train.model_setup import load_base, train_through
from sparse_ft.train.preflight import check_model
from sparse_ft.train.trainer import Trainer
from sparse_ft.train.validation import Validation


class Pretrainer(Trainer):
    """A :class:`Trainer` of every weight on ``blocks`` (samples, ``recipe.seq_len``) of
    token ids. After :meth:`run`, ``model`` is the trained model, for its caller to evaluate
    and save whole."""

    trains_adapters = False

    def __init__(self, recipe: Recipe, blocks: np.ndarray, progress: bool = True, *, stops_on_signals: bool = True) -> None:
        """``stops_on_signals``: False when the run directory is temporary (a checkpoint saved on
        a signal would not outlive the call)."""
        super().__init__(recipe, progress)
        self.blocks = blocks
        self.stops_on_signals = stops_on_signals

    def preflight(self) -> None:
        """The model's checks: there are no adapters to match, and the blocks are in memory.
        Every weight trains, which a 4-bit base cannot."""
        if self.recipe.model.quantization != "none":
            fail("model.quantization", self.recipe.model.quantization, "pretraining trains every weight in full; use none")
        check_model(self.recipe, self.method)
        self.validation = Validation(self.recipe, None, self.method)  # off: its recipes validate nothing

    def load_dataset(self) -> TokenBlocks:
        return TokenBlocks(self.blocks)

    def build_model(self) -> torch.nn.Module:
        """The base, every weight trainable, attending through the training method."""
        model = train_through(load_base(self.recipe, self.base, self.ds_config), self.method,
                              self.recipe.train.gradient_checkpointing)
        return reduce_activation_memory(model, self.recipe.train)

    def adapter_meta(self) -> None:
        """No adapter: every weight trains, and the caller saves the model whole."""
        return None

    def save(self) -> dict:
        """The summary only: the model is saved by the caller, with its evaluation. Training
        switched the KV cache off; a base model generates with it."""
        self.model.config.use_cache = True
        return self.summary({})
