"""Training checkpoints in Megatron-LM's format (--save-format torch_dist).

    OUTPUT/checkpoints/                   a Megatron-LM save directory (`--load OUTPUT/checkpoints`)
      latest                              this project's pointer: iter_0000010
      latest_checkpointed_iteration.txt   Megatron-LM's pointer: 10 (follows `latest`, see checkpoint/layout.py)
      iter_0000010/
        metadata.json .metadata __*_0.distcp   megatron-core dist_checkpointing, torch_dist backend
        common.pt           args (Namespace), checkpoint_version 3.0, iteration, opt_param_scheduler,
                            optimizer param_groups, content_metadata
        hf_files/           config.json + tokenizer files (checkpoint_convert reads the family there)
        rng/rank{r}.safetensors, trainer_state.json   as in the safetensors format

Every rank calls megatron-core's `dist_checkpointing.save` with its GPTModel's own
`sharded_state_dict()` (the model in the run's dtype, stored by global shape: stacked layers,
Transformer Engine norm names) plus the optimizer state in megatron-core's model-space layout,
the one its DistributedOptimizer writes as `fully_sharded_model_space`:
`optimizer.state.fp32_param.<key>` (the fp32 masters), `optimizer.state.exp_avg.<key>`,
`optimizer.state.exp_avg_sq.<key>`, each sharded exactly like the model tensor `<key>`. A
tensor the optimizer does not train (the routers' expert bias, a buffer in megatron-core) is in
every part too: its value as fp32_param, zero moments, so that each part is a whole model as
in the safetensors format (Megatron-LM's optimizer has no such keys; megatron-core's loader
reads a DeepSeek-V3 checkpoint's model and optimizer parts, tests/test_expert_bias_resume.py).
This project's optimizers (optim/adamw.py, optim/zero.py) are not megatron-core's (those do not run on a
CPU), so their state is put into that layout here: whole tensors per parameter, gathered over
dp ranks to dp rank 0 (the main replica), tp/pp sharding taken from the model's sharded tensors.
At cp > 1 the gather runs over dp x cp (the sharded optimizer's group) to its rank 0, which
megatron-core's replica ids (by dp x cp rank) also name the main replica: cp rank 0 of dp rank 0.
With experts the same holds, the experts under megatron-core's global expert axis: at ep > 1
each ep rank holds other experts, replicated over the expert-data-parallel group, so every rank
takes the whole state of its own parameters (`whole_state`) and megatron-core writes each tensor
from its main replica (expert-data-parallel rank 0 for the experts). The model's `moe_layer_freq`
(families.base.moe_layer_freq) and the args agree: 1 when every layer is MoE, so megatron-core
stacks the layers as Megatron-LM's default expects, else the 0/1 list and per-layer keys.

Reading back (resume) never uses `dist_checkpointing.load`, which unpickles without
restriction: checkpoint_convert's torch_dist reader (restricted unpickler) presents each part
(model, masters, moments) through HF names, and the worker reshards it like the safetensors
format, so a resume may change tp/pp/dp. RNG states stay in safetensors files: the CPU has no
CUDA RNG state, so the Megatron-LM `rng_state` entry is not written (Megatron-LM continues with
--no-load-rng).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

# Megatron's key prefix of each optimizer state, by the name this project's optimizers use.
OPTIMIZER_PREFIX = {"model": "optimizer.state.fp32_param.", "exp_avg": "optimizer.state.exp_avg.",
                    "exp_avg_sq": "optimizer.state.exp_avg_sq."}  # fmt: skip
SHARDING_TYPE = "fully_sharded_model_space"
CONTENT_METADATA = {"distrib_optim_sharding_type": SHARDING_TYPE, "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}  # fmt: skip


def is_torch_dist_checkpoint(directory: str | Path) -> bool:
    return Path(directory).name.startswith("iter_")


def checkpoint_args(*, spec, tp: int, pp: int, dp: int, dtype: str, step: int, global_batch_size: int,
                    lr: float, seq_length: int, ep: int = 1, cp: int = 1, vpp: int = 1) -> argparse.Namespace:
    """common.pt's `args`: the model fields Megatron-LM's --use-checkpoint-args reads (see
    checkpoint_convert.megatron_args), the writer's layout (Megatron-LM's: data_parallel_size
    without cp, world_size with it) and the training position. The tensors themselves hold no cp:
    any cp reads them."""
    from checkpoint_convert.mapping import padded_vocab_size
    from checkpoint_convert.megatron_args import checkpoint_args as model_args

    # --vpp: model chunks per pipeline rank (Megatron-LM's --num-virtual-stages-per-pipeline-rank)
    args = model_args(spec, tp=tp, pp=pp, ep=ep, vpp=vpp, padded_vocab_size=padded_vocab_size(spec.vocab_size, tp=tp),
                      vocab_divisor=128, dtype=dtype)  # fmt: skip
    args.data_parallel_size = dp
    args.context_parallel_size = cp
    args.world_size = tp * pp * dp * cp
    args.iteration = step
    args.global_batch_size = global_batch_size
    args.consumed_train_samples = step * global_batch_size  # preference pairs
    args.consumed_valid_samples = 0
    args.seq_length = seq_length
    args.lr = lr
    args.use_distributed_optimizer = True  # the optimizer state is in the model-space layout
    args.no_save_optim = False
    args.no_save_rng = True  # see the module docstring
    return args


def save(directory: str | Path, *, config, spec, layout, model: torch.nn.Module, optimizer, dp_rank: int, step: int,
         platform, held_not_trained) -> None:
    """Collective over every rank of the group: write this rank's part of the checkpoint of
    `step` into `directory` (which exists). `model` is this rank's GPTModel chunk (not DDP), or
    its model chunks (--vpp, model/chunks.py), which Megatron-LM keeps as `model0`, `model1`, ...
    (each chunk's tensors under their global keys: the layers at their global index);
    `held_not_trained(kind)`: the state of the parameters the optimizer does not hold (the
    routers' expert bias: `Checkpointer.held_not_trained`)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    from mcore_dpo.parallel import platform as plat
    from mcore_dpo.model.chunks import chunk_modules
    from mcore_dpo.optim.adamw import lr_at

    named_params = list(model.named_parameters())  # the frozen router bias too: each part holds the whole model
    args = checkpoint_args(spec=spec, tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep, cp=layout.cp,
                           dtype=config.dtype, step=step, global_batch_size=config.global_batch_size, lr=config.lr,
                           seq_length=config.max_length, vpp=layout.vpp)
    scheduler = scheduler_state(lr=config.lr, schedule=config.lr_schedule, warmup_steps=config.lr_warmup_steps,
                                total_steps=config.max_steps, consumed=step * config.global_batch_size,
                                weight_decay=config.weight_decay)  # fmt: skip
    lr = lr_at(step, lr=config.lr, schedule=config.lr_schedule, warmup_steps=config.lr_warmup_steps,
               total_steps=config.max_steps)
    groups = param_groups(lr=lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                          weight_decay=config.weight_decay, step=step)
    chunks = chunk_modules(model)
    model_states = {("model" if len(chunks) == 1 else f"model{c}"): chunk.sharded_state_dict()
                    for c, chunk in enumerate(chunks)}
    sharded, _ = extract_sharded_tensors_and_factories(model_states)
    by_param = {id(t.data): t for t in nested_values(sharded)}
    param_state: dict[int, dict] = {i: {} for i in range(len(named_params))}
    for kind, prefix in OPTIMIZER_PREFIX.items():
        # Whole fp32 tensors on dp rank 0 (every dp rank takes part in the gather); the other dp
        # ranks are replicas that write nothing, their data only has to have the right shape.
        # With ep > 1 the experts' main replica is expert-data-parallel rank 0, which need not be
        # dp rank 0: every rank then takes the whole state of its own parameters (its ep rank's
        # experts among them), and megatron-core writes each tensor from its main replica.
        whole = optimizer.whole_state(kind) if layout.ep > 1 else optimizer.checkpoint_tensors(kind, dp_rank=dp_rank)
        if whole is not None:
            whole = {**whole, **held_not_trained(kind)}
        for i, (name, param) in enumerate(named_params):
            data = whole[name] if whole is not None else torch.empty(param.shape, dtype=torch.float32)
            param_state[i][prefix.split(".")[-2]] = make_sharded_optimizer_tensor(
                by_param[id(param)], data, prefix=prefix.rstrip(".")
            )
        del whole
    state = {
        **model_states,
        "optimizer": {
            "optimizer": {"param_groups": groups},
            "param_state": param_state,
            "param_state_sharding_type": SHARDING_TYPE,
        },
        "opt_param_scheduler": scheduler,
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": step,
    }
    with plat.saving_dist_checkpoint(platform, directory=directory):
        dist_checkpointing.save(state, str(directory), content_metadata=dict(CONTENT_METADATA))


def open_part(directory: str | Path, kind: str):
    """HF-named lazy tensors of one part of a training checkpoint: "model" gives the fp32
    masters, "exp_avg"/"exp_avg_sq" the AdamW moments (read through the restricted unpickler)."""
    from checkpoint_convert.torch_dist import TorchDistCheckpoint

    return TorchDistCheckpoint(directory, key_prefix=OPTIMIZER_PREFIX[kind]).hf_view()


def scheduler_state(*, lr: float, schedule: str, warmup_steps: int, total_steps: int, consumed: int,
                    weight_decay: float) -> dict:
    """Megatron-LM's OptimizerParamScheduler.state_dict() fields for this run's schedule."""
    return {
        "max_lr": lr, "lr_warmup_steps": warmup_steps, "num_steps": consumed,
        "lr_decay_style": schedule, "lr_decay_steps": total_steps, "min_lr": 0.0,
        "start_wd": weight_decay, "end_wd": weight_decay, "wd_incr_style": "constant", "wd_incr_steps": total_steps,
    }  # fmt: skip


def param_groups(*, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, step: int) -> list[dict]:
    """AdamW's two groups' settings: weight decay on matrices, none on norms and biases (see
    optim.decay_groups). Without parameter ids: common.pt is written once for all ranks."""
    common = {"lr": lr, "betas": tuple(betas), "eps": eps, "amsgrad": False, "step": step}
    return [{**common, "weight_decay": weight_decay}, {**common, "weight_decay": 0.0}]


def write_hf_files(directory: str | Path, *, hf_config: dict, aux_files: Sequence[Path]) -> None:
    """config.json and the tokenizer files beside the checkpoint, as checkpoint_convert writes them."""
    import json
    import shutil

    from checkpoint_convert.io import HF_FILES_DIR

    out = Path(directory) / HF_FILES_DIR
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for path in aux_files:
        if Path(path).name != "config.json":
            shutil.copy2(path, out / Path(path).name)


class TorchDist:
    """The checkpoint format of --save-format torch_dist: one Megatron-LM iteration directory,
    model and optimizer (`save`), the model family's HF files beside it (`write_hf_files`)."""

    name = "torch_dist"

    def write(self, part, root: Path, *, step: int) -> None:
        rank = part.rank
        save(root, config=rank.config, spec=rank.spec, layout=rank.layout, model=part.policy.module,
             optimizer=part.optimizer, dp_rank=rank.mesh.dp_cp_rank, step=step, platform=rank.platform,
             held_not_trained=part.held_not_trained)

    def finish(self, tmp: Path, *, config, spec, meta, aux) -> None:
        write_hf_files(tmp, hf_config=meta.hf_config, aux_files=aux)

    def policy_weights(self, directory: str | Path) -> str | None:
        return str(directory)

    def moving_reference(self, directory: str | Path) -> str | None:
        return None  # --sync-ref-model is refused with torch_dist

    def read(self, directory: str | Path, kind: str, *, part) -> dict[str, torch.Tensor]:
        return part.rank_shard(open_part(directory, kind.removeprefix("optim/")))
