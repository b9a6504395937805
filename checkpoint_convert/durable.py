"""Writes that leave the previous state readable when the process is killed (or the machine
loses power) at any moment: data is fsynced before a rename makes it visible, and the
directory is fsynced after the rename so the new name itself is on disk.

The converter's atomic output uses it, and so do the trainer's checkpoints, metrics log and run
files (mcore_dpo depends on checkpoint_convert, never the reverse)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def write_file(path: Path, text: str) -> None:
    """Write `text` to a new file and flush it to disk (not atomic: for files that only become
    visible through a later `move`, such as those inside a partial checkpoint)."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def replace_file(path: Path, text: str) -> None:
    """Make `path` hold `text`, atomically: readers see the old content or the new, never a mix."""
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    write_file(tmp, text)
    move(tmp, path)


def move(src: Path, dst: Path) -> None:
    """Rename `src` to `dst` (a file, or a directory onto a free name) and make the rename durable."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)
    if Path(src).parent != Path(dst).parent:
        fsync_dir(Path(src).parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under `path` (files first, then their directory)."""
    for dirpath, _, files in os.walk(path, topdown=False):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(dirpath))
