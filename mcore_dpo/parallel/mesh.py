"""The only module that talks to megatron-core's parallel_state.

A `Mesh` is the (tp, pp, dp, cp) layout of one worker group seen from one rank: sizes, this
rank's coordinates, and the process groups the engine needs. Everything else takes a
Mesh by argument instead of calling `parallel_state.get_*`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    # Expert parallelism: the experts of a layer are split over ep ranks. megatron-core carves
    # the expert groups from each stage's tp x dp ranks (ordered tp-ep-dp), with the experts
    # whole on their rank (expert tp 1, so ep divides tp x dp) when ep > 1.
    ep: int = 1
    # Context parallelism: each sequence split over cp ranks (parallel/context_parallel.py). The
    # cp ranks of a dp replica run the same microbatches; gradients are reduced over dp x cp.
    cp: int = 1
    # Virtual pipeline stages (--vpp): model chunks per pipeline rank; chunk c of stage s is
    # stage c*pp + s of a pipeline of pp*vpp virtual stages folded onto the pp ranks.
    vpp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def microbatch_group(self) -> int:
        """A step's microbatch count must be a multiple of this: pp with model chunks (megatron-core's
        interleaved 1F1B runs microbatches in groups of pp), else 1."""
        return self.pp if self.vpp > 1 else 1

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size (checkpoint_convert.mapping.expert_tp_size)."""
        from checkpoint_convert.mapping import expert_tp_size

        return expert_tp_size(tp=self.tp, ep=self.ep)

    def ep_rank_of(self, *, tp_rank: int, dp_rank: int) -> int:
        """The expert-parallel rank of the rank at (tp_rank, dp_rank) of a stage."""
        return (tp_rank + self.tp * dp_rank) // self.etp % self.ep


@dataclass(frozen=True)
class Mesh:
    layout: Layout
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    model_parallel_group: object  # tp x pp: every rank holding a piece of one model replica
    prev_rank: int | None  # global rank of the previous pipeline stage
    next_rank: int | None
    embedding_group: object | None  # first + last stage, for tied embeddings when pp > 1
    ep_rank: int = 0
    edp_rank: int = 0  # expert-data-parallel rank: which copy of this rank's experts it holds
    # The ranks whose squared gradient norms add up to the global one: tp x pp, and with
    # experts split over ep the whole world (each parameter then counts on one rank of the
    # world: see `counts_in_grad_norm`).
    grad_norm_group: object | None = None
    cp_rank: int = 0
    cp_group: object | None = None
    # dp x cp: the ranks over which DDP reduces (and the distributed optimizer shards) gradients
    dp_cp_group: object | None = None
    dp_cp_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def virtual_stage(self, chunk: int) -> int:
        """The virtual pipeline stage of this rank's model chunk `chunk` (--vpp; chunk 0 without)."""
        return chunk * self.layout.pp + self.pp_rank

    def holds_input(self, chunk: int) -> bool:
        """Whether model chunk `chunk` of this rank is the first virtual stage (the embedding)."""
        return self.virtual_stage(chunk) == 0

    def holds_output(self, chunk: int) -> bool:
        """Whether model chunk `chunk` of this rank is the last virtual stage (the output layer, the loss)."""
        return self.virtual_stage(chunk) == self.layout.pp * self.layout.vpp - 1

    @property
    def returns_result(self) -> bool:
        """tp rank 0 of the last stage of dp replica 0 (its cp rank 0) reports results for the group."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0 and self.cp_rank == 0

    @property
    def holds_replica_copy(self) -> bool:
        """Whether this rank writes its (tp, pp) shard of the replicated state: dp rank 0, cp rank 0
        (the cp ranks of a replica hold the same parameters)."""
        return self.dp_rank == 0 and self.cp_rank == 0

    def counts_in_grad_norm(self, *, expert: bool) -> bool:
        """Whether this rank's copy of a parameter counts in the gradient norm over
        `grad_norm_group` (tp-replicated parameters aside, which count on tp rank 0): with ep > 1,
        dense parameters on dp rank 0, experts on expert-data-parallel rank 0."""
        if self.layout.ep == 1:
            return True
        return self.edp_rank == 0 if expert else self.dp_rank == 0

    def coordinates(self) -> str:
        cp = f"-cp{self.cp_rank}" if self.layout.cp > 1 else ""
        return f"tp{self.tp_rank}-pp{self.pp_rank}-dp{self.dp_rank}{cp}"


_CURRENT: Mesh | None = None


def initialize(layout: Layout) -> Mesh:
    """Build megatron-core's parallel state for this layout (torch.distributed must be up).
    Idempotent: a process that already holds this layout gets the same Mesh back."""
    global _CURRENT
    from megatron.core import parallel_state as ps

    if _CURRENT is not None:
        if _CURRENT.layout != layout:
            raise ValueError(f"this process already holds layout {_CURRENT.layout}, asked for {layout}")
        return _CURRENT

    world_size = dist.get_world_size()
    if world_size != layout.world_size:
        raise ValueError(f"world size {world_size} does not match tp*pp*dp*cp = {layout.world_size}")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
    )
    pp_rank = ps.get_pipeline_model_parallel_rank()
    # With model chunks the pipeline is a ring: the last stage's chunk c feeds stage 0's chunk c+1.
    ring = layout.vpp > 1
    prev_rank = ps.get_pipeline_model_parallel_prev_rank() if pp_rank > 0 or ring else None
    next_rank = ps.get_pipeline_model_parallel_next_rank() if pp_rank < layout.pp - 1 or ring else None
    embedding_group = None
    if layout.pp > 1 and (ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()):
        embedding_group = ps.get_embedding_group()
    _CURRENT = Mesh(
        layout=layout,
        rank=dist.get_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=pp_rank,
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        model_parallel_group=ps.get_model_parallel_group(),
        prev_rank=prev_rank,
        next_rank=next_rank,
        embedding_group=embedding_group,
        ep_rank=ps.get_expert_model_parallel_rank(),
        edp_rank=ps.get_expert_data_parallel_rank() if layout.ep > 1 else ps.get_data_parallel_rank(),
        grad_norm_group=dist.group.WORLD if layout.ep > 1 else ps.get_model_parallel_group(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_group=ps.get_context_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
    )
    if layout.ep > 1:
        expected = layout.ep_rank_of(tp_rank=_CURRENT.tp_rank, dp_rank=_CURRENT.dp_rank)
        if _CURRENT.ep_rank != expected:  # the converter's and the tests' layout rule
            raise AssertionError(f"megatron-core gave ep rank {_CURRENT.ep_rank}, the layout rule {expected}")
    return _CURRENT


def release_layout() -> None:
    """Drop this process's layout (megatron-core's parallel state) but keep torch.distributed
    up, so that `initialize` may build another layout over the same world."""
    global _CURRENT
    from megatron.core import parallel_state as ps

    _CURRENT = None
    ps.destroy_model_parallel()


def destroy() -> None:
    global _CURRENT
    from megatron.core import parallel_state as ps

    _CURRENT = None
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

