"""The ranks of the worker groups (`rank.Rank` each): `PolicyWorker` (role "policy", composed of
the parts that own the step's state) and `ReferenceWorker` (role "ref", --ref-mode separate).

Ray-agnostic: `driver/ray_workers.py` wraps these classes in actors; tests may drive them from plain
processes. Build order matters and is fixed: device -> process group -> parallel state ->
pipeline links -> RNG -> models -> weights -> DDP (wraps the loaded policy) -> optimizer (sees
DDP's params) -> evaluator and checkpointer (see both).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from mcore_dpo import hooks, io_errors
from mcore_dpo.checkpoint import formats
from mcore_dpo.model import lora
from mcore_dpo.parallel import platform as plat
from mcore_dpo.config import TrainConfig
from mcore_dpo.data.pairs import Microbatch, TokenizedPair
from mcore_dpo.pipeline.account import MemoryAccount, device_figures, static_bytes
from mcore_dpo.parallel.mesh import Layout
from mcore_dpo.rank.moe_step import MoeStep
from mcore_dpo.model.builder import allreduce_sequence_parallel_grads, freeze, shard_names
from mcore_dpo.optim.adamw import CpuOptimizer, lr_at, params_once
from mcore_dpo.pipeline.executor import run_ops
from mcore_dpo.rank.base import Rank
from mcore_dpo.rank.metrics import max_over_ranks, mean_and_max_over_ranks, reduce_metrics
from mcore_dpo.rank.reference import ReferenceSource
from mcore_dpo.pipeline.schedule import build_plan
from mcore_dpo.objective.step_loss import StepLoss
from mcore_dpo.rank.prepass import run_prepass
from mcore_dpo.rank.checkpointer import Checkpointer
from mcore_dpo.rank.evaluate import Evaluator
from mcore_dpo.optim.zero import ShardedOptimizer


@dataclass(frozen=True)
class StepBatch:
    """What the driver sends for one step: this step's global batch and the next step's (when
    the reference runs interleaved, its forwards fill this step's bubbles), as pair indices
    into the training data's token store; each rank reads the pairs from the store (`read`).
    Tests may give the pairs themselves instead."""

    step: int
    pairs: Sequence[TokenizedPair] | None = None  # None: read pair_ids from the store
    next_pairs: Sequence[TokenizedPair] | None = None
    pair_ids: Sequence[int] = ()  # indices into the data set (the store; the precomputed reference table)
    next_pair_ids: Sequence[int] | None = None
    ref_logps: torch.Tensor | None = None  # [pairs, 2] from the "ref" worker group (--ref-mode separate)

    def read(self, rank: Rank) -> StepBatch:
        """This batch with its pairs (and the next batch's) read from `rank`'s token store."""
        if self.pairs is not None:
            return self
        return replace(self, pairs=rank.pairs_of(self.pair_ids),
                       next_pairs=None if self.next_pair_ids is None else rank.pairs_of(self.next_pair_ids))


class ReferenceWorker(Rank):
    """Role "ref" (--ref-mode separate): the frozen reference on ranks of its own, with its
    own tp/pp/dp; it computes reference log-probs for the policy group."""

    def __init__(self, *, config: TrainConfig, **kwargs):
        super().__init__(config=config, layout=Layout(tp=config.ref_tp, pp=config.ref_pp, dp=config.ref_dp), **kwargs)
        self.reference = freeze(self.build(config.ref_model or config.model))

    def reference_logps(self, pairs: Sequence[TokenizedPair] | None = None, *, pair_ids: Sequence[int] | None = None,
                        eval_set: bool = False) -> torch.Tensor | None:
        """[pairs, 2] on the CPU from the reporting rank (tp 0 of the last stage, dp 0), of
        `pairs`, of the training pairs `pair_ids` or of the whole held-out set (`eval_set`), the
        last two read from the token stores."""
        if pairs is None:
            pairs = self.store("eval_data") if eval_set else self.pairs_of(pair_ids)
        table = self.reference_table(pairs, model=self.reference)
        return table.cpu() if self.mesh.returns_result else None


class PolicyWorker(Rank):
    """Role "policy": one rank of the trained model, composed of parts that each own their state:
    the reference source (rank/reference.py), the MoE step (rank/moe_step.py), the optimizer, the memory
    count, the evaluator and the checkpointer. `train_step` runs one optimizer step."""

    def __init__(self, *, config: TrainConfig, resume_dir: str | None = None, **kwargs):
        super().__init__(config=config, layout=Layout(tp=config.tp, pp=config.pp, dp=config.dp, ep=config.ep, cp=config.cp,
                                                         vpp=config.vpp), **kwargs)
        # The policy comes from the checkpoint when resuming; the reference always from the source.
        # With LoRA the base never changes: the checkpoint holds the adapters only.
        saved = formats.of_checkpoint(resume_dir, config) if resume_dir else None
        saved_weights = saved.policy_weights(resume_dir) if saved else None
        policy = self.build(saved_weights or config.model, checked=saved_weights is not None)
        if config.lora:
            self._attach_adapters(policy)  # before DDP: only the adapters require gradients
        moved = saved.moving_reference(resume_dir) if saved and config.sync_ref_model else None  # TR-DPO
        self.reference = ReferenceSource(model=self._reference_model(policy, moved=moved),
                                         ref_mode=config.ref_mode, device=self.platform.device)
        # MoE: the routers' load-balancing loss and load metrics (rank/moe_step.py).
        self.moe = None
        if self.spec.num_experts:
            self.moe = MoeStep(policy, moe_layers=self.spec.moe_layers, num_experts=self.spec.num_experts,
                               topk=self.spec.moe_topk, mesh=self.mesh, device=self.platform.device)
            if isinstance(self.reference.model, lora.ReferenceView):  # LoRA: the reference runs the policy's routers
                self.reference.model.router_tap = self.moe.tap
        # --distributed-optimizer: DDP reduce-scatters gradients and all-gathers parameters, the
        # optimizer keeps only this dp rank's slice of the fp32 masters and moments (at dp 1, all).
        self.policy = wrap_ddp(policy, distributed_optimizer=config.distributed_optimizer)
        self.optimizer = self._optimizer()  # after DDP: it works on DDP's parameters and gradient buffers
        self.evaluator = Evaluator(rank=self, policy=self.policy, reference=self.reference)
        self.checkpointer = Checkpointer(rank=self, policy=self.policy, optimizer=self.optimizer,
                                         reference=self.reference)
        if resume_dir:
            self.checkpointer.load(resume_dir)
        # Exact tensor bytes by category (pipeline/account.py); memory_report: the peaks of the last
        # step that counted them (--memory-interval).
        self.memory = MemoryAccount(tables=self.reference.tables)
        rope = getattr(self.policy.module, "rotary_pos_emb", None)
        if rope is not None:  # megatron-core caches its table: the model's, not a microbatch's
            self.memory.exclude_cached_outputs(rope)
        self.memory_report: dict[str, int] = {}
        # Set trace_ops to record each step's op timeline in last_trace: (op, microbatch, batch,
        # start, end) in seconds from the step's start; "optimizer" covers the optimizer step.
        # Host-side clocks: on a GPU they time kernel launches unless CUDA_LAUNCH_BLOCKING=1.
        self.trace_ops = False
        self.last_trace: list[tuple[str, int, int, float, float]] = []
        self.last_plan = None  # the plan of the last step

    # ------------------------------------------------------------------ build
    def _attach_adapters(self, policy: torch.nn.Module) -> None:
        """Freeze the base, add the adapters, fill them from --init-adapter or PEFT's init; with
        --init-adapter keep their starting copy (the reference)."""
        from checkpoint_convert.peft_adapter import initial_adapter, read_adapter

        config, shape = self.config, lora.shape_of(self.config)
        lora.attach(policy, spec=self.spec, lora=shape, dropout=config.lora_dropout, tp=self.layout.tp,
                    tp_group=self.mesh.tp_group)
        if config.init_adapter:
            whole = read_adapter(config.init_adapter, spec=self.spec, lora=shape)
        else:
            whole = initial_adapter(self.spec, shape, seed=config.seed)
        lora.load_shard(policy, lora.adapter_shard(whole, rank=self))
        if config.init_adapter:
            for adapter in lora.adapters_of(policy):
                adapter.keep_frozen_copy()

    def _reference_model(self, policy: torch.nn.Module, *, moved: str | None) -> torch.nn.Module | None:
        """The colocated reference: LoRA's adapter-off view of the policy, else a frozen shard
        (`moved`: TR-DPO's, as a resumed checkpoint keeps it); none for a reference group of its
        own or none at all."""
        config = self.config
        if not self.objective.needs_reference or config.ref_mode == "separate":
            return None
        if config.lora and not config.ref_model:
            return lora.ReferenceView(policy, frozen=config.init_adapter is not None)
        return freeze(self.build(moved or config.ref_model or config.model, checked=moved is not None))

    def _optimizer(self):
        config = self.config
        named_params = [(n, p) for n, p in self.policy.module.named_parameters() if p.requires_grad]
        common = dict(betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                      weight_decay=config.weight_decay, clip_grad=config.clip_grad,
                      fused=plat.fused_adamw(self.platform.device))
        if config.distributed_optimizer:
            return ShardedOptimizer(
                ddp_model=self.policy, named_params=named_params, params_once=params_once(self.policy.module, spec=self.spec, mesh=self.mesh, sharded=True),
                dp_group=self.mesh.dp_cp_group, dp_rank=self.mesh.dp_cp_rank, dp_size=self.layout.dp * self.layout.cp,
                **common,
            )  # fmt: skip
        return CpuOptimizer(named_params=named_params, params_once=params_once(self.policy.module, spec=self.spec, mesh=self.mesh),
                            group=self.mesh.grad_norm_group,
                            **common)

    def _all_params(self) -> list[torch.Tensor]:
        models = [self.policy.module] + ([self.reference.model] if self.reference.model is not None else [])
        return [t for m in models for t in (*m.parameters(), *m.buffers())]

    # ------------------------------------------------------------------ data
    def local_microbatches(self, pairs: Sequence[TokenizedPair]) -> tuple[list[Microbatch], list[list[int]]]:
        """This dp rank's share of a global batch cut into microbatches, and each microbatch's
        pairs as positions in the global batch. Padded: a contiguous share, micro_batch_size
        pairs per microbatch, all as long as the batch's longest pair. Packed: the token-balanced
        split of `packing.plan_packed_step`."""
        rows = self.rows
        if rows.packing:
            groups = rows.plan_step(pairs, dp=self.layout.dp)[self.mesh.dp_rank]
        else:
            per_rank, b = len(pairs) // self.layout.dp, self.config.micro_batch_size
            lo = self.mesh.dp_rank * per_rank
            groups = [list(range(k, min(k + b, lo + per_rank))) for k in range(lo, lo + per_rank, b)]
        mbs = rows.microbatches(pairs, groups, pad_over=range(len(pairs)))
        return mbs, groups

    # ------------------------------------------------------------------ step
    def train_step(self, batch: StepBatch) -> dict[str, float] | None:
        config, mesh = self.config, self.mesh
        hooks.fire("train_step", step=batch.step, rank=self.rank, output_dir=config.output_dir)
        start = time.perf_counter()  # host clock: the op trace's origin
        step_clock = plat.IntervalClock(self.platform)
        step_clock.start()
        objective = self.objective
        batch = batch.read(self)  # the pairs from the token store
        mbs, groups = self.local_microbatches(batch.pairs)
        microbatches_of = {0: mbs}
        sync_now = config.sync_ref_model and batch.step % config.ref_model_sync_steps == 0  # TR-DPO
        ref = self.reference.plan(has_next_batch=batch.next_pairs is not None, sync_now=sync_now)
        if ref.next:  # the next batch's reference forwards fill this step's bubbles
            microbatches_of[1] = self.local_microbatches(batch.next_pairs)[0]
        prepass, computed = None, {}
        if objective.needs_prepass:  # aot: the whole batch's order first (a forward-only pass)
            prepass, computed, ref = run_prepass(self, policy=self.policy, reference=self.reference, batch=batch,
                                                 mbs=mbs, groups=groups, objective=objective, ref=ref)
        plan = build_plan(  # the same on every stage, so that all stages build the same plan
            num_stages=self.layout.pp, num_microbatches=len(mbs),
            num_next_microbatches=len(microbatches_of[1]) if ref.next else None,
            ref_mode=ref.plan_mode, ref_current=ref.current, ref_next=ref.next, carry_in=self.reference.carried,
            carry_out=ref.next and not objective.needs_prepass,  # aot reads a batch's whole reference first
            num_chunks=self.layout.vpp,
        )  # fmt: skip
        self.last_plan = plan
        account = config.accounts_memory(batch.step)  # the same on every rank
        carried = self.reference.open_step(computed=computed)  # kept_in and this batch's ref_logps so far
        loss = StepLoss(objective=objective, samples=batch.pairs, groups=groups, dp=self.layout.dp,
                        reference=self.reference, computed=carried["ref_logps"], sample_ids=batch.pair_ids,
                        given=batch.ref_logps, prepass=prepass, device=self.platform.device)
        riders = None
        if self.moe is not None:  # the aux loss's gradient joins each stage's backward (rank/moe_step.py)
            self.moe.begin(mbs, coef=config.moe_aux_loss_coef or 0.0)
            riders = self.moe.riders()  # its counts ride on the plan's act and grad messages
        ctx = self.stage_context(microbatches_of, policy=self.policy, reference=self.reference.model, loss_fn=loss,
                                 riders=riders, trace=[] if self.trace_ops else None,
                                 memory=self.memory if account else None, **carried)
        if account:
            self.memory.start_step(exclude=self._all_params())
            self.memory.observe(ctx)
        self.policy.zero_grad_buffer()
        run_ops(plan.stages[mesh.pp_rank], ctx)
        moe_metrics = self.moe.finish(mbs) if self.moe is not None else None
        self.reference.close_step(ctx, plan=plan, computed_next=ref.next)
        self._sync_grads()
        lr = lr_at(batch.step, lr=config.lr, schedule=config.lr_schedule, warmup_steps=config.lr_warmup_steps,
                   total_steps=config.max_steps)
        optimizer_start = time.perf_counter()
        grad_norm = self.optimizer.step(lr=lr)
        if sync_now and self.reference.model is not None:
            self.reference.sync_toward(self.policy.module, alpha=config.ref_model_mixup_alpha)
        memory = self._memory_figures() if account else {}
        if ctx.trace is not None:
            ctx.trace.append(("optimizer", -1, 0, optimizer_start, time.perf_counter()))
            self.last_trace = [(kind, mb, b_, t0 - start, t1 - start) for kind, mb, b_, t0, t1 in ctx.trace]
        metrics = reduce_metrics(loss.sums, objective=objective, mesh=mesh)
        step_clock.stop()
        elapsed = step_clock.total_s()
        # Time blocked in transfers (device time on a GPU, see IntervalClock) over the step time.
        bubble, peak_bytes = mean_and_max_over_ranks(mean=ctx.wait_clock.total_s() / elapsed,
                                                     max_=plat.max_memory_bytes(self.platform),
                                                     world_size=self.layout.world_size, device=self.platform.device)
        if metrics is None:
            return None
        token_stats = self.rows.token_stats(batch.pairs, dp=self.layout.dp, micro_batch_size=config.micro_batch_size)
        metrics.update({"grad_norm": grad_norm, "lr": lr, "step_time_s": elapsed,
                        "tokens/s": token_stats["tokens/real"] / elapsed, "bubble_fraction": bubble,
                        "memory/peak_gib": peak_bytes / 2**30, **token_stats})
        metrics.update({f"memory/{name}": value for name, value in memory.items()})
        metrics.update(moe_metrics or {})
        return metrics

    def _sync_grads(self) -> None:
        """The step's gradients reduced: the tied embedding's two copies and the
        sequence-parallel parameters first (sums commute, shards need not line up), then over dp."""
        if self.spec.tie_word_embeddings and self.layout.pp > 1 and self.mesh.embedding_group is not None:
            weight = self.policy.module.shared_embedding_or_output_weight()
            if weight.requires_grad:  # frozen with LoRA
                dist.all_reduce(weight.main_grad, group=self.mesh.embedding_group)
        allreduce_sequence_parallel_grads(self.policy, tp_group=self.mesh.tp_group)
        self.policy.finish_grad_sync()

    def _memory_figures(self) -> dict[str, int]:
        """The step's exact memory by category, the largest over the ranks; read after the
        optimizer step (AdamW allocates its moments in the first one)."""
        self.memory.static = static_bytes(policy=self.policy.module, reference=self.reference.model,
                                          optimizer_state_bytes=self.optimizer.state_bytes())
        self.memory_report = {**self.memory.report(), **device_figures(self.platform.device)}
        return max_over_ranks(self.memory_report, world_size=self.layout.world_size, device=self.platform.device)

    # ------------------------------------------------------------------ the driver's other calls
    def evaluate(self, pairs: Sequence[TokenizedPair] | None = None,
                 ref_logps: torch.Tensor | None = None) -> dict[str, float] | None:
        """Held-out metrics over `pairs` (default: the eval set's token store)."""
        return self.evaluator.evaluate(self.store("eval_data") if pairs is None else pairs, ref_logps)

    def save_checkpoint(self, directory: str, *, step: int) -> None:
        with io_errors.naming(directory):  # a full disk's error names the checkpoint
            self.checkpointer.save_checkpoint(directory, step=step)

    def write_policy(self, directory: str) -> None:
        with io_errors.naming(directory):
            self.checkpointer.write_policy(directory)

    def write_adapter(self, directory: str) -> None:
        with io_errors.naming(directory):
            self.checkpointer.write_adapter(directory)

    def policy_shard(self) -> dict[str, torch.Tensor] | None:
        return self.checkpointer.policy_shard()

    def adapter_shard(self) -> dict[str, torch.Tensor] | None:
        return self.checkpointer.adapter_shard()

    def precompute_reference(self, pairs: Sequence[TokenizedPair] | None = None,
                             eval_pairs: Sequence[TokenizedPair] | None = None, *, table_dir: str | None = None,
                             key: str | None = None, reuse: bool = False) -> None:
        """`--ref-mode precomputed`: one forward-only reference pass over the data set and the
        held-out pairs (default: the token stores'), dp ranks taking shares; the last stage keeps
        the log-probs, then the reference is released. `table_dir`: the run's tables on disk
        (checkpoint/reference_tables.py), written by the reporting rank under `key`, or read
        from there without a pass when the driver found them complete (`reuse`)."""
        if pairs is None:
            pairs = self.store("data")
            eval_pairs = self.store("eval_data") if self.has_store("eval_data") else ()
        self.reference.precompute(lambda p: self.reference_table(p, model=self.reference.model), pairs,
                                  eval_pairs or (), mesh=self.mesh, table_dir=table_dir, key=key, reuse=reuse)

    def release_reference(self) -> None:
        self.reference.release()

    def grad_shard(self) -> dict[str, torch.Tensor]:
        """This rank's gradients of the last step (summed over microbatches, reduced over dp),
        before clipping: the optimizer clipped them in place, and its coefficient is divided
        out again (to within an ulp)."""
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.gather_grads()
        clip = self.optimizer.last_clip  # dividing by 1.0 is exact
        return shard_names({n: p.main_grad.detach().cpu() / clip
                            for n, p in self.policy.module.named_parameters() if p.requires_grad})


def wrap_ddp(model: torch.nn.Module, *, distributed_optimizer: bool) -> torch.nn.Module:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
