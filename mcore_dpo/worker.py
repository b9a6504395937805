"""One rank of the policy worker group: its policy shard, the frozen reference shard for the
same layers, DDP, the optimizer, and the step.

Ray-agnostic: `ray_workers.py` wraps this class in an actor; tests may drive it from plain
processes. Build order matters and is fixed: device -> process group -> parallel state ->
pipeline links -> RNG -> models -> weights -> DDP (wraps the loaded policy) -> optimizer (sees
DDP's params).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpoint_convert.families.base import DTYPES, ModelSpec
from checkpoint_convert.mapping import hf_to_mcore_shard
from mcore_dpo import checkpoint_torch_dist, hooks, lora
from mcore_dpo import platform as plat
from mcore_dpo.config import TrainConfig
from mcore_dpo.data import Microbatch, TokenizedPair, collate, padded_seq_len, seq_len_multiple
from mcore_dpo.even_passes import even_passes
from mcore_dpo.logprobs import LogpsOptions, SequenceLogps, pair_logps, table_rows
from mcore_dpo.loss import (METRIC_SUM_KEYS, BatchSort, PairLogps, batch_sort, finalize_metrics, metric_sum_vector,
                            pair_losses)
from mcore_dpo.memory_account import MemoryAccount, device_figures, static_bytes
from mcore_dpo.mesh import Layout, Mesh, initialize
from mcore_dpo.moe_step import MoeStep
from mcore_dpo.model import (allreduce_sequence_parallel_grads, build_stage_model, freeze, layer_spec_name, load_shard,
                             open_weights, place_on_device, shard_names)
from mcore_dpo.optim import CpuOptimizer, lr_at
from mcore_dpo.packing import collate_packed, plan_packed_step, step_token_stats
from mcore_dpo.pipeline import StageContext, forward_only_ops, run_ops, warm_up_links
from mcore_dpo.schedule import build_plan
from mcore_dpo.worker_checkpoint import PolicyCheckpointing
from mcore_dpo.worker_eval import PolicyEvaluation
from mcore_dpo.zero import ShardedOptimizer


@dataclass(frozen=True)
class StepBatch:
    """What the driver sends for one step: this step's global batch and, when the reference
    runs interleaved, the next step's (its reference forwards fill this step's bubbles)."""

    step: int
    pairs: Sequence[TokenizedPair]
    next_pairs: Sequence[TokenizedPair] | None = None
    pair_ids: Sequence[int] = ()  # indices into the data set (precomputed reference lookup)
    ref_logps: torch.Tensor | None = None  # [pairs, 2] from the "ref" worker group (--ref-mode separate)


class _Rank:
    """What every rank of every role has: device, process group, parallel state, RNG, and
    models built and loaded for its (tp, pp) coordinates."""

    @property
    def packing(self) -> bool:
        """Packed microbatches: --packing / --no-packing as given; an unset one that the driver
        left open (no mode packing does not serve) is decided by the rank's attention."""
        if self.config.packing is not None:
            return self.config.packing
        return self.config.packing_unserved() is None and plat.default_packing(thd_attention=self.packed_thd)

    def __init__(
        self,
        *,
        config: TrainConfig,
        spec: ModelSpec,
        layout: Layout,
        pad_token_id: int,
        rank: int,
        master_addr: str,
        master_port: int,
        local_rank: int = 0,
    ):
        self.config = config
        self.rank = rank
        self.spec = spec
        self.pad_token_id = pad_token_id
        self.layout = layout
        # device -> process group -> parallel state
        self.platform = plat.detect(local_rank=local_rank)
        plat.make_deterministic(config.deterministic)
        plat.activate(self.platform)
        if not dist.is_initialized():  # a process may build several workers (tests do)
            plat.init_process_group(
                self.platform,
                rank=rank,
                world_size=self.layout.world_size,
                master_addr=master_addr,
                master_port=master_port,
                timeout_s=config.timeout_s or plat.default_timeout_s(self.platform),
            )
        self.mesh: Mesh = initialize(self.layout)
        # Every pipeline link connected now, on every rank alike, not by a step's first messages.
        warm_up_links(self.mesh, device=self.platform.device)
        plat.init_model_rng(self.platform, config.seed)
        self.dtype = DTYPES[config.dtype]
        # LoRA hooks the local spec's linears (Transformer Engine fuses the norm into linear_qkv).
        self.use_te = plat.transformer_engine_available() and not config.lora
        # MoE experts: grouped GEMMs on the Transformer Engine spec, else sequential. Their live
        # parameter names differ; shards and checkpoints keep the sequential ones (model.shard_names).
        self.grouped_experts, self.experts_note = plat.use_grouped_experts(
            requested=config.moe_grouped_gemm, num_experts=spec.num_experts, use_te=self.use_te,
            grouped_linear=self.use_te and plat.te_grouped_linear_available())
        # megatron-core's MoE layer needs sequence parallelism at tp > 1: on for MoE models.
        requested = True if spec.num_experts else False if config.lora else config.sequence_parallel
        self.sequence_parallel = plat.use_sequence_parallel(self.platform, requested=requested, tp=layout.tp)
        self.seq_multiple = seq_len_multiple(tp=layout.tp, sequence_parallel=self.sequence_parallel)
        # Packed rows run in the THD layout on Transformer Engine's attention, else with a mask.
        self.packed_thd = self.use_te and self.platform.is_cuda
        self.reference: torch.nn.Module | None = None

    def _build(self, weights_dir: str) -> torch.nn.Module:
        with plat.building_models(self.platform):
            model = place_on_device(build_stage_model(
                self.spec, mesh=self.mesh, dtype=self.dtype, on_gpu=self.platform.is_cuda, use_te=self.use_te,
                sequence_parallel=self.sequence_parallel, grouped_experts=self.grouped_experts,
                deterministic=self.config.deterministic, fused_kernels=self.config.fused_kernels,
            ), self.platform.device)
        weights = open_weights(weights_dir)
        shard = hf_to_mcore_shard(  # reads only this rank's part of each tensor (get_part)
            self.spec,
            tp=self.layout.tp,
            tp_rank=self.mesh.tp_rank,
            pp=self.layout.pp,
            pp_rank=self.mesh.pp_rank,
            get=weights.get,
            get_part=weights.get_part,
            layer_spec=layer_spec_name(use_te=self.use_te),
            ep=self.layout.ep,
            ep_rank=self.mesh.ep_rank,
        )
        load_shard(model, shard)
        return model

    def _context(self, microbatches: dict[int, list[Microbatch]], **kwargs) -> StageContext:
        return StageContext(
            mesh=self.mesh,
            policy=getattr(self, "policy", None),
            reference=self.reference,
            microbatches=microbatches,
            hidden_size=self.spec.hidden_size,
            dtype=self.dtype,
            device=self.platform.device,
            vocab_size=self.spec.vocab_size,
            wait_clock=plat.IntervalClock(self.platform),
            sequence_parallel=self.sequence_parallel,
            packed_thd=self.packed_thd,
            logps_options=LogpsOptions(ld_alpha=self.config.ld_alpha, wpo=self.config.use_weighting),
            **kwargs,
        )

    @torch.no_grad()
    def reference_table(self, pairs: Sequence[TokenizedPair]) -> torch.Tensor | None:
        """Forward-only reference pass over `pairs` (dp ranks take them round-robin): on the
        last stage, [pairs, 2] summed log-probs of chosen and rejected; None elsewhere.

        Chunks hold this group's share of a global batch (its own dp, which for the "ref" group
        need not be the policy's), in whole microbatches; a chunk's last microbatch may be smaller."""
        dp, mesh = self.layout.dp, self.mesh
        b = self.config.micro_batch_size
        rows_per_chunk = max(1, self.config.global_batch_size // dp // b) * b

        def passes_of(dp_rank: int) -> list:
            mine = list(range(dp_rank, len(pairs), dp))
            chunks = [mine[lo : lo + rows_per_chunk] for lo in range(0, len(mine), rows_per_chunk)]
            return [(None, [ids[k : k + b] for k in range(0, len(ids), b)]) for ids in chunks]

        if self.layout.ep > 1:  # the same forwards on every rank (expert all-to-all); dummies dropped
            passes = even_passes([passes_of(r) for r in range(dp)], dp_rank=mesh.dp_rank)
        else:
            passes = [(None, groups, len(groups)) for _, groups in passes_of(mesh.dp_rank)]
        table = torch.zeros(len(pairs), 2, dtype=torch.float64, device=self.platform.device)
        for _, groups, num_real in passes:
            seq_len = padded_seq_len([pairs[i] for ids in groups for i in ids], multiple=self.seq_multiple)
            mbs = [collate([pairs[i] for i in ids], pad_token_id=self.pad_token_id, seq_len=seq_len) for ids in groups]
            ctx = self._context({0: mbs}, forward_only=True)
            run_ops(forward_only_ops(mesh=mesh, num_microbatches=len(mbs), policy=False, reference=True), ctx)
            if mesh.is_last_stage:
                for mb, ids in enumerate(groups[:num_real]):
                    logps = ctx.ref_logps.pop((0, mb))
                    table[ids, 0] = logps.logp_sum[: len(ids)].double()
                    table[ids, 1] = logps.logp_sum[len(ids) :].double()
        if not mesh.is_last_stage:
            return None
        if dp > 1:
            dist.all_reduce(table, group=mesh.dp_group)
        return table.to(torch.float32)

    def layer_spec(self) -> str:
        """The layer spec this rank built its models with; it names the tensors of its shards."""
        return layer_spec_name(use_te=self.use_te)

    def packs(self) -> bool:
        """Whether this rank runs packed microbatches (an unset --packing decided here)."""
        return self.packing

    def experts(self) -> tuple[str | None, str | None]:
        """How this rank's MoE experts run ("grouped", "sequential"; None for a dense model) and
        the note to show when grouped GEMM was expected but is not possible here."""
        if not self.spec.num_experts:
            return None, None
        return ("grouped" if self.grouped_experts else "sequential"), self.experts_note

    def coordinates(self) -> tuple[int, int, int]:
        return (self.mesh.tp_rank, self.mesh.pp_rank, self.mesh.dp_rank)

    def shutdown(self) -> None:
        from mcore_dpo.mesh import destroy

        destroy()


class ReferenceWorker(_Rank):
    """Role "ref" (--ref-mode separate): the frozen reference on ranks of its own, with its
    own tp/pp/dp; it computes reference log-probs for the policy group."""

    def __init__(self, *, config: TrainConfig, **kwargs):
        super().__init__(config=config, layout=Layout(tp=config.ref_tp, pp=config.ref_pp, dp=config.ref_dp), **kwargs)
        self.reference = freeze(self._build(config.ref_model or config.model))

    def reference_logps(self, pairs: Sequence[TokenizedPair]) -> torch.Tensor | None:
        """[pairs, 2] on the CPU from the reporting rank (tp 0 of the last stage, dp 0)."""
        table = self.reference_table(pairs)
        return table.cpu() if self.mesh.returns_result else None


class PolicyWorker(PolicyCheckpointing, PolicyEvaluation, _Rank):
    def __init__(self, *, config: TrainConfig, resume_dir: str | None = None, **kwargs):
        super().__init__(config=config, layout=Layout(tp=config.tp, pp=config.pp, dp=config.dp, ep=config.ep), **kwargs)
        # The policy comes from the checkpoint when resuming; the reference always from the source.
        # With LoRA the base never changes: the checkpoint holds the adapters only.
        source = config.model
        if resume_dir and not config.lora:
            torch_dist = checkpoint_torch_dist.is_torch_dist_checkpoint(resume_dir)
            source = resume_dir if torch_dist else os.path.join(resume_dir, "model")
        self.policy = self._build(source)
        if config.lora:
            self._attach_adapters()  # before DDP: only the adapters require gradients
        if config.loss_spec().needs_reference and config.lora and not config.ref_model and config.ref_mode != "separate":
            self.reference = lora.ReferenceView(self.policy, frozen=config.init_adapter is not None)
        elif config.loss_spec().needs_reference and config.ref_mode != "separate":
            synced = os.path.join(resume_dir, "reference") if resume_dir and config.sync_ref_model else None
            source = synced if synced and os.path.isdir(synced) else config.ref_model or config.model
            self.reference = freeze(self._build(source))
        # --distributed-optimizer: DDP reduce-scatters gradients and all-gathers parameters, the
        # optimizer keeps only this dp rank's slice of the fp32 masters and moments (at dp 1, all).
        # MoE: the routers' load-balancing loss and load metrics (moe_step.py).
        self.moe = None
        if self.spec.num_experts:
            self.moe = MoeStep(self.policy, moe_layers=self.spec.moe_layers, num_experts=self.spec.num_experts,
                               topk=self.spec.moe_topk, mesh=self.mesh, device=self.platform.device)
            if isinstance(self.reference, lora.ReferenceView):  # LoRA: the reference runs the policy's routers
                self.reference.router_tap = self.moe.tap
        sharded = config.distributed_optimizer
        self.policy = self._wrap_ddp(self.policy, distributed_optimizer=sharded)
        # The optimizer comes after DDP: it works on DDP's parameters and gradient buffers.
        named_params = [(n, p) for n, p in self.policy.module.named_parameters() if p.requires_grad]
        common = dict(betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                      weight_decay=config.weight_decay, clip_grad=config.clip_grad,
                      fused=plat.fused_adamw(self.platform.device))
        if sharded:
            self.optimizer = ShardedOptimizer(
                ddp_model=self.policy, named_params=named_params, params_once=self._unique_params(sharded=True),
                dp_group=self.mesh.dp_group, dp_rank=self.mesh.dp_rank, dp_size=self.layout.dp, **common,
            )  # fmt: skip
        else:
            self.optimizer = CpuOptimizer(
                named_params=named_params, params_once=self._unique_params(), group=self.mesh.grad_norm_group,
                **common,
            )  # fmt: skip
        if resume_dir:
            self._load_checkpoint(resume_dir)
        # Reference log-probs kept on the last stage: per step batch offset (interleaved), or
        # per pair id (precomputed).
        self._ref_next: dict[int, SequenceLogps] = {}  # next batch's reference, by microbatch
        self._next_ref_ready = False
        # Carrying plans: whether the last step carried reference forwards into the next one,
        # and the reference activations this stage kept for it.
        self._carried = False
        self._kept_ref_acts: dict[int, torch.Tensor] = {}
        # Set trace_ops to record each step's op timeline in last_trace: (op, microbatch, batch,
        # start, end) in seconds from the step's start; "optimizer" covers the optimizer step.
        # Host-side clocks: on a GPU they time kernel launches unless CUDA_LAUNCH_BLOCKING=1.
        self.trace_ops = False
        self.last_trace: list[tuple[str, int, int, float, float]] = []
        self._ref_by_pair: torch.Tensor | None = None  # [num_pairs, 2] on the last stage
        self._ref_eval: torch.Tensor | None = None  # the same for the held-out pairs
        # Exact tensor bytes by category (memory_account.py); memory_report: the peaks of the last
        # step that counted them (--memory-interval).
        self.memory = MemoryAccount(tables=lambda: (self._ref_by_pair, self._ref_eval))
        self.memory_report: dict[str, int] = {}
        self.last_plan = None  # the plan of the last step

    # ------------------------------------------------------------------ build
    def _attach_adapters(self) -> None:
        """Freeze the base, add the adapters, fill them from --init-adapter or PEFT's init; with
        --init-adapter keep their starting copy (the reference)."""
        from checkpoint_convert.peft_adapter import initial_adapter, read_adapter

        config, shape = self.config, lora.shape_of(self.config)
        lora.attach(self.policy, spec=self.spec, lora=shape, dropout=config.lora_dropout, tp=self.layout.tp,
                    tp_group=self.mesh.tp_group)
        if config.init_adapter:
            whole = read_adapter(config.init_adapter, spec=self.spec, lora=shape)
        else:
            whole = initial_adapter(self.spec, shape, seed=config.seed)
        lora.load_shard(self.policy, self._adapter_shard_of(whole))
        if config.init_adapter:
            for adapter in lora.adapters_of(self.policy):
                adapter.keep_frozen_copy()

    def _adapter_shard_of(self, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from checkpoint_convert.peft_adapter import peft_to_shard

        return peft_to_shard(whole.__getitem__, spec=self.spec, lora=lora.shape_of(self.config), tp=self.layout.tp,
                             tp_rank=self.mesh.tp_rank, pp=self.layout.pp, pp_rank=self.mesh.pp_rank,
                             ep=self.layout.ep, ep_rank=self.mesh.ep_rank)

    def _wrap_ddp(self, model: torch.nn.Module, *, distributed_optimizer: bool) -> torch.nn.Module:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
        )
        return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)

    def _all_params(self) -> list[torch.Tensor]:
        models = [self.policy.module] + ([self.reference] if self.reference is not None else [])
        return [t for m in models for t in (*m.parameters(), *m.buffers())]

    def _unique_params(self, *, sharded: bool = False) -> list[torch.nn.Parameter]:
        """Each logical parameter once per model replica: tp-replicated ones (norms) count on tp
        rank 0 only; the last stage's copy of a tied embedding is skipped. With ep > 1 the
        replicated optimizer counts a parameter on one of its dp (expert dp) copies; the sharded
        one on every rank (its slices over those groups are disjoint)."""
        tied_copy = self.spec.tie_word_embeddings and self.layout.pp > 1 and self.mesh.is_last_stage
        once = []
        for name, param in self.policy.module.named_parameters():
            if not param.requires_grad:  # the frozen base of a LoRA run
                continue
            if tied_copy and name == "output_layer.weight" and not self.mesh.is_first_stage:
                continue
            expert = not getattr(param, "allreduce", True)
            whole_expert = expert and self.layout.etp == 1  # not split over tp, nor repeated on its tp ranks
            if not getattr(param, "tensor_model_parallel", False) and self.mesh.tp_rank != 0 and not whole_expert:
                continue
            if not sharded and not self.mesh.counts_in_grad_norm(expert=expert):  # repeats over dp / expert dp (ep > 1)
                continue
            once.append(param)
        return once

    # ------------------------------------------------------------------ data
    def _local_microbatches(self, pairs: Sequence[TokenizedPair]) -> tuple[list[Microbatch], list[list[int]]]:
        """This dp rank's share of a global batch cut into microbatches, and each microbatch's
        pairs as positions in the global batch. Padded: a contiguous share, micro_batch_size
        pairs per microbatch. Packed: the token-balanced split of `packing.plan_packed_step`."""
        if self.packing:
            groups = plan_packed_step(pairs, dp=self.layout.dp,
                                      max_tokens=self.config.packing_budget)[self.mesh.dp_rank]
            mbs = [collate_packed([pairs[i] for i in ids], pad_token_id=self.pad_token_id, multiple=self.seq_multiple)
                   for ids in groups]
            return mbs, groups
        per_rank = len(pairs) // self.layout.dp
        lo = self.mesh.dp_rank * per_rank
        mine = list(range(lo, lo + per_rank))
        seq_len = padded_seq_len(pairs, multiple=self.seq_multiple)
        b = self.config.micro_batch_size
        groups = [mine[k : k + b] for k in range(0, per_rank, b)]
        mbs = [collate([pairs[i] for i in ids], pad_token_id=self.pad_token_id, seq_len=seq_len) for ids in groups]
        return mbs, groups

    # ------------------------------------------------------------------ step
    def train_step(self, batch: StepBatch) -> dict[str, float] | None:
        config, mesh = self.config, self.mesh
        hooks.fire("train_step", step=batch.step, rank=self.rank, output_dir=config.output_dir)
        start = time.perf_counter()  # host clock: the op trace's origin
        step_clock = plat.IntervalClock(self.platform)
        step_clock.start()
        spec = config.loss_spec()
        pairs = batch.pairs
        mbs, groups = self._local_microbatches(pairs)
        microbatches = {0: mbs}
        ref_current = ref_next = False
        num_next_microbatches = None
        plan_ref_mode = config.ref_mode if self.reference is not None else "none"
        # TR-DPO: a step that ends with a reference sync does not compute the next batch's
        # reference (it would be the old one); the next step computes it, as the first step does.
        sync_now = config.sync_ref_model and batch.step % config.ref_model_sync_steps == 0
        if self.reference is not None and config.ref_mode == "interleaved":
            ref_current = not self._next_ref_ready  # first step (or after a restart): nothing cached
            ref_next = batch.next_pairs is not None and not sync_now
            if ref_next:
                microbatches[1] = self._local_microbatches(batch.next_pairs)[0]
                num_next_microbatches = len(microbatches[1])
        sort, sorted_refs = None, {}
        if spec.needs_batch_sort:
            # The sort needs every pair's reference before the step: compute it in the sort pass
            # when it is not at hand already (then the plan has no reference forward of this batch).
            with_reference = self.reference is not None and (config.ref_mode == "sequential" or ref_current)
            sort, sorted_refs = self._sort_pass(batch, mbs, groups, spec=spec, with_reference=with_reference)
            if with_reference:
                ref_current = False
                plan_ref_mode = "none" if config.ref_mode == "sequential" else plan_ref_mode
        # The same on every stage, so that all stages build the same plan. aot reads a batch's
        # whole reference before its step: nothing is carried into the next step's warm-up.
        plan = build_plan(
            num_stages=self.layout.pp,
            num_microbatches=len(mbs),
            num_next_microbatches=num_next_microbatches,
            ref_mode=plan_ref_mode,
            ref_current=ref_current,
            ref_next=ref_next,
            carry_in=self._carried,
            carry_out=ref_next and not spec.needs_batch_sort,
        )
        self.last_plan = plan
        num_pairs_global = len(pairs)
        chosen_tokens_global = sum(len(p.chosen_ids) for p in pairs)
        # Metric sums stay on the device until the step's end: one read per step, not per microbatch.
        sums = torch.zeros(len(METRIC_SUM_KEYS), dtype=torch.float64, device=self.platform.device)
        # Exact memory by category on the steps --memory-interval picks (the same on every rank).
        account = config.accounts_memory(batch.step)
        ctx = self._context(microbatches, trace=[] if self.trace_ops else None, kept_in=self._kept_ref_acts,
                            memory=self.memory if account else None)
        self._kept_ref_acts = {}
        # Reference log-probs computed for this batch in the previous step arrive as offset 0.
        ctx.ref_logps.update({(0, mb): v for mb, v in self._ref_next.items()})
        ctx.ref_logps.update(sorted_refs)
        self._ref_next = {}
        if account:
            self.memory.start_step(exclude=self._all_params())
            self.memory.observe(ctx)

        def loss_fn(mb: int, logps: SequenceLogps) -> torch.Tensor:
            positions = groups[mb]
            pl = pair_logps(logps, self._current_ref(batch, positions, ctx.ref_logps.pop((0, mb), None)),
                             b=len(positions), positions=positions)
            kwargs = dict(spec=spec, num_pairs_global=num_pairs_global, chosen_tokens_global=chosen_tokens_global,
                          sort=sort)
            losses = pair_losses(pl, **kwargs)
            sums.add_(metric_sum_vector(pl, **kwargs))
            # DDP averages gradients over dp ranks; scale by dp so the result is the global mean.
            loss = losses.sum() / num_pairs_global * self.layout.dp
            return loss

        ctx.loss_fn = loss_fn
        if self.moe is not None:  # the aux loss's gradient joins each stage's backward (moe_step.py)
            self.moe.begin(mbs, coef=config.moe_aux_loss_coef or 0.0)
            ctx.riders = self.moe.riders()  # its counts ride on the plan's act and grad messages
        self.policy.zero_grad_buffer()
        run_ops(plan.stages[mesh.pp_rank], ctx)
        moe_metrics = self.moe.finish(mbs) if self.moe is not None else None
        self._sync_tied_embedding_grads()  # before the dp reduction: sums commute, shards need not line up
        allreduce_sequence_parallel_grads(self.policy, tp_group=mesh.tp_group)  # the same holds for these
        self.policy.finish_grad_sync()
        self._ref_next = {mb: v for (offset, mb), v in ctx.ref_logps.items() if offset == 1}
        self._next_ref_ready = ref_next  # on every stage, so that all stages build the same plan
        self._carried, self._kept_ref_acts = plan.carry_out, ctx.kept_out

        lr = lr_at(
            batch.step,
            lr=config.lr,
            schedule=config.lr_schedule,
            warmup_steps=config.lr_warmup_steps,
            total_steps=config.max_steps,
        )
        optimizer_start = time.perf_counter()
        grad_norm = self.optimizer.step(lr=lr)
        if sync_now and self.reference is not None:
            self._sync_reference()
        memory = {}
        if account:  # read after the optimizer step: AdamW allocates its moments in the first one
            self.memory.static = static_bytes(policy=self.policy.module, reference=self.reference,
                                              optimizer_state_bytes=self.optimizer.state_bytes())
            self.memory_report = {**self.memory.report(), **device_figures(self.platform.device)}
            memory = self._max_over_ranks(self.memory_report)
        if ctx.trace is not None:
            ctx.trace.append(("optimizer", -1, 0, optimizer_start, time.perf_counter()))
            self.last_trace = [(kind, mb, b_, t0 - start, t1 - start) for kind, mb, b_, t0, t1 in ctx.trace]
        metrics = self._reduce_metrics(sums, spec=spec)
        step_clock.stop()
        elapsed = step_clock.total_s()
        # Time blocked in transfers (device time on a GPU, see IntervalClock) over the step time.
        bubble, peak_bytes = self._over_ranks(
            mean=ctx.wait_clock.total_s() / elapsed, max_=plat.max_memory_bytes(self.platform)
        )
        if metrics is None:
            return None
        token_stats = step_token_stats(pairs, packing=self.packing, dp=self.layout.dp,
                                       max_tokens=config.packing_budget,
                                       micro_batch_size=config.micro_batch_size, multiple=self.seq_multiple)
        tokens = token_stats["tokens/real"]
        metrics.update({"grad_norm": grad_norm, "lr": lr, "step_time_s": elapsed, "tokens/s": tokens / elapsed,
                        "bubble_fraction": bubble, "memory/peak_gib": peak_bytes / 2**30, **token_stats})
        metrics.update({f"memory/{name}": value for name, value in memory.items()})
        metrics.update(moe_metrics or {})
        return metrics

    def _max_over_ranks(self, figures: dict[str, int]) -> dict[str, int]:
        """Each figure's largest value over the ranks of the group (the same keys on every rank)."""
        if self.layout.world_size == 1:
            return dict(figures)
        vec = torch.tensor(list(figures.values()), dtype=torch.float64, device=self.platform.device)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        return dict(zip(figures, (int(v) for v in vec.tolist())))

    def _over_ranks(self, *, mean: float, max_: float) -> tuple[float, float]:
        """(mean of `mean`, max of `max_`) over every rank of the group."""
        if self.layout.world_size == 1:
            return mean, max_
        vec = torch.tensor([mean, -max_], dtype=torch.float64, device=self.platform.device)
        total = vec.clone()
        dist.all_reduce(total)
        dist.all_reduce(vec, op=dist.ReduceOp.MIN)
        return float(total[0]) / self.layout.world_size, -float(vec[1])

    def _sync_tied_embedding_grads(self) -> None:
        """With tied embeddings split over pp stages, the first stage's embedding and the last
        stage's output layer are one parameter: sum their gradients."""
        if not (self.spec.tie_word_embeddings and self.layout.pp > 1 and self.mesh.embedding_group is not None):
            return
        module = self.policy.module
        weight = module.shared_embedding_or_output_weight()
        if not weight.requires_grad:  # frozen (LoRA)
            return
        dist.all_reduce(weight.main_grad, group=self.mesh.embedding_group)

    def _reduce_metrics(self, sums: torch.Tensor, *, spec) -> dict[str, float] | None:
        """Sum the last stage's metric sums ([METRIC_SUM_KEYS] on the device) over dp ranks and
        read them; tp rank 0 of the last stage reports."""
        mesh = self.mesh
        if not mesh.is_last_stage:
            return None
        vec = sums
        if self.layout.dp > 1:
            dist.all_reduce(vec, group=mesh.dp_group)
        if not mesh.returns_result:
            return None
        return finalize_metrics(dict(zip(METRIC_SUM_KEYS, vec.tolist())), spec=spec)

    # ------------------------------------------------------------------ reference and sort helpers
    def _current_ref(self, batch: StepBatch, positions: list[int], stored: SequenceLogps | None) -> torch.Tensor | None:
        """Reference summed log-probs of this batch's pairs at `positions` (rows chosen, then
        rejected), from wherever this run keeps them; None when there is no reference."""
        if batch.ref_logps is not None:
            return table_rows(batch.ref_logps, positions, device=self.platform.device)
        if self._ref_by_pair is not None:
            return table_rows(self._ref_by_pair, [batch.pair_ids[i] for i in positions], device=self.platform.device)
        if stored is None and self.reference is not None:  # a plan bug, never a zero reference
            raise RuntimeError(f"reference log-probs of pairs {positions[:3]}... were not computed")
        return stored.logp_sum if stored is not None else None

    @torch.no_grad()
    def _sort_pass(
        self, batch: StepBatch, mbs: list[Microbatch], groups: list[list[int]], *, spec, with_reference: bool
    ) -> tuple[BatchSort | None, dict[tuple[int, int], SequenceLogps]]:
        """aot/aot_unpaired: a forward-only policy pass (and reference pass, if asked) over this
        rank's microbatches, then the BatchSort of the whole global batch on the last stage.
        Returns it and the reference log-probs the pass computed, keyed like ctx.ref_logps."""
        ctx = self._context({0: mbs}, forward_only=True)
        policy_rows: dict[int, SequenceLogps] = {}

        def record(mb: int, logps: SequenceLogps) -> torch.Tensor:
            policy_rows[mb] = logps
            return torch.zeros(())

        ctx.loss_fn = record
        run_ops(forward_only_ops(mesh=self.mesh, num_microbatches=len(mbs), policy=True, reference=with_reference),
                ctx)
        if not self.mesh.is_last_stage:
            return None, {}
        refs = dict(ctx.ref_logps)
        parts = {}
        for mb, logps in policy_rows.items():
            positions = groups[mb]
            stored = refs.get((0, mb)) if with_reference else self._ref_next.get(mb)
            parts[mb] = pair_logps(logps, self._current_ref(batch, positions, stored), b=len(positions),
                                    positions=positions)
        return self._global_sort(parts, num_pairs=len(batch.pairs), spec=spec), refs

    def _global_sort(self, parts: dict[int, PairLogps], *, num_pairs: int, spec) -> BatchSort:
        """Every pair's log-probs of the global batch, gathered over dp ranks, sorted once."""
        table = torch.zeros(num_pairs, 4, dtype=torch.float64, device=self.platform.device)
        for pl in parts.values():
            table[pl.pair_index] = torch.stack(
                [pl.chosen_logps, pl.rejected_logps, pl.ref_chosen_logps, pl.ref_rejected_logps], dim=1
            ).double()
        if self.layout.dp > 1:
            dist.all_reduce(table, group=self.mesh.dp_group)
        values = table.float()  # the loss's own dtype: sorted values match the live ones exactly
        zeros = torch.zeros(num_pairs, device=table.device)
        whole = PairLogps(values[:, 0], values[:, 1], values[:, 2], values[:, 3], zeros, zeros, zeros, zeros)
        return batch_sort(whole, spec=spec)

    @torch.no_grad()
    def _sync_reference(self) -> None:
        """TR-DPO (TRL 1.16 `SyncRefModelCallback._sync_target_model`): ref <- α·policy + (1-α)·ref,
        parameter by parameter, in the parameters' own dtype. Each rank mixes its own shard."""
        alpha = self.config.ref_model_mixup_alpha
        policy = dict(self.policy.module.named_parameters())
        for name, param in self.reference.named_parameters():
            param.mul_(1.0 - alpha).add_(policy[name].detach(), alpha=alpha)

    def precompute_reference(self, pairs: Sequence[TokenizedPair], eval_pairs: Sequence[TokenizedPair] = ()) -> None:
        """`--ref-mode precomputed`: one forward-only reference pass over the data set (and the
        held-out pairs); the last stage keeps the log-probs, then the reference is released."""
        self._ref_by_pair = self.reference_table(pairs)
        self._ref_eval = self.reference_table(eval_pairs) if eval_pairs else None
        self.release_reference()

    def release_reference(self) -> None:
        self.reference = None
        gc.collect()

    def grad_shard(self) -> dict[str, torch.Tensor]:
        """This rank's gradients of the last step (summed over microbatches, reduced over dp),
        before clipping: the optimizer clipped them in place, and its coefficient is divided
        out again (to within an ulp)."""
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.gather_grads()
        clip = self.optimizer.last_clip
        return shard_names({n: (p.main_grad.detach().to("cpu", copy=True) / clip if clip != 1.0
                                else p.main_grad.detach().to("cpu", copy=True))
                            for n, p in self.policy.module.named_parameters() if p.requires_grad})

