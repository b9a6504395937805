"""The model chunks of one pipeline rank (virtual pipeline stages, --vpp).

With v chunks, a rank's model is `StageChunks`: one module whose `chunks[c]` is the GPTModel of
its chunk c, megatron-core's virtual stage c*pp + s (model/builder.py builds each with its
vp_stage). DDP wraps it whole, so the gradient buffers, their reduction over dp and the
optimizer cover every chunk as the parameters of one module, named `chunks.{c}.<the chunk's
own name>`; the executor runs each op on `chunk_of(model, op.chunk)`. Without chunks (vpp 1)
a rank holds its GPTModel itself, and every function here leaves it as it is.

Shards: chunk c of stage s holds exactly what stage c*pp + s of a plain pipeline of pp*vpp
stages holds (the same layers; the embedding on the first, the output layer on the last), so
its shard is that stage's shard in checkpoint_convert's format. `rank_shard` reads a rank's
shard chunk by chunk as virtual stages; `stage_files` splits a rank's tensors into (file pp
rank, shard) pairs. A --vpp run's checkpoints and exports are thus plain Megatron directories of
`file_pp(layout)` = pp*vpp stages, which a run of any layout (any --vpp) reads back through HF
names, as it reads any other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class StageChunks(torch.nn.Module):
    """A pipeline rank's model chunks, chunk c at `chunks[c]`."""

    def __init__(self, chunks: Sequence[torch.nn.Module]):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)
        self.config = chunks[0].config  # megatron-core's DDP reads its module's config

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The embedding (chunk 0 of stage 0) or the output layer's copy of a tied embedding (the
        last chunk of the last stage); a rank with pp >= 2 holds at most one of them."""
        for chunk in self.chunks:
            if chunk.pre_process or chunk.post_process:
                return chunk.shared_embedding_or_output_weight()
        return None


def build_chunks(build: Callable[[int], torch.nn.Module], *, vpp: int) -> torch.nn.Module:
    """build(chunk) for each of a rank's `vpp` chunks: the GPTModel itself at vpp 1, else StageChunks."""
    if vpp == 1:
        return build(0)
    return StageChunks([build(chunk) for chunk in range(vpp)])


def chunk_of(model: torch.nn.Module, chunk: int) -> torch.nn.Module:
    """The module that runs model chunk `chunk` of `model` (DDP-wrapped or not; a view of a model
    that has chunks, as LoRA's adapter-off reference, answers `chunk(c)` itself): the model itself
    without chunks."""
    inner = getattr(model, "module", model)
    if not isinstance(inner, StageChunks):
        return model
    return model.chunk(chunk) if hasattr(model, "chunk") else inner.chunks[chunk]


def chunk_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The GPTModels of `model` (not DDP-wrapped), chunk by chunk: the model itself without chunks."""
    return list(model.chunks) if isinstance(model, StageChunks) else [model]


def chunk_name(name: str) -> str:
    """A parameter's name within its model chunk (`chunks.<c>.` dropped; any other name as it is)."""
    return name.split(".", 2)[2] if name.startswith("chunks.") else name


def file_pp(layout) -> int:
    """How many pipeline stages the Megatron directories this layout writes have: pp x vpp."""
    return layout.pp * layout.vpp


def rank_shard(shard_of: Callable[[int, int], dict[str, torch.Tensor]], *, layout, pp_rank: int) -> dict:
    """This rank's shard from `shard_of(pp, pp_rank)` (a stage's shard of a plain pipeline of pp
    stages): its own stage's without chunks, else each chunk's virtual stage's under `chunks.{c}.`."""
    if layout.vpp == 1:
        return shard_of(layout.pp, pp_rank)
    return {f"chunks.{chunk}.{name}": tensor for chunk in range(layout.vpp)
            for name, tensor in shard_of(file_pp(layout), chunk * layout.pp + pp_rank).items()}


def stage_files(tensors: dict[str, torch.Tensor], *, layout, pp_rank: int) -> list[tuple[int, dict]]:
    """This rank's tensors (named as its model names them) as (pp rank of a file, its shard) in a
    directory of `file_pp(layout)` stages: one file without chunks, one per chunk with them."""
    if layout.vpp == 1:
        return [(pp_rank, tensors)]
    files: dict[int, dict[str, torch.Tensor]] = {chunk: {} for chunk in range(layout.vpp)}
    for name, tensor in tensors.items():
        prefix, chunk, rest = name.split(".", 2)
        if prefix != "chunks":
            raise ValueError(f"{name}: not a model chunk's tensor (chunks.<c>.<name>)")
        files[int(chunk)][rest] = tensor
    return [(chunk * layout.pp + pp_rank, shard) for chunk, shard in files.items()]
