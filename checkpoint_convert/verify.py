"""`verify`: run the HF model and the Megatron checkpoint on the same token ids and compare logits.

The Megatron side runs at the checkpoint's own tp x pp as real gloo ranks on this machine
(torch.multiprocessing spawn, rendezvous on 127.0.0.1), built by the trainer's own model
builder; pipeline stages pass hidden states [s, b, h] with blocking send/recv. Everything is
computed in fp32 on the CPU, so the comparison measures the conversion, not the precision.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mcore_dir import open_mcore_dir
from checkpoint_convert.families.base import ConversionError
from mcore_dpo.ports import free_port

_RENDEZVOUS_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class VerifyReport:
    max_abs_diff: float  # largest |logit_hf - logit_mcore| over the batch
    argmax_agreement: float  # fraction of positions whose argmax token agrees
    num_positions: int
    tp: int
    pp: int

    def passes(self, *, atol: float) -> bool:
        return self.max_abs_diff <= atol and self.argmax_agreement == 1.0

    def summary(self) -> str:
        return (
            f"verify tp={self.tp} pp={self.pp}: max |dlogit| {self.max_abs_diff:.3e}, "
            f"argmax agreement {self.argmax_agreement:.2%} over {self.num_positions} positions"
        )


def _rank_main(rank: int, world_size: int, port: int, mcore_dir: str, work_dir: str, hf_dir: str) -> None:
    """One Megatron rank: build its stage, load its shard, run the forward, pass activations on."""
    os.environ["MCORE_DPO_FORCE_CPU"] = "1"  # verify compares on the CPU, whatever the machine has
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    from mcore_dpo import platform as platform_lib

    platform_lib.quiet_known_warnings()  # a spawned process: before megatron-core is imported
    from mcore_dpo import mesh as mesh_lib
    from mcore_dpo.model import build_stage_model, causal_mask, load_shard, stage_forward

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


def _hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # verify prints its result line, not a loading bar
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def _same_model(hf_spec, mcore_spec) -> bool:
    ignore = {"torch_dtype"}
    return all(getattr(hf_spec, f.name) == getattr(mcore_spec, f.name) for f in fields(hf_spec) if f.name not in ignore)


def verify(
    hf_dir: str | os.PathLike, mcore_dir: str | os.PathLike, *, batch_size: int = 2, seq_len: int = 16, seed: int = 0,
    log: Callable[[str], None] = print,
) -> VerifyReport:
    """Compare HF logits with Megatron logits on one random batch of token ids; `log` gets a
    line as each phase starts (the inputs are checked before the first)."""
    hf = open_hf_dir(hf_dir)
    # A torch_dist checkpoint without an HF config of its own is read with the HF model's.
    checkpoint = open_mcore_dir(mcore_dir, hf_config_dir=hf.dir)
    meta = checkpoint.meta
    if not _same_model(hf.spec, meta.spec):
        raise ConversionError(f"{checkpoint.dir}: hf_config describes a different model than {hf.dir / 'config.json'}")
    if batch_size < 1 or not 1 <= seq_len <= meta.spec.max_position_embeddings:
        raise ConversionError(
            f"verify: --seq-len must be in [1, {meta.spec.max_position_embeddings}] and --batch-size >= 1"
        )
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, meta.spec.vocab_size, (batch_size, seq_len), generator=generator)
    world_size = meta.tp * meta.pp
    started = time.monotonic()
    log(f"verify: building the megatron model at tp={meta.tp} pp={meta.pp} from {checkpoint.dir} "
        f"({world_size} CPU rank{'s' if world_size > 1 else ''}) and running {batch_size} x {seq_len} random tokens")
    with tempfile.TemporaryDirectory(prefix="mcore-verify-") as work_dir:
        save_file({"tokens": tokens}, str(Path(work_dir) / "tokens.safetensors"))
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.multiprocessing.spawn(
            _rank_main,
            args=(world_size, free_port(), str(checkpoint.dir), work_dir, str(hf.dir)),
            nprocs=world_size,
            join=True,
        )
        mcore_logits = load_file(str(Path(work_dir) / "mcore_logits.safetensors"))["logits"]
    log(f"verify: megatron logits done ({time.monotonic() - started:.1f} s); loading the HF model from {hf.dir}")
    started = time.monotonic()
    hf_logits = _hf_logits(hf.dir, tokens)
    log(f"verify: HF logits done ({time.monotonic() - started:.1f} s); comparing logits")
    if mcore_logits.shape != hf_logits.shape:
        raise ConversionError(
            f"verify: logits shapes differ (hf {list(hf_logits.shape)}, megatron {list(mcore_logits.shape)})"
        )
    diff = (hf_logits - mcore_logits).abs().max().item()
    agreement = (hf_logits.argmax(-1) == mcore_logits.argmax(-1)).float().mean().item()
    return VerifyReport(
        max_abs_diff=diff, argmax_agreement=agreement, num_positions=tokens.numel(), tp=meta.tp, pp=meta.pp
    )
