"""The checkpoint format of LoRA runs: the adapters' fp32 masters and AdamW moments as whole
PEFT-named adapter directories (`adapter/`, `optim/exp_avg/`, `optim/exp_avg_sq/`: any layout
resumes from them), and
the base model's path and fingerprint (`base.json`); the base itself is not copied. The ranks
write their shards under `lora_shards/`, which the driver joins and removes.

A reward model's run (a `*ForSequenceClassification` spec) also trains its score head whole: each
of these directories holds it beside the adapters under PEFT's saved name of a SEQ_CLS
modules_to_save module, `base_model.model.score.weight` (its master, and its moments), and
`adapter/adapter_config.json` says task_type SEQ_CLS with modules_to_save ["score"], so that
`PeftModel.from_pretrained` on the base as AutoModelForSequenceClassification loads the head with
the adapters (checkpoint_convert.peft_adapter.saved_entries)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from checkpoint_convert import durable
from checkpoint_convert.peft_adapter import ADAPTER_WEIGHTS
from mcore_dpo.checkpoint.layout import ADAPTER_DIRS, BASE_FILE, KINDS, LORA_SHARDS
from mcore_dpo.model.chunks import file_pp


class Adapter:
    name = "adapter"

    def write(self, part, root: Path, *, step: int) -> None:
        for kind in KINDS:
            part.write_state(root / LORA_SHARDS / kind, kind.removeprefix("optim/"), adapter=True)

    def finish(self, tmp: Path, *, config, spec, meta, aux) -> None:
        from checkpoint_convert.peft_adapter import adapter_config, join_shard_files, write_adapter_dir
        from mcore_dpo.checkpoint.fingerprint import model_fingerprint
        from mcore_dpo.model import lora

        shape = lora.shape_of(config)
        for kind, directory in ADAPTER_DIRS.items():
            tensors = join_shard_files(tmp / LORA_SHARDS / kind, spec=spec, lora=shape, tp=config.tp,
                                       pp=file_pp(config))  # --vpp: a file per chunk (model/chunks.py)
            write_adapter_dir(tmp / directory, tensors,
                              adapter_config(shape, spec=spec, dropout=config.lora_dropout, base_model=os.path.abspath(config.model)))
        shutil.rmtree(tmp / LORA_SHARDS)
        base = {"model": os.path.abspath(config.model), "fingerprint": model_fingerprint(config.model)}
        durable.write_file(tmp / BASE_FILE, json.dumps(base, indent=2) + "\n")

    def policy_weights(self, directory: str | Path) -> str | None:
        return None  # the base never changes: the run's --model

    def moving_reference(self, directory: str | Path) -> str | None:
        return None

    def read(self, directory: str | Path, kind: str, *, part) -> dict[str, torch.Tensor]:
        from mcore_dpo.model import lora

        whole = load_file(str(Path(directory) / ADAPTER_DIRS[kind] / ADAPTER_WEIGHTS))
        return lora.adapter_shard(whole, rank=part.rank, saved=True)  # whole PEFT-named tensors: any layout takes its pieces
