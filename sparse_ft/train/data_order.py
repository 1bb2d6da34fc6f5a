"""Which samples each micro-batch trains on, so that a resume on another number of processes
(or another sequence-parallel size) neither skips nor repeats a sample of the epoch.

Epoch ``e``'s order is one permutation of the training set seeded by ``seed + e``: the same
however many processes train. A micro-batch takes the next ``groups × per_device_batch_size``
samples of it, data-parallel group ``g`` (a rank, or a sequence-parallel group of ranks) the
``g``-th slice. What a run has trained on is therefore a prefix of the epoch's permutation, and
a checkpoint records it as a :class:`DataPosition`; a resume continues the permutation from
there with the groups it has now. An epoch ends when fewer samples are left than a micro-batch
takes: those few are dropped (as ``drop_last`` does), and a run on fewer groups drops fewer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch


@dataclass(frozen=True)
class DataPosition:
    """Where a run stands: in ``epoch``, after the first ``consumed`` samples of its permutation."""

    epoch: int = 0
    consumed: int = 0

    def to_json(self) -> dict:
        return asdict(self)


class DataOrder:
    """The order of ``size`` samples for ``groups`` data-parallel groups of ``batch`` each."""

    def __init__(self, size: int, batch: int, groups: int, *, seed: int) -> None:
        self.size, self.batch, self.groups, self.seed = size, batch, groups, seed
        self.take = batch * groups  # samples per micro-batch, all groups together
        self.per_epoch = size // self.take  # micro-batches in an epoch begun afresh
        if self.per_epoch == 0:
            raise ValueError(
                f"the training set has {size} samples: fewer than per_device_batch_size={batch} × {groups} "
                "data-parallel processes; add data or lower data.min_tokens / data.seq_len"
            )
        self._perm: Optional[tuple[int, torch.Tensor]] = None

    def _left(self, at: DataPosition) -> int:
        """Micro-batches still in ``at``'s epoch (none where the data shrank under it)."""
        return max(0, (self.size - at.consumed) // self.take)

    def advance(self, start: DataPosition, micro: int) -> DataPosition:
        """The position ``micro`` micro-batches after ``start``. An epoch's end is kept in that
        epoch, so that a resume with fewer groups may still take what this run would drop."""
        left = self._left(start)
        if micro <= left:
            return DataPosition(start.epoch, start.consumed + micro * self.take)
        epochs, within = divmod(micro - left - 1, self.per_epoch)
        return DataPosition(start.epoch + 1 + epochs, (within + 1) * self.take)

    def remaining(self, start: DataPosition, epochs: int) -> int:
        """Micro-batches from ``start`` to the end of epoch ``epochs - 1``."""
        if start.epoch >= epochs:
            return 0
        return self._left(start) + (epochs - 1 - start.epoch) * self.per_epoch

    def indices(self, at: DataPosition, group: int) -> list[int]:
        """Group ``group``'s samples in the micro-batch that starts at ``at``."""
        epoch, consumed = (at.epoch, at.consumed) if self._left(at) else (at.epoch + 1, 0)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch)))
        first = consumed + group * self.batch
        return self._perm[1][first : first + self.batch].tolist()


def saved_position(data: dict, fingerprint: dict, world_size: int, checkpoint: Path) -> DataPosition:
    """The position a checkpoint's ``data`` record holds. One written before positions were
    recorded holds micro-batches consumed: under the order of then (rank ``r``'s ``m``-th
    batch was slot ``m × world + r`` of the epoch, an SP group taking its ranks' batches in
    turn) that is a prefix of the permutation, except inside a round of several groups."""
    if "consumed" in data:
        return DataPosition(data["epoch"], data["consumed"])
    sp = fingerprint.get("train.sequence_parallel_size", 1)
    batch = fingerprint["train.per_device_batch_size"]
    epoch, within = divmod(data["micro_batches"], data["samples"] // (batch * world_size) * sp)
    rounds, turns = divmod(within, sp)
    if turns and world_size > sp:
        raise ValueError(
            f"train.resume: {checkpoint}, written before sparse-ft recorded data positions, stopped inside a round of "
            f"sequence-parallel batches ({turns} of {sp}); resume from an earlier or later checkpoint"
        )
    return DataPosition(epoch, (rounds * world_size + turns) * batch)
