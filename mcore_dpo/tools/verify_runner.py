"""The Megatron side of `python -m checkpoint_convert verify`: the checkpoint's model, built by the
trainer's own builder at the checkpoint's tp x pp, runs the converter's token ids and returns
the logits (checkpoint_convert.verify's runner interface; setup.py registers `megatron_logits`
in the entry point group checkpoint_convert.megatron_runners, and `megatron_logits.check` is
the refusals verify asks for before it starts).

The ranks are real gloo ranks on this machine (torch.multiprocessing spawn); pipeline stages
pass hidden states [s, b, h] with blocking send/recv. Everything is computed in fp32 on the CPU
with the local layer spec (a Transformer Engine checkpoint's names are translated), so the
comparison measures the conversion, not the precision or the kernels.

The rendezvous store is bound by this process on a port the kernel picks (port 0) before the
ranks start, and the ranks connect to it: no port is chosen first and bound later, which another
process could take in between. A rank that fails writes its error as one line; the parent raises
it as a ConversionError, so no rank's traceback reaches the user.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from checkpoint_convert.families.base import ConversionError, ModelSpec
from checkpoint_convert.io import META_FILE
from checkpoint_convert.mapping import mcore_entries, mcore_name, padded_vocab_size
from checkpoint_convert.mcore_dir import open_mcore_dir
from mcore_dpo.parallel.mesh import Layout

_RENDEZVOUS_TIMEOUT_S = 120.0
_BUILDER_VOCAB_DIVISOR = 128  # build_stage_model pads the vocabulary to a multiple of 128 x tp
_ERROR_FILE = "error_rank{rank}.txt"


def _layout(meta) -> Layout:
    """The layout verify runs: the checkpoint's tp x pp, one replica, every expert on each rank."""
    return Layout(tp=meta.tp, pp=meta.pp, dp=1)


def check(mcore_dir: Path, *, hf_config_dir: Path) -> None:
    """Every refusal the ranks would meet, checked here, before any of them starts: the trainer
    builder's (`check_buildable`) at verify's layout, and the vocabulary padding it builds."""
    from mcore_dpo.model.builder import check_buildable

    checkpoint = open_mcore_dir(mcore_dir, hf_config_dir=hf_config_dir)
    meta = checkpoint.meta
    try:
        check_buildable(meta.spec, layout=_layout(meta), use_te=False)
    except ValueError as error:
        hint = ""
        if meta.tp > 1:
            try:
                check_buildable(meta.spec, layout=Layout(tp=1, pp=meta.pp, dp=1), use_te=False)
                hint = "; verify a copy resharded to --tp 1 instead"
            except ValueError:
                pass
        raise ConversionError(f"{checkpoint.dir}: verify runs it at tp={meta.tp} pp={meta.pp} ep=1, which the "
                              f"trainer's builder refuses ({error}){hint}") from None
    built = padded_vocab_size(meta.spec.vocab_size, tp=meta.tp, divisor=_BUILDER_VOCAB_DIVISOR)
    stored = padded_vocab_size(meta.spec.vocab_size, tp=meta.tp, divisor=meta.vocab_divisor)
    if built != stored:
        raise ConversionError(f"{checkpoint.dir / META_FILE}: the vocabulary is padded to {stored} rows (a multiple "
                              f"of {meta.vocab_divisor} x tp), the trainer's builder pads it to {built}; verify "
                              "cannot load it")


def megatron_logits(mcore_dir: Path, tokens: torch.Tensor, *, hf_config_dir: Path) -> torch.Tensor:
    """fp32 logits [batch, seq, vocab_size] of the checkpoint in mcore_dir on `tokens` [batch, seq],
    from tp x pp CPU ranks (hf_config_dir: the config of a torch_dist checkpoint without its own);
    `check` has passed (verify calls it first)."""
    from torch.distributed import TCPStore

    meta = open_mcore_dir(mcore_dir, hf_config_dir=hf_config_dir).meta
    world_size = meta.tp * meta.pp
    with tempfile.TemporaryDirectory(prefix="mcore-verify-") as work_dir:
        save_file({"tokens": tokens.contiguous()}, str(Path(work_dir) / "tokens.safetensors"))
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # Bound here, now, and held until the ranks are done (see the module docstring).
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=_RENDEZVOUS_TIMEOUT_S))
        try:
            torch.multiprocessing.spawn(
                _rank_main,
                args=(world_size, store.port, str(mcore_dir), work_dir, str(hf_config_dir)),
                nprocs=world_size,
                join=True,
            )
        except Exception as error:  # a rank failed or died: its own one line, never its traceback
            raise ConversionError(_rank_failure(Path(work_dir), error)) from None
        finally:
            del store
        return load_file(str(Path(work_dir) / "mcore_logits.safetensors"))["logits"]


megatron_logits.check = check  # checkpoint_convert.verify calls it before saying that it builds


def _rank_failure(work_dir: Path, error: Exception) -> str:
    """The first rank error written (the cause: the others fail after it, or are stopped), else
    the first line of what the spawner said (a rank killed by a signal). Each file starts with the
    monotonic clock at its writing: file times are too coarse to order two ranks a millisecond apart."""
    written = [p.read_text(encoding="utf-8").split("\n", 1) for p in work_dir.glob(_ERROR_FILE.format(rank="*"))]
    written = [stamp_line for stamp_line in written if len(stamp_line) == 2 and stamp_line[0].isdigit()]
    if written:
        return min(written, key=lambda stamp_line: int(stamp_line[0]))[1].strip()
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"verify: a megatron rank failed ({first})"


def _rank_main(rank: int, world_size: int, port: int, mcore_dir: str, work_dir: str, hf_dir: str) -> None:
    """One rank; an exception becomes one line in work_dir and exit code 1 (no traceback printed)."""
    try:
        _run_rank(rank, world_size=world_size, port=port, mcore_dir=mcore_dir, work_dir=work_dir, hf_dir=hf_dir)
    except Exception as error:
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
        detail = detail if len(detail) <= 400 else detail[:397] + "..."
        Path(work_dir, _ERROR_FILE.format(rank=rank)).write_text(
            f"{time.monotonic_ns()}\nverify: megatron rank {rank}: {detail}\n", encoding="utf-8")
        raise SystemExit(1) from None


def _local_spec_names(shard: dict[str, torch.Tensor], *, spec: ModelSpec, pp: int, pp_rank: int,
                      layer_spec: str) -> dict[str, torch.Tensor]:
    """A stage shard keyed by `layer_spec`'s names -> keyed by the local spec's (the same tensors:
    Transformer Engine only names the fused norms and dense MLPs differently)."""
    if layer_spec == "local":
        return shard
    renames = {}
    for template, _kind, _hf, local, global_layer in mcore_entries(spec, pp=pp, pp_rank=pp_rank):
        moe_layer = spec.is_moe_layer(global_layer)
        renames[mcore_name(template, layer=local, layer_spec=layer_spec, moe_layer=moe_layer)] = mcore_name(
            template, layer=local, layer_spec="local", moe_layer=moe_layer)
    return {renames.get(name, name): tensor for name, tensor in shard.items()}


def _run_rank(rank: int, *, world_size: int, port: int, mcore_dir: str, work_dir: str, hf_dir: str) -> None:
    """Build this rank's stage, load its shard, run the forward, pass activations on."""
    os.environ["MCORE_DPO_FORCE_CPU"] = "1"  # verify compares on the CPU, whatever the machine has
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    from mcore_dpo.parallel import platform as platform_lib

    platform_lib.quiet_known_warnings()  # a spawned process: before megatron-core is imported
    platform_lib.skip_unused_imports()
    from mcore_dpo.parallel import mesh as mesh_lib
    from mcore_dpo.model.builder import build_stage_model, causal_mask, load_shard, stage_forward

    checkpoint = open_mcore_dir(mcore_dir, hf_config_dir=hf_dir)
    meta = checkpoint.meta
    platform = platform_lib.detect(local_rank=rank)
    platform_lib.activate(platform)
    timeout = datetime.timedelta(seconds=_RENDEZVOUS_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)  # the parent's (bound there)
    dist.init_process_group(backend=platform.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    # No `finally: destroy`: a failing rank must write its error (_rank_main) before its links
    # close, or its peers' "connection closed" would be written first and taken for the cause.
    mesh = mesh_lib.initialize(_layout(meta))
    platform_lib.init_model_rng(platform, 0)
    with platform_lib.building_models(platform):
        model = build_stage_model(meta.spec, mesh=mesh, dtype=torch.float32, on_gpu=False, use_te=False)
    shard = checkpoint.shard(mesh.tp_rank, mesh.pp_rank)
    load_shard(model, _local_spec_names(shard, spec=meta.spec, pp=meta.pp, pp_rank=mesh.pp_rank,
                                        layer_spec=meta.layer_spec))
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
    mesh_lib.destroy()
