"""Training checkpoints on disk: layout, atomic commit, the `latest` pointer, pruning.

    OUTPUT/checkpoints/
      latest                      name of the current checkpoint (replaced atomically)
      step_00000010/
        model/                    policy weights (fp32 masters, whole: a dp-sharded optimizer
                                  gathers its slices), checkpoint_convert Megatron format (any
                                  tp/pp/dp can read it: mcore-to-hf exports it, resume reshards it)
        optim/exp_avg/            AdamW first moments, same format and layout as the weights
        optim/exp_avg_sq/         AdamW second moments
                                  (a tensor the optimizer does not train, the routers' expert
                                  bias, is in model/ as it is, with zero moments)
        reference/                the reference weights, with --sync-ref-model only (TR-DPO moves them)
        (LoRA runs: no model/; adapter/ holds the adapters' fp32 masters as a PEFT adapter,
        optim/exp_avg*/adapter_model.safetensors their moments under the same PEFT names, and
        base.json the base model's path and fingerprint)
        rng/rank{r}.safetensors   each rank's RNG states
        trainer_state.json        step, data position, layout, resolved config
        manifest.json             every other file's size and XXH3-64 checksum (checkpoint_convert/integrity.py)
      step_00000012.partial-*     a checkpoint being written (never current; removed on resume)

With --save-format torch_dist a checkpoint is a Megatron-LM iteration directory instead
(`iter_0000010/`, see checkpoint/torch_dist.py), and `latest_checkpointed_iteration.txt`, Megatron-LM's
own pointer, is replaced right after `latest`: OUTPUT/checkpoints is then a Megatron-LM save directory.
Both kinds go through the same begin/commit/prune below; a run may mix them.

A checkpoint is written into a `.partial-*` directory, fsynced, renamed to its final name, and
only then made current by replacing `latest` (a new file renamed over it; see durable.py). A kill at any moment leaves the previous checkpoint
current and loadable. The safetensors format holds only safetensors and JSON; the pickles of a
torch_dist one are read back only through checkpoint_convert's restricted unpickler.

A resume trusts no file blindly: `resume_point` checks the current checkpoint against its
manifest on the driver (one read of its files: at the hash's 7 GB/s the disk sets the cost) and
falls back to the newest older one that checks, saying so in one line; `make_current` then
points `latest` at it, so the run's next save of a step that failed replaces that checkpoint
(commit's same-step rule) and pruning counts from it. The ranks then read the checkpoint's
weights and optimizer state without reading checksums again (Rank.build(checked=True),
shards.Shards.read; the rank each Megatron file records is still checked:
checkpoint_convert.io). A checkpoint written before manifests resumes unchecked.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from checkpoint_convert import durable, integrity
from checkpoint_convert.io import META_FILE

FORMAT = "mcore_dpo.trainer_checkpoint"
FORMAT_VERSION = 1
MOMENTS = ("exp_avg", "exp_avg_sq")
# LoRA checkpoints: checkpoint kind -> directory of its whole PEFT-named adapter_model.safetensors.
KINDS = ("model",) + tuple(f"optim/{m}" for m in MOMENTS)  # the state a checkpoint keeps: fp32 masters, moments
ADAPTER_DIRS = {"model": "adapter", **{f"optim/{m}": f"optim/{m}" for m in MOMENTS}}
LORA_SHARDS = "lora_shards"  # the ranks' adapter shards, joined into ADAPTER_DIRS before the commit
BASE_FILE = "base.json"


def root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
_PREFIXES = ("step_", "iter_")


def name_of(step: int, *, fmt: str = "safetensors") -> str:
    return f"iter_{step:07d}" if fmt == "torch_dist" else f"step_{step:08d}"


def _step_of(name: str) -> int | None:
    """The step of a checkpoint directory name of either format, else None."""
    for prefix in _PREFIXES:
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return int(name[len(prefix):])
    return None


def begin(output_dir: str | Path, *, step: int, fmt: str = "safetensors") -> Path:
    """A fresh directory to write the checkpoint of `step` into."""
    tmp = root(output_dir) / f"{name_of(step, fmt=fmt)}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp


def commit(output_dir: str | Path, tmp: Path, *, step: int, trainer_state: dict, keep_last: int) -> Path:
    """Finish a checkpoint written into `tmp`: state file, fsync, rename, then point `latest` at it.

    A checkpoint of the same step left by an earlier attempt (renamed, but never made current)
    is moved aside, not deleted, until the new one has its name; a kill leaves the aside copy
    as a `.partial-*` leftover that `remove_partials` clears."""
    base = root(output_dir)
    state = {"format": FORMAT, "format_version": FORMAT_VERSION, **trainer_state}
    durable.write_file(tmp / "trainer_state.json", json.dumps(state, indent=2) + "\n")
    integrity.write_manifest(tmp, known=_recorded_checksums(tmp))
    durable.fsync_tree(tmp)
    final = base / tmp.name.split(".partial-", 1)[0]
    aside = None
    if final.exists():
        if final.name == _current_name(base):
            raise CheckpointError(f"{final}: is the current checkpoint; a new checkpoint of step {step} cannot replace it")
        aside = base / f"{final.name}.partial-replaced-{uuid.uuid4().hex[:8]}"
        durable.move(final, aside)
    durable.move(tmp, final)
    durable.replace_file(base / "latest", final.name + "\n")
    _point_megatron_tracker(base, final)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    _checked[final] = (_signature(final), None)  # written and checksummed by this process just now
    prune(output_dir, keep_last=keep_last)
    return final


def _recorded_checksums(directory: Path) -> dict[str, dict]:
    """The checksums the Megatron directories inside a checkpoint (model/, optim/*/) recorded
    when their metadata was written moments ago, by path relative to `directory`: the manifest
    takes them instead of reading those files a second time."""
    known = {}
    for meta in directory.rglob(META_FILE):
        try:
            recorded = json.loads(meta.read_text()).get("checksums") or {}
        except (OSError, ValueError):
            continue
        prefix = meta.parent.relative_to(directory).as_posix()
        known.update({f"{prefix}/{rel}": entry for rel, entry in recorded.items() if isinstance(entry, dict)})
    return known


def _point_megatron_tracker(base: Path, current: Path) -> None:
    """Megatron-LM's pointer follows `latest` when the current checkpoint is a torch_dist one;
    otherwise it is removed (Megatron-LM cannot continue from the safetensors format)."""
    tracker = base / MEGATRON_TRACKER
    if current.name.startswith("iter_"):
        durable.replace_file(tracker, str(_step_of(current.name)) + "\n")
    elif tracker.exists():
        tracker.unlink()
        durable.fsync_dir(base)


def _current_name(base: Path) -> str | None:
    pointer = base / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


def latest(output_dir: str | Path) -> Path | None:
    """The current checkpoint, or None when the run has none."""
    pointer = root(output_dir) / "latest"
    if not pointer.is_file():
        return None
    path = root(output_dir) / pointer.read_text().strip()
    if not (path / "trainer_state.json").is_file():
        raise CheckpointError(f"{pointer}: points at {path.name}, which is not a complete checkpoint")
    return path


# Checkpoints this process has checked (or written): the size and mtime of each file then, and
# the check's error (None: intact). The driver picks the resume point before the first attempt
# and again at each attempt; a checkpoint whose files did not change is not read again.
_checked: dict[Path, tuple[tuple, str | None]] = {}


def _signature(path: Path) -> tuple:
    return tuple(sorted((os.path.relpath(os.path.join(d, f), path), os.stat(os.path.join(d, f)).st_size,
                         os.stat(os.path.join(d, f)).st_mtime_ns) for d, _, files in os.walk(path) for f in files))


def check(path: Path) -> None:
    """Raise CheckpointError (one line naming the file) unless every file of the checkpoint at
    `path` matches its manifest; a checkpoint without one (written before manifests) passes."""
    signature = _signature(path)
    if path not in _checked or _checked[path][0] != signature:
        try:
            integrity.verify_manifest(path)
            _checked[path] = (signature, None)
        except integrity.IntegrityError as error:
            _checked[path] = (signature, str(error))
    if _checked[path][1] is not None:
        raise CheckpointError(_checked[path][1])


def resume_point(output_dir: str | Path) -> tuple[Path | None, str | None]:
    """The checkpoint a resume starts from: the current one when its files match its manifest,
    else the newest older one that does, with a one-line note saying so (None when it is the
    current one). (None, None) when the run has no checkpoint; CheckpointError naming the
    current checkpoint's bad file when none is intact."""
    current = latest(output_dir)
    if current is None:
        return None, None
    try:
        check(current)
        return current, None
    except CheckpointError as error:
        first = error
    steps = {p: _step_of(p.name) for p in root(output_dir).iterdir() if (p / "trainer_state.json").is_file()}
    older = sorted((p for p, step in steps.items() if step is not None and step < steps[current]),
                   key=steps.get, reverse=True)
    for candidate in older:
        try:
            check(candidate)
        except CheckpointError:
            continue
        return candidate, (f"{first}; resuming from the older intact checkpoint {candidate.name} (step "
                           f"{_step_of(candidate.name)}) instead")
    also = f" (and the {len(older)} older one{'s' if len(older) != 1 else ''} too)" if older else ""
    raise CheckpointError(f"{first}; no intact checkpoint to resume from{also}; pass --overwrite to start "
                          "afresh there, or choose another --output-dir")


def make_current(output_dir: str | Path, path: Path) -> None:
    """Point `latest` (and Megatron-LM's pointer) at the checkpoint `path`, an older one a
    resume falls back to: the newer checkpoints that failed stay until the run saves their step
    again (commit moves a non-current one of the same step aside) or pruning removes them."""
    base = root(output_dir)
    if _current_name(base) != path.name:
        durable.replace_file(base / "latest", path.name + "\n")
        _point_megatron_tracker(base, path)


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
            if ".partial-" in path.name or path.name.startswith(("latest.tmp-", f"{MEGATRON_TRACKER}.tmp-")):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def prune(output_dir: str | Path, *, keep_last: int) -> None:
    if keep_last <= 0:
        return
    base = root(output_dir)
    found = [p for p in base.iterdir() if p.is_dir() and _step_of(p.name) is not None]
    steps = sorted(found, key=lambda p: _step_of(p.name))
    current = _current_name(base)
    for path in steps[:-keep_last]:
        if path.name != current:
            shutil.rmtree(path, ignore_errors=True)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; str() is one line naming the file."""
