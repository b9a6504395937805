"""The Megatron side of `python -m checkpoint_convert verify`: the checkpoint's model, built by the
trainer's own builder at the checkpoint's tp x pp, runs the converter's token ids and returns
the logits (checkpoint_convert.verify's runner interface; setup.py registers `megatron_logits`
in the entry point group checkpoint_convert.megatron_runners).

The ranks are real gloo ranks on this machine (torch.multiprocessing spawn, rendezvous on
127.0.0.1); pipeline stages pass hidden states [s, b, h] with blocking send/recv. Everything is
computed in fp32 on the CPU, so the comparison measures the conversion, not the precision.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from checkpoint_convert.mcore_dir import open_mcore_dir
from mcore_dpo.parallel.ports import free_port

_RENDEZVOUS_TIMEOUT_S = 120.0


def megatron_logits(mcore_dir: Path, tokens: torch.Tensor, *, hf_config_dir: Path) -> torch.Tensor:
    """fp32 logits [batch, seq, vocab_size] of the checkpoint in mcore_dir on `tokens` [batch, seq],
    from tp x pp CPU ranks (hf_config_dir: the config of a torch_dist checkpoint without its own)."""
    meta = open_mcore_dir(mcore_dir, hf_config_dir=hf_config_dir).meta
    world_size = meta.tp * meta.pp
    with tempfile.TemporaryDirectory(prefix="mcore-verify-") as work_dir:
        save_file({"tokens": tokens.contiguous()}, str(Path(work_dir) / "tokens.safetensors"))
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.multiprocessing.spawn(
            _rank_main,
            args=(world_size, free_port(), str(mcore_dir), work_dir, str(hf_config_dir)),
            nprocs=world_size,
            join=True,
        )
        return load_file(str(Path(work_dir) / "mcore_logits.safetensors"))["logits"]


def _rank_main(rank: int, world_size: int, port: int, mcore_dir: str, work_dir: str, hf_dir: str) -> None:
    """One Megatron rank: build its stage, load its shard, run the forward, pass activations on."""
    os.environ["MCORE_DPO_FORCE_CPU"] = "1"  # verify compares on the CPU, whatever the machine has
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    from mcore_dpo.parallel import platform as platform_lib

    platform_lib.quiet_known_warnings()  # a spawned process: before megatron-core is imported
    from mcore_dpo.parallel import mesh as mesh_lib
    from mcore_dpo.model.builder import build_stage_model, causal_mask, load_shard, stage_forward

    checkpoint = open_mcore_dir(mcore_dir, hf_config_dir=hf_dir)
    meta = checkpoint.meta
    platform = platform_lib.detect(local_rank=rank)
    platform_lib.activate(platform)
    platform_lib.init_process_group(
        platform, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port,
        timeout_s=_RENDEZVOUS_TIMEOUT_S,
    )  # fmt: skip
    try:
        mesh = mesh_lib.initialize(mesh_lib.Layout(tp=meta.tp, pp=meta.pp, dp=1))
        platform_lib.init_model_rng(platform, 0)
        with platform_lib.building_models(platform):
            model = build_stage_model(
                meta.spec, mesh=mesh, dtype=torch.float32, on_gpu=False, use_te=meta.layer_spec == "te"
            )
        load_shard(model, checkpoint.shard(mesh.tp_rank, mesh.pp_rank))
        model.eval()
        tokens = load_file(str(Path(work_dir) / "tokens.safetensors"))["tokens"]
        batch, seq_len = tokens.shape
        with torch.no_grad():
            hidden = None
            if not mesh.is_first_stage:
                hidden = torch.empty(seq_len, batch, meta.spec.hidden_size, dtype=torch.float32)
                dist.recv(hidden, src=mesh.prev_rank)
            output = stage_forward(model, tokens=tokens, input_tensor=hidden, mask=causal_mask(seq_len, device=tokens.device))
            if not mesh.is_last_stage:
                dist.send(output.contiguous(), dst=mesh.next_rank)
            else:
                parts = [torch.empty_like(output) for _ in range(meta.tp)]
                dist.all_gather(parts, output.contiguous(), group=mesh.tp_group)
                if mesh.tp_rank == 0:
                    logits = torch.cat(parts, dim=-1)[..., : meta.spec.vocab_size]
                    save_file({"logits": logits.contiguous()}, str(Path(work_dir) / "mcore_logits.safetensors"))
    finally:
        mesh_lib.destroy()
