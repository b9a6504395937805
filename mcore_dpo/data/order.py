"""Which pairs each step trains on: `StepOrder(config, counts, weights)[k]` is step k+1's global
batch, as pair indices into the token store, the same for any layout.

Epoch after epoch: an epoch's samples (every pair once, or a weighted mix's draw, data/mix.py)
cut into global batches (`pairs.global_batch_order`: shuffled by --seed unless --no-shuffle, the
last partial batch dropped). Only the epoch being read is held, as an int64 array: the driver's
memory grows with the data's index, not with the steps of a run.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mcore_dpo.data.mix import epoch_samples
from mcore_dpo.data.pairs import global_batch_order


class StepOrder:
    """The global batches of `max_steps` steps (module docstring). `counts`: each source's pairs
    in the store (an int: one source); `weights`: a weighted mix's, None for every pair once."""

    def __init__(self, *, max_steps: int, global_batch_size: int, seed: int, shuffle: bool,
                 counts: int | Sequence[int], weights: Sequence[float] | None = None) -> None:
        self.max_steps, self.global_batch_size, self.seed, self.shuffle = max_steps, global_batch_size, seed, shuffle
        self.counts = [counts] if isinstance(counts, int) else list(counts)
        self.weights = list(weights) if weights is not None else None
        # Every epoch has sum(counts) samples, so the same number of batches.
        self.batches_per_epoch = sum(self.counts) // global_batch_size
        self._epoch: tuple[int, np.ndarray] | None = None  # (epoch, its batches [batches, global_batch_size])

    @classmethod
    def of(cls, config, counts: int | Sequence[int], weights: Sequence[float] | None = None) -> StepOrder:
        """The order of a TrainConfig's run."""
        return cls(max_steps=config.max_steps, global_batch_size=config.global_batch_size, seed=config.seed,
                   shuffle=not config.no_shuffle, counts=counts, weights=weights)

    def __len__(self) -> int:
        return self.max_steps

    def __getitem__(self, k: int) -> list[int]:
        if not 0 <= k < self.max_steps:
            raise IndexError(f"step index {k} of a run of {self.max_steps} steps")
        epoch, batch = divmod(k, self.batches_per_epoch) if self.batches_per_epoch else (0, k)
        return [int(i) for i in self._batches(epoch)[batch]]

    def __iter__(self):
        return (self[k] for k in range(self.max_steps))

    def _batches(self, epoch: int) -> np.ndarray:
        if self._epoch is None or self._epoch[0] != epoch:
            samples = epoch_samples(counts=self.counts, weights=self.weights, seed=self.seed, epoch=epoch)
            order = global_batch_order(num_pairs=len(samples), global_batch_size=self.global_batch_size,
                                       seed=self.seed, shuffle=self.shuffle, epoch=epoch)
            self._epoch = (epoch, np.asarray(samples, dtype=np.int64)[np.asarray(order, dtype=np.int64)])
        return self._epoch[1]
