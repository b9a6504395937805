"""Training checkpoints on disk: layout, atomic commit, the `latest` pointer, pruning.

    OUTPUT/checkpoints/
      latest                      name of the current checkpoint (replaced atomically)
      step_00000010/
        model/                    policy weights, checkpoint_convert Megatron format (any tp/pp
                                  can read it: mcore-to-hf exports it, resume reshards it)
        optim/exp_avg/            AdamW first moments, same format and layout as the weights
        optim/exp_avg_sq/         AdamW second moments
        reference/                the reference weights, with --sync-ref-model only (TR-DPO moves them)
        rng/rank{r}.safetensors   each rank's RNG states
        trainer_state.json        step, data position, layout, resolved config
      step_00000012.partial-*     a checkpoint being written (never current; removed on resume)

A checkpoint is written into a `.partial-*` directory, renamed to its final name, and only
then made current by replacing `latest`. A kill at any moment leaves the previous checkpoint
current and loadable. Only safetensors and JSON are written; nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

FORMAT = "mcore_dpo.trainer_checkpoint"
FORMAT_VERSION = 1
MOMENTS = ("exp_avg", "exp_avg_sq")


def root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def name_of(step: int) -> str:
    return f"step_{step:08d}"


def begin(output_dir: str | Path, *, step: int) -> Path:
    """A fresh directory to write the checkpoint of `step` into."""
    tmp = root(output_dir) / f"{name_of(step)}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp


def commit(output_dir: str | Path, tmp: Path, *, step: int, trainer_state: dict, keep_last: int) -> Path:
    """Finish a checkpoint written into `tmp`: state file, rename, then point `latest` at it."""
    state = {"format": FORMAT, "format_version": FORMAT_VERSION, **trainer_state}
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
    _fsync_tree(tmp)
    final = root(output_dir) / name_of(step)
    if final.exists():  # a checkpoint of the same step from an earlier attempt
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root(output_dir) / f"latest.tmp-{uuid.uuid4().hex[:8]}"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root(output_dir) / "latest")
    prune(output_dir, keep_last=keep_last)
    return final


def latest(output_dir: str | Path) -> Path | None:
    """The current checkpoint, or None when the run has none."""
    pointer = root(output_dir) / "latest"
    if not pointer.is_file():
        return None
    path = root(output_dir) / pointer.read_text().strip()
    if not (path / "trainer_state.json").is_file():
        raise CheckpointError(f"{pointer}: points at {path.name}, which is not a complete checkpoint")
    return path


def read_state(path: Path) -> dict:
    state_file = path / "trainer_state.json"
    try:
        state = json.loads(state_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{state_file}: unreadable ({error})") from None
    if state.get("format") != FORMAT or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{state_file}: not a {FORMAT} v{FORMAT_VERSION} checkpoint")
    return state


def remove_partials(output_dir: str | Path) -> None:
    """Leftovers of a save that was interrupted."""
    base = root(output_dir)
    if base.is_dir():
        for path in base.iterdir():
            if ".partial-" in path.name or path.name.startswith("latest.tmp-"):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def prune(output_dir: str | Path, *, keep_last: int) -> None:
    if keep_last <= 0:
        return
    base = root(output_dir)
    steps = sorted(p for p in base.iterdir() if p.is_dir() and p.name.startswith("step_") and ".partial-" not in p.name)
    current = (base / "latest").read_text().strip() if (base / "latest").is_file() else None
    for path in steps[:-keep_last]:
        if path.name != current:
            shutil.rmtree(path, ignore_errors=True)


def _fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; str() is one line naming the file."""
