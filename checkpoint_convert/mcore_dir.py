"""Open a Megatron checkpoint directory in either format: this package's own (safetensors per
rank, checkpoint_convert.io) or torch_dist (checkpoint_convert.torch_dist).

It sits above both readers so that neither imports the other: torch_dist builds on io's meta
and views, and io knows nothing of torch_dist.
"""

from __future__ import annotations

import os
from pathlib import Path

from checkpoint_convert import torch_dist
from checkpoint_convert.io import META_FILE, McoreCheckpoint


def open_mcore_dir(directory: str | os.PathLike, *, hf_config_dir: str | os.PathLike | None = None,
                   verify_checksums: bool = True):
    """This package's format, or a torch_dist checkpoint; both offer meta, shard_view, hf_view
    and hf_files_dir. hf_config_dir only matters for a torch_dist checkpoint that carries no HF
    config of its own; verify_checksums=False: the caller has just checked the files
    (io.McoreCheckpoint)."""
    if not (Path(directory) / META_FILE).is_file() and torch_dist.is_torch_dist_dir(directory):
        return torch_dist.open_torch_dist(directory, hf_config_dir=hf_config_dir)
    return McoreCheckpoint(directory, verify_checksums=verify_checksums)


def is_mcore_dir(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a Megatron checkpoint in either format."""
    return (Path(directory) / META_FILE).is_file() or torch_dist.is_torch_dist_dir(directory)
