"""Writes that leave the previous state readable when the process is killed (or the machine
loses power) at any moment: data is fsynced before a rename makes it visible, and the
directory is fsynced after the rename so the new name itself is on disk.

The converter's atomic output (`atomic_output_dir`) uses it, and so do the trainer's checkpoints,
metrics log and run files (mcore_dpo depends on checkpoint_convert, never the reverse)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from checkpoint_convert.families.base import ConversionError


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


def _is_within(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def _apply_umask_permissions(root: Path) -> None:
    # mkdtemp (and safetensors' writer) create owner-only entries; the result should get the
    # permissions a plain mkdir/open would have given.
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def atomic_output_dir(target: str | os.PathLike, *, overwrite: bool, inputs: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yield a fresh temporary directory beside target; on success it replaces target.

    Any exception, KeyboardInterrupt included, removes the temporary directory and leaves
    target (and every input) untouched.
    """
    target = Path(target).resolve()
    for source in inputs:
        source = Path(source).resolve()
        if _is_within(source, target) or _is_within(target, source):
            raise ConversionError(f"{target}: output must not overlap the input {source}")
    if target.exists() and not target.is_dir():
        raise ConversionError(f"{target}: exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ConversionError(f"{target}: directory is not empty (pass --overwrite to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _apply_umask_permissions(tmp)
        fsync_tree(tmp)  # the data is on disk before a rename makes it visible
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "previous")
            os.replace(tmp, target)
            fsync_dir(target.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
            fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
