"""`--ref-mode precomputed`'s reference log-probs on disk, kept with the run in OUTPUT/reference_logps:

    meta.json   {"format", "key", "num_pairs", "num_eval_pairs"}; written last
    train.npy   float32 [num_pairs, 2]: each training pair's summed log-probs, chosen then rejected
    eval.npy    the same for the held-out pairs (absent without --eval-data)

The reporting rank writes them once, into `reference_logps.partial-<random>` renamed into place, so a
crash leaves no tables that look complete. A resume or restart whose key matches (`is_complete`,
checked on the driver) maps them instead of running the reference pass again. The key
(`table_key`) covers what the log-probs depend on: the token stores, the reference model and how
log-probs are taken (dtype, --ld-alpha, --use-weighting).
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path

import numpy as np
import torch
import xxhash

from checkpoint_convert import durable

FORMAT = "mcore_dpo.reference_tables/1"
DIRECTORY = "reference_logps"


def table_key(*, data_key: str, eval_key: str | None, reference_model: str, dtype: str, ld_alpha: float | None,
              use_weighting: bool) -> str:
    """The tables' key: a digest of what their numbers depend on (the layout aside: a resume
    that reshards reuses them, as it reuses the checkpoint)."""
    inputs = {"format": FORMAT, "data": data_key, "eval_data": eval_key, "reference_model": reference_model,
              "dtype": dtype, "ld_alpha": ld_alpha, "use_weighting": use_weighting}
    return xxhash.xxh3_128(json.dumps(inputs, sort_keys=True).encode("utf-8")).hexdigest()


def remove_partials(output_dir: str | os.PathLike) -> None:
    """Leftovers of a write that was interrupted."""
    for path in Path(output_dir).glob(f"{DIRECTORY}.partial-*"):
        shutil.rmtree(path, ignore_errors=True)


def _meta(directory: Path) -> dict | None:
    try:
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def is_complete(directory: str | os.PathLike, *, key: str) -> bool:
    """Whether `directory` holds tables of `key` whose files have the shapes meta.json states."""
    directory = Path(directory)
    meta = _meta(directory)
    if meta is None or meta.get("key") != key:
        return False
    expected = {"train.npy": meta.get("num_pairs")}
    if meta.get("num_eval_pairs") is not None:
        expected["eval.npy"] = meta["num_eval_pairs"]
    for name, rows in expected.items():
        try:
            array = np.load(directory / name, mmap_mode="r")
        except (OSError, ValueError):
            return False
        if array.shape != (rows, 2) or array.dtype != np.float32:
            return False
    return True


def write(directory: str | os.PathLike, *, key: str, train: torch.Tensor, eval_table: torch.Tensor | None) -> None:
    """The tables, written beside `directory` and renamed over it (an older key's are replaced)."""
    directory = Path(directory)
    partial = directory.with_name(f"{directory.name}.partial-{uuid.uuid4().hex[:12]}")
    partial.mkdir(parents=True)
    try:
        tables = {"train.npy": train} | ({"eval.npy": eval_table} if eval_table is not None else {})
        for name, table in tables.items():
            with open(partial / name, "wb") as handle:
                np.save(handle, table.detach().to(torch.float32).cpu().numpy())
                handle.flush()
                os.fsync(handle.fileno())
        meta = {"format": FORMAT, "key": key, "num_pairs": int(train.shape[0]),
                "num_eval_pairs": None if eval_table is None else int(eval_table.shape[0])}
        durable.write_file(partial / "meta.json", json.dumps(meta, indent=1) + "\n")
        durable.fsync_dir(partial)
        if directory.exists():  # another key's tables: moved aside first, so no reader finds half of them
            aside = directory.with_name(f"{directory.name}.partial-{uuid.uuid4().hex[:12]}")
            os.replace(directory, aside)
            shutil.rmtree(aside, ignore_errors=True)
        durable.move(partial, directory)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def read(directory: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tables as read-only memory-mapped tensors (a lookup copies the rows it takes)."""
    directory = Path(directory)

    def mapped(name: str) -> torch.Tensor:
        with warnings.catch_warnings():  # torch warns that the mapping is not writable; it is never written
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.load(directory / name, mmap_mode="r"))

    return mapped("train.npy"), (mapped("eval.npy") if (directory / "eval.npy").exists() else None)
