"""File checksums: what a checkpoint records about its files, and the check that they are still
those files.

    python benchmarks/checksum.py     # the hash's speed on this machine (docs/BENCHMARKS.md §17)

The hash is xxHash's XXH3 (64 bits): not cryptographic (it guards against corruption and
files copied over one another, not against an adversary), and fast enough that the disk, not
the hash, sets the cost: 7,787 MB/s on a 1 GiB file in the page cache (median of 3 on a 2-core
Xeon; SHA-256 does 1,680 MB/s there), so a 70B model's 140 GB of bf16 shards take about 18 s of
one core, plus one read of the files where they are not cached. Files are hashed in blocks of
BLOCK_BYTES, never whole in memory.

An entry is {"bytes": size, "xxh3_64": hex digest}. A manifest (`write_manifest`) maps every
file under a directory, by its path relative to it, to its entry; `verify_manifest` checks a
directory against one. Every failure is an IntegrityError (a ConversionError): one line naming
the first file that differs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import xxhash

from checkpoint_convert import durable
from checkpoint_convert.families.base import ConversionError

HASH = "xxh3_64"
MANIFEST_FILE = "manifest.json"
# 1 MiB blocks hashed faster here than 8 MiB ones (the block stays in the CPU cache between the
# read and the hash: benchmarks/checksum.py); any size streams.
BLOCK_BYTES = 2**20


class IntegrityError(ConversionError):
    """A file that is not the one recorded; str() is one line, `path` the file, `problem` what differs."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = Path(path), problem


def file_checksum(path: str | os.PathLike) -> str:
    """The XXH3-64 hex digest of a file's bytes, read in blocks of BLOCK_BYTES."""
    digest = xxhash.xxh3_64()
    buffer = bytearray(BLOCK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while True:
            got = fh.readinto(buffer)
            if not got:
                break
            digest.update(view[:got])
    return digest.hexdigest()


def checksum_entry(path: str | os.PathLike) -> dict:
    """{"bytes": size, "xxh3_64": digest} of one file."""
    return {"bytes": os.path.getsize(path), HASH: file_checksum(path)}


def sidecar_path(path: str | os.PathLike) -> Path:
    """Where a writer leaves the entry of a file it has just written (hidden: no manifest lists it)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{HASH}")


def write_sidecar(path: str | os.PathLike, entry: Mapping) -> None:
    """Leave `entry`, computed while `path` was written, for `written_entry` to take."""
    sidecar_path(path).write_text(json.dumps(dict(entry)) + "\n")


def written_entry(path: str | os.PathLike) -> dict:
    """The entry of a file written moments ago: the one its writer left beside it (the bytes were
    hashed as they were written, so they are not read again), taken and removed; else (no such
    note, or the file's size changed since) the file is read and hashed."""
    path, note = Path(path), sidecar_path(path)
    try:
        entry = json.loads(note.read_text())
        note.unlink()
    except (OSError, ValueError):
        entry = None
    if isinstance(entry, dict) and entry.get("bytes") == path.stat().st_size and isinstance(entry.get(HASH), str):
        return {"bytes": entry["bytes"], HASH: entry[HASH]}
    return checksum_entry(path)


def verify_file(path: str | os.PathLike, entry: Mapping) -> None:
    """Raise IntegrityError unless the file at `path` has the size and checksum of `entry`."""
    path = Path(path)
    if not path.is_file():
        raise IntegrityError(path, "file is missing (the checksums list it)")
    size = path.stat().st_size
    if size != entry.get("bytes"):
        raise IntegrityError(path, f"has {size} bytes, {entry.get('bytes')} were recorded (the file is truncated or was replaced)")
    if file_checksum(path) != entry.get(HASH):
        raise IntegrityError(path, "checksum mismatch (the file is corrupt or was replaced)")


def _files(directory: Path) -> list[str]:
    """Every file under `directory` but hidden ones, as sorted relative POSIX paths."""
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if not name.startswith("."):
                found.append((Path(dirpath) / name).relative_to(directory).as_posix())
    return sorted(found)


def tree_checksums(directory: str | os.PathLike, *, exclude: tuple[str, ...] = (),
                   known: Mapping[str, Mapping] | None = None) -> dict[str, dict]:
    """Relative path -> entry of every file under `directory` but `exclude`. A file in `known`
    (entries computed moments ago, e.g. those a Megatron directory's metadata records) whose
    size still matches takes that entry instead of being read again."""
    directory = Path(directory)
    known = known or {}
    entries = {}
    for rel in _files(directory):
        if rel in exclude:
            continue
        path = directory / rel
        recorded = known.get(rel)
        if recorded is not None and recorded.get("bytes") == path.stat().st_size and HASH in recorded:
            entries[rel] = {"bytes": recorded["bytes"], HASH: recorded[HASH]}
        else:
            entries[rel] = checksum_entry(path)
    return entries


def write_manifest(directory: str | os.PathLike, *, known: Mapping[str, Mapping] | None = None) -> dict[str, dict]:
    """Write MANIFEST_FILE in `directory`, listing every other file under it with its entry
    (fsynced; the caller makes it visible, e.g. by renaming the directory). Returns the entries."""
    directory = Path(directory)
    entries = tree_checksums(directory, exclude=(MANIFEST_FILE,), known=known)
    manifest = {"hash": HASH, "files": entries}
    durable.write_file(directory / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")
    return entries


def read_manifest(directory: str | os.PathLike) -> dict[str, dict] | None:
    """The entries of `directory`'s manifest, or None when it has none (written before manifests)."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise IntegrityError(path, f"unreadable ({str(error).splitlines()[0]})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("hash") != HASH or not isinstance(files, dict):
        raise IntegrityError(path, f"not a manifest of {HASH} checksums")
    return files


def verify_entries(directory: str | os.PathLike, entries: Mapping[str, Mapping]) -> None:
    """Check every file `entries` lists under `directory` (sizes first, which cost nothing,
    then the checksums), in path order."""
    directory = Path(directory)
    for rel, entry in sorted(entries.items()):
        path = directory / rel
        if not path.is_file():
            raise IntegrityError(path, "file is missing (the checksums list it)")
        if path.stat().st_size != entry.get("bytes"):
            verify_file(path, entry)  # the size message
    for rel, entry in sorted(entries.items()):
        verify_file(directory / rel, entry)


def verify_manifest(directory: str | os.PathLike) -> bool:
    """Check `directory` against its manifest: every listed file present with its size and
    checksum, and no file it does not list. False when there is no manifest (nothing to check)."""
    directory = Path(directory)
    entries = read_manifest(directory)
    if entries is None:
        return False
    for rel in _files(directory):
        if rel != MANIFEST_FILE and rel not in entries:
            raise IntegrityError(directory / rel, f"is not listed in {directory / MANIFEST_FILE} (a file added or left behind)")
    verify_entries(directory, entries)
    return True
