"""A model directory's identity without reading all of its weights (`model_fingerprint`): what a
checkpoint records of the model it trained, the reference and the starting adapter
(driver/resume_check.py), and what an exported adapter records of its base (checkpoint/adapter.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLE_BLOCKS = 8  # blocks of every weight file a fingerprint reads, spread evenly, first and last included
SAMPLE_BLOCK_BYTES = 1 << 16


def _sampled_content(path: Path, size: int) -> bytes:
    """SAMPLE_BLOCKS blocks of `path` spread evenly over its `size` bytes (all of a small file)."""
    if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
        return path.read_bytes()
    last = size - SAMPLE_BLOCK_BYTES
    blocks = []
    with open(path, "rb") as fh:
        for k in range(SAMPLE_BLOCKS):
            fh.seek(last * k // (SAMPLE_BLOCKS - 1))
            blocks.append(fh.read(SAMPLE_BLOCK_BYTES))
    return b"".join(blocks)


def model_fingerprint(directory: str | Path) -> str:
    """A model directory's identity without reading all of its weights: the content of its JSON
    files (config, index, metadata), and the name, size and SAMPLE_BLOCKS sampled blocks of
    every other file. A move or copy of the directory keeps it; other weights (even of the same
    architecture and size), another config or file set change it."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        digest.update(rel.encode() + b"\0")
        if path.suffix == ".json":
            digest.update(path.read_bytes())
        else:
            size = path.stat().st_size
            digest.update(str(size).encode() + b"\0" + hashlib.sha256(_sampled_content(path, size)).digest())
        digest.update(b"\0")
    return digest.hexdigest()
