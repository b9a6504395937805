"""What makes a resumed run the same run: the data (by content), the data order (seed, global
batch size, shuffling), the model, the chat template (by content) and the objective. A checkpoint records them
(`run_identity`); a resume compares them (`changes`) and refuses a silent change.

Not compared, on purpose: the layout (tp/pp/dp: resume reshards), max_steps (a run may be
extended), the output and logging settings.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from mcore_dpo.checkpoint.fingerprint import model_fingerprint
from mcore_dpo.config import TrainConfig
from mcore_dpo.data.mix import parse_sources
from mcore_dpo.data.sources import source_checksum
from mcore_dpo.objective import registry

IDENTITY_VERSION = 2  # 2: model fingerprints sample the weights' content


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_digest(path: str | Path) -> str:
    """A data source's identity: a file's SHA-256 (as checkpoints have always recorded it), or a
    saved dataset directory's `source_checksum` (its files' relative paths and checksums)."""
    if os.path.isdir(path):
        return "dataset:" + source_checksum(str(path))
    return file_sha256(path)


def data_identity(data: str | list[str]) -> str | list:
    """--data by content: one source's digest (a weight on a single source changes nothing), or
    a mix's [digest, weight] per source, in order (a weight changes the data order)."""
    sources = parse_sources(data)
    if len(sources) == 1:
        return data_digest(sources[0].path)
    return [[data_digest(s.path), s.weight] for s in sources]


def run_identity(config: TrainConfig) -> dict:
    """The fields a resume must agree on, as stored in trainer_state.json."""
    return {
        "version": IDENTITY_VERSION,
        "data": data_identity(config.data),
        "seed": config.seed,
        "global_batch_size": config.global_batch_size,
        "shuffle": not config.no_shuffle,
        "model": model_fingerprint(config.model),
        "ref_model": model_fingerprint(config.ref_model) if config.ref_model else None,
        # The template renders the conversations: another one changes every token.
        "chat_template": file_sha256(config.chat_template) if config.chat_template else None,
        # LoRA: the adapters' shape and starting adapter (a resume loads the adapters into it).
        "lora": {"rank": config.lora_rank, "alpha": config.lora_alpha, "targets": config.lora_targets,
                 "init_adapter": model_fingerprint(config.init_adapter) if config.init_adapter else None}
        if config.lora else None,
        "loss": {
            "loss_type": config.loss_type,
            "loss_weights": config.loss_weights,
            "beta": config.beta,
            "label_smoothing": config.label_smoothing,
            "reference_free": config.ref_mode == "none",
            # Another objective's loss; DPO's identity keeps its earlier form (older checkpoints resume).
            **({"objective": config.objective, **{name: getattr(config, name)
                                                  for name in registry.OBJECTIVES[config.objective].options}}
               if config.objective != "dpo" else {}),
        },
    }


_FLAGS = {
    "data": "--data (its content or weights)",
    "seed": "--seed",
    "global_batch_size": "--global-batch-size",
    "shuffle": "shuffle",
    "model": "--model",
    "ref_model": "--ref-model",
    "chat_template": "--chat-template (its content)",
    "lora": "LoRA (--lora-rank/--lora-alpha/--lora-targets/--init-adapter)",
    "loss": "the loss",
}


def changes(saved: dict, current: dict) -> list[str]:
    """What differs between a checkpoint's run identity and this run's, one phrase each, e.g.
    "--seed 1234 -> 5"; empty when the runs agree (or the checkpoint records no identity)."""
    if not saved or saved.get("version") != current.get("version"):
        return []
    found = []
    for key, label in _FLAGS.items():
        old, new = saved.get(key), current.get(key)
        if old == new:
            continue
        if key == "loss":
            diff = [f"{k} {(old or {}).get(k)!r} -> {new.get(k)!r}" for k in new if (old or {}).get(k) != new.get(k)]
            found.append(f"{label} ({', '.join(diff)})")
        elif key in ("data", "model", "ref_model", "chat_template", "lora"):
            found.append(f"{label} changed")
        else:
            found.append(f"{label} {old} -> {new}")
    return found
