"""What every rank of every role has: its device, process group and parallel state (in that
order, then the pipeline links and the RNG), its models built and loaded for its coordinates,
the executor contexts of its stage, and forward-only reference passes over pairs.

`worker.PolicyWorker` (role "policy") and `worker.ReferenceWorker` (role "ref") are Ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from checkpoint_convert.families.base import DTYPES, ModelSpec
from checkpoint_convert.mapping import hf_to_mcore_shard
from mcore_dpo.parallel import platform as plat
from mcore_dpo.config import TrainConfig
from mcore_dpo.data.pairs import Microbatch, TokenizedPair, seq_len_multiple
from mcore_dpo.data.store import TokenStore
from mcore_dpo.data.even_passes import rank_passes
from mcore_dpo.objective import registry
from mcore_dpo.objective.logprobs import LogpsOptions
from mcore_dpo.parallel.mesh import Layout, Mesh, destroy, initialize
from mcore_dpo.data.microbatches import RowLayout
from mcore_dpo.model.chunks import build_chunks, rank_shard
from mcore_dpo.model.builder import build_stage_model, layer_spec_name, load_shard, open_weights, place_on_device
from mcore_dpo.model.score_head import WithFreshScore, reward_config, source_config
from mcore_dpo.pipeline.executor import StageContext, forward_only_ops, run_ops, warm_up_links


class Rank:
    """What every rank of every role has: device, process group, parallel state, RNG, and
    models built and loaded for its (tp, pp) coordinates."""

    @property
    def packing(self) -> bool:
        """Packed microbatches: --packing / --no-packing as given; an unset one that the driver
        left open (no mode packing does not serve) is decided by the rank's attention."""
        if self.config.packing is not None:
            return self.config.packing
        if self.layout.cp > 1 and self.packed_thd:  # THD rows with cp are not wired (docs/DESIGN.md)
            return False
        return self.config.packing_unserved() is None and plat.default_packing(thd_attention=self.packed_thd)

    @property
    def rows(self) -> RowLayout:
        """How this rank lays pairs out in microbatch rows (packed or padded, prompts shared or not)."""
        return RowLayout(packing=self.packing, prefix_sharing=bool(self.config.prefix_sharing),
                         pad_token_id=self.pad_token_id, multiple=self.seq_multiple,
                         max_tokens=self.config.packing_budget,
                         count_multiple=self.layout.microbatch_group)

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
        stores: dict[str, tuple[str, str]] | None = None,
    ):
        self.config = config
        self.objective = registry.build(config)  # what is trained: its sample shape, reference, loss
        # The token stores the driver built ("data", "eval_data" -> (path, key)), opened on first use.
        self._store_places = dict(stores or {})
        self._stores: dict[str, TokenStore] = {}
        self._last_read: tuple[tuple[int, ...] | None, list[TokenizedPair]] = (None, [])
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
        # Multi-latent attention runs the local spec everywhere: megatron-core's Transformer Engine
        # MLA replicates the down projections and fuses the latent norms (another shard layout).
        # Gemma 3's and GPT-OSS's layers are spec modules of ours on the local spec (model/gemma3.py, gpt_oss.py).
        self.use_te = (plat.transformer_engine_available() and not config.lora and not spec.multi_latent_attention
                       and spec.family not in ("gemma3_text", "gpt_oss"))
        # MoE experts: grouped GEMMs on the Transformer Engine spec, else sequential. Their live
        # parameter names differ; shards and checkpoints keep the sequential ones (model.shard_names).
        self.grouped_experts, self.experts_note = plat.use_grouped_experts(
            requested=config.moe_grouped_gemm, num_experts=spec.num_experts, use_te=self.use_te,
            grouped_linear=self.use_te and plat.te_grouped_linear_available())
        # megatron-core's MoE layer needs sequence parallelism at tp > 1: on for MoE models.
        requested = True if spec.num_experts else False if config.lora else config.sequence_parallel
        self.sequence_parallel = plat.use_sequence_parallel(self.platform, requested=requested, tp=layout.tp)
        self.seq_multiple = seq_len_multiple(tp=layout.tp, sequence_parallel=self.sequence_parallel, cp=layout.cp)
        # Packed rows run in the THD layout on Transformer Engine's attention, else with a mask.
        self.packed_thd = self.use_te and self.platform.is_cuda
        if layout.cp > 1 and self.packed_thd and config.packing:
            raise ValueError("packing: packed rows in Transformer Engine's THD layout are not wired with context "
                             f"parallelism (--cp {layout.cp}) yet; use --no-packing")
        if layout.cp > 1 and self.use_te and config.prefix_sharing:  # TE's arbitrary mask has no CP
            raise ValueError("prefix_sharing: shared-prompt rows on Transformer Engine's attention are not wired with "
                             f"context parallelism (--cp {layout.cp}) yet; use --no-prefix-sharing")

    def has_store(self, name: str) -> bool:
        """Whether the driver gave this rank a token store of `name` ("eval_data": a held-out set)."""
        return name in self._store_places

    def store(self, name: str) -> TokenStore:
        """The token store of "data" or "eval_data" as the driver built it, opened once (memory
        maps: this rank reads the rows it uses, nothing else)."""
        if name not in self._stores:
            if name not in self._store_places:
                raise RuntimeError(f"this rank was given no {name} token store")
            path, key = self._store_places[name]
            self._stores[name] = TokenStore.open(path, key=key)
        return self._stores[name]

    def pairs_of(self, pair_ids: Sequence[int]) -> list[TokenizedPair]:
        """Pairs of the training data by their store indices, read from the store. The last
        batch read is kept: a step reads the next step's batch, which that step reads again."""
        ids = tuple(pair_ids)
        if self._last_read[0] != ids:
            data = self.store("data")
            self._last_read = (ids, [data[i] for i in ids])
        return self._last_read[1]

    def build(self, weights_dir: str, *, checked: bool = False) -> torch.nn.Module:
        """This rank's stage of the model in `weights_dir`, on its device, loaded. `checked`: a
        checkpoint the driver has checked against its manifest before resuming from it
        (checkpoint.layout.resume_point), whose checksums are not read again here."""
        def build_chunk(chunk: int) -> torch.nn.Module:
            return build_stage_model(
                self.spec, mesh=self.mesh, dtype=self.dtype, on_gpu=self.platform.is_cuda, use_te=self.use_te,
                sequence_parallel=self.sequence_parallel, grouped_experts=self.grouped_experts,
                deterministic=self.config.deterministic, fused_kernels=self.config.fused_kernels,
                # The policy recomputes in its backward; a frozen reference runs in eval mode,
                # where megatron-core recomputes nothing.
                recompute=self.config.recompute, recompute_num_layers=self.config.recompute_num_layers,
                arbitrary_masks=bool(self.config.prefix_sharing), chunk=chunk,
            )
        with plat.building_models(self.platform):  # one chunk per virtual stage of this rank (--vpp)
            model = place_on_device(build_chunks(build_chunk, vpp=self.layout.vpp), self.platform.device)
        weights = open_weights(weights_dir, verify_checksums=not checked)
        if self.spec.num_labels and not weights.spec.num_labels:  # a reward model from a causal LM: a new head
            _, score = reward_config(source_config(weights_dir), pad_token_id=self.pad_token_id, seed=self.config.seed)
            weights = WithFreshScore(weights, score)
        shard = rank_shard(lambda pp, pp_rank: hf_to_mcore_shard(  # reads only this rank's part of each tensor
            self.spec,
            tp=self.layout.tp,
            tp_rank=self.mesh.tp_rank,
            pp=pp,
            pp_rank=pp_rank,
            get=weights.get,
            get_part=weights.get_part,
            layer_spec=layer_spec_name(use_te=self.use_te),
            ep=self.layout.ep,
            ep_rank=self.mesh.ep_rank,
        ), layout=self.layout, pp_rank=self.mesh.pp_rank)
        load_shard(model, shard)
        return model

    def stage_context(self, microbatches_of: dict[int, list[Microbatch]], *, policy: torch.nn.Module | None = None,
                      reference: torch.nn.Module | None = None, **kwargs) -> StageContext:
        """The executor's context for running a plan of this stage over `microbatches_of` (batch
        offset -> microbatches) with these models."""
        return StageContext(
            mesh=self.mesh,
            policy=policy,
            reference=reference,
            microbatches=microbatches_of,
            hidden_size=self.spec.hidden_size,
            dtype=self.dtype,
            device=self.platform.device,
            vocab_size=self.spec.vocab_size,
            wait_clock=plat.IntervalClock(self.platform),
            sequence_parallel=self.sequence_parallel,
            packed_thd=self.packed_thd,
            logps_options=LogpsOptions(ld_alpha=self.config.ld_alpha, wpo=self.config.use_weighting,
                                       whole_sequence=self.objective.whole_sequence),
            score_pad_token_id=self.pad_token_id if self.objective.head == "score" else None,
            **kwargs,
        )

    @torch.no_grad()
    def reference_table(self, pairs: Sequence[TokenizedPair], *, model: torch.nn.Module) -> torch.Tensor | None:
        """Forward-only passes of `model` (a reference) over `pairs` (dp ranks take them round-robin):
        on the last stage, [samples, sequences] summed log-probs, one column per sequence of the
        objective's sample (a pair: chosen, rejected); None elsewhere.

        Chunks hold this group's share of a global batch (its own dp, which for the "ref" group
        need not be the policy's), in whole padded microbatches; a chunk's last microbatch may be
        smaller."""
        dp, mesh = self.layout.dp, self.mesh
        b = self.config.micro_batch_size
        rows_per_chunk = max(1, self.config.global_batch_size // dp // b) * b

        def passes_of(dp_rank: int) -> list:
            mine = list(range(dp_rank, len(pairs), dp))
            chunks = [mine[lo : lo + rows_per_chunk] for lo in range(0, len(mine), rows_per_chunk)]
            return [(None, [ids[k : k + b] for k in range(0, len(ids), b)]) for ids in chunks]

        # ep > 1: the same forwards on every rank (expert all-to-all); the dummies' results are dropped.
        passes = rank_passes(passes_of, dp=dp, dp_rank=mesh.dp_rank, even=self.layout.ep > 1)
        k = self.objective.shape.count
        table = torch.zeros(len(pairs), k, dtype=torch.float64, device=self.platform.device)
        for _, groups, num_real in passes:
            mbs = self.rows.padded().microbatches(pairs, groups)
            ctx = self.stage_context({0: mbs}, reference=model, forward_only=True)
            run_ops(forward_only_ops(mesh=mesh, num_microbatches=len(mbs), policy=False, reference=True), ctx)
            if mesh.is_last_stage:
                for mb, ids in enumerate(groups[:num_real]):
                    logps = ctx.ref_logps.pop((0, mb))
                    table[ids] = logps.logp_sum.view(k, len(ids)).T.double()  # rows: sequence-major
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
        destroy()
