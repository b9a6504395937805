"""What the driver writes from the workers' shards: each checkpoint (the ranks write their parts
in the run's format, `checkpoint.formats`, the driver finishes and commits it) and the final
exports (the policy as a Hugging Face directory, a LoRA run's PEFT adapter)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from checkpoint_convert import durable
from mcore_dpo.checkpoint import formats
from mcore_dpo.checkpoint import layout as checkpoint
from mcore_dpo.config import TrainConfig
from mcore_dpo.driver.resume_check import run_identity
from mcore_dpo.model.chunks import file_pp

def layer_spec_of(group) -> str:
    """The layer spec the workers built their models with (Transformer Engine or local), which
    names the tensors in their shards; the driver's own environment does not decide it."""
    specs = {s for s in group.call("layer_spec") if s is not None}
    assert len(specs) == 1, f"workers disagree on the layer spec: {sorted(specs)}"
    return specs.pop()


def model_meta(config: TrainConfig, spec, *, dtype: str, layer_spec: str, hf_config: dict | None = None):
    """checkpoint_convert metadata for shards of this run's layout, plus the source's
    config/tokenizer files to carry along (custom *.py code only with --trust-remote-code).
    `hf_config`: the config.json to write in place of the source's (a reward model trained from
    a causal LM: `Prepared.hf_config`)."""
    from checkpoint_convert.io import FORMAT_VERSION, McoreMeta, open_hf_dir
    from checkpoint_convert.mcore_dir import is_mcore_dir, open_mcore_dir

    if is_mcore_dir(config.model):
        src = open_mcore_dir(config.model)
        source_config = src.meta.hf_config
        aux = sorted(p for p in src.hf_files_dir.iterdir() if p.is_file()) if src.hf_files_dir.is_dir() else []
    else:
        src = open_hf_dir(config.model)
        source_config, aux = src.config, src.aux_files()
    hf_config = hf_config if hf_config is not None else source_config
    if config.tokenizer:  # --tokenizer's files travel with the checkpoints, in place of the model's
        weights = (".safetensors", ".bin", ".pt", ".pth", ".distcp")
        given = [p for p in Path(config.tokenizer).iterdir() if p.is_file() and p.name != "config.json" and p.suffix not in weights]
        aux = [p for p in aux if p.name not in {g.name for g in given}] + given
    if config.chat_template:  # the template the data was rendered with travels with the weights
        template = Path(config.output_dir) / "chat_template.jinja"
        aux = [p for p in aux if p.name != template.name] + [template]
    if not config.trust_remote_code:
        aux = [p for p in aux if p.suffix != ".py"]
    meta = McoreMeta(
        spec=spec,
        tp=config.tp,
        pp=file_pp(config),  # with model chunks (--vpp) each chunk's file is a stage's (model/chunks.py)
        dtype=dtype,
        layer_spec=layer_spec,
        vocab_divisor=128,
        hf_config=hf_config,
        format_version=FORMAT_VERSION,
        ep=config.ep,  # at ep > 1 the workers write the converter's ep layout
        vpp=config.vpp,  # recorded: pp above is the stage files, config.pp ranks x vpp chunks
    )
    return meta, aux


def save_checkpoint(group, *, config: TrainConfig, spec, out: Path, step: int, identity: dict | None = None,
                    hf_config: dict | None = None) -> Path:
    """Workers write their parts into a partial directory in the run's format
    (`checkpoint.formats`); the driver finishes it (metadata, joined files) and makes it
    current atomically."""
    tmp = checkpoint.begin(out, step=step, fmt=config.save_format)
    group.call("save_checkpoint", str(tmp), step=step)
    meta, aux = model_meta(config, spec, dtype="float32", layer_spec=layer_spec_of(group),  # fp32 masters
                           hf_config=hf_config)
    formats.for_run(config).finish(tmp, config=config, spec=spec, meta=meta, aux=aux)
    state = {
        "step": step,
        "consumed_pairs": step * config.global_batch_size,
        "layout": {"tp": config.tp, "pp": config.pp, "vpp": config.vpp, "dp": config.dp, "ep": config.ep, "cp": config.cp},
        "config": config.to_dict(),
        "run": identity if identity is not None else run_identity(config),  # what a resume must agree on
    }
    return checkpoint.commit(out, tmp, step=step, trainer_state=state, keep_last=config.keep_last)


def export_adapter(group, *, config: TrainConfig, spec, out: Path) -> None:
    """OUT/adapter: the trained adapter as a PEFT adapter directory (replaced atomically)."""
    from checkpoint_convert.peft_adapter import adapter_config, join_shard_files, write_adapter_dir
    from mcore_dpo.model import lora

    shards = _staging_dir(out, "adapter")
    try:
        group.call("write_adapter", str(shards))
        shape = lora.shape_of(config)
        tensors = join_shard_files(shards, spec=spec, lora=shape, tp=config.tp, pp=file_pp(config))
        tmp = out / f"adapter.partial-{uuid.uuid4().hex[:8]}"
        write_adapter_dir(tmp, tensors, adapter_config(shape, spec=spec, dropout=config.lora_dropout,
                                                       base_model=os.path.abspath(config.model)))
        durable.fsync_tree(tmp)
        if (out / "adapter").exists():
            shutil.rmtree(out / "adapter")
        durable.move(tmp, out / "adapter")
    finally:
        shutil.rmtree(shards, ignore_errors=True)


def export_policy(group, *, config: TrainConfig, spec, out: Path, hf_config: dict | None = None) -> None:
    """Workers write the policy shards (LoRA: merged with the adapters); the driver converts
    them to OUT/hf (atomic)."""
    from checkpoint_convert.convert import mcore_to_hf_dir, write_mcore_meta

    staging = _staging_dir(out, "export")
    try:
        group.call("write_policy", str(staging))
        meta, aux = model_meta(config, spec, dtype=config.dtype, layer_spec=layer_spec_of(group), hf_config=hf_config)
        write_mcore_meta(staging, meta=meta, aux_files=aux)
        # model_meta already left custom code out unless --trust-remote-code: carry what it kept.
        mcore_to_hf_dir(staging, out / "hf", overwrite=True, trust_remote_code=config.trust_remote_code,
                        log=lambda _msg: None)
    finally:  # one copy of the final weights stays: OUT/hf (besides the checkpoints' fp32 masters)
        shutil.rmtree(staging, ignore_errors=True)


def _staging_dir(out: Path, what: str) -> Path:
    """A fresh directory for the ranks' shards of an export, under checkpoints/ with a
    `.partial-` name: removed when the export ends, and by the next start after a kill
    (`checkpoint.remove_partials`)."""
    staging = checkpoint.root(out) / f"{what}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    return staging
