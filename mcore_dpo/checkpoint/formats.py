"""Checkpoint formats: one object each, behind one interface that the rank, the driver and the
resume path use alike, so that a format is decided in one place and a new one is one new file.

A format answers, for a checkpoint directory being written or read:
- `write(part, root, step=)`: on every rank, its part of the weights and optimizer state
  (`part`: the rank's `rank.checkpointer.Checkpointer`, which also writes the RNG states every
  format keeps);
- `finish(tmp, config=, spec=, meta=, aux=)`: on the driver, once every rank has written,
  before the directory is committed (`checkpoint.layout.commit`);
- `policy_weights(directory)`: what a resumed rank builds its policy from (None: the run's
  --model, a LoRA run's base);
- `moving_reference(directory)`: TR-DPO's reference as it had moved (None: the source);
- `read(directory, kind, part=)`: this rank's shard of one kind of state ("model" for the fp32
  masters, "optim/exp_avg", "optim/exp_avg_sq") under megatron names.

The formats: `shards.Shards` (checkpoint_convert's Megatron shards, the default),
`adapter.Adapter` (LoRA runs: PEFT adapter files), `torch_dist.TorchDist` (Megatron-LM's
torch_dist, --save-format torch_dist).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from mcore_dpo.checkpoint.adapter import Adapter
from mcore_dpo.checkpoint.shards import Shards
from mcore_dpo.checkpoint.torch_dist import TorchDist, is_torch_dist_checkpoint


class CheckpointFormat(Protocol):
    def write(self, part, root: Path, *, step: int) -> None: ...

    def finish(self, tmp: Path, *, config, spec, meta, aux) -> None: ...

    def policy_weights(self, directory: str | Path) -> str | None: ...

    def moving_reference(self, directory: str | Path) -> str | None: ...

    def read(self, directory: str | Path, kind: str, *, part) -> dict[str, torch.Tensor]: ...


def for_run(config) -> CheckpointFormat:
    """The format a run writes its checkpoints in."""
    if config.lora:
        return Adapter()
    return TorchDist() if config.save_format == "torch_dist" else Shards()


def of_checkpoint(directory: str | Path, config) -> CheckpointFormat:
    """The format of an existing checkpoint directory, which a run resumes from whatever format
    it writes (a LoRA run's checkpoints are always adapters)."""
    if config.lora:
        return Adapter()
    return TorchDist() if is_torch_dist_checkpoint(directory) else Shards()
