"""Training configuration: one dataclass, TrainConfig, and its checks.

Every field is a flag of the same name with dashes (`global_batch_size` -> `--global-batch-size`;
the parser, YAML loading and `resolve` are in mcore_dpo/command_line.py). `validate()` checks
everything that can be checked without starting a process; its errors are one line naming the
field.

Over 500 lines by design: one field per flag, each documented under it (that text is --help),
with the checks of each value beside the fields; splitting would part a flag from its checks.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import yaml

from checkpoint_convert.names import DTYPE_NAMES, canonical_dtype, hub_name_hint
from mcore_dpo.data.mix import as_list, parse_sources
from mcore_dpo.objective import registry
from mcore_dpo.objective.loss_spec import LOSS_TYPES, LossSpec
from mcore_dpo.pipeline.plan import REF_MODES

# The plan's modes, plus the reference on a worker group of its own.
RUN_REF_MODES = REF_MODES + ("separate",)
# --recompute: megatron-core's activation recompute granularities, and none.
RECOMPUTE_MODES = ("none", "selective", "full")
# Why packing does not serve a load-balancing loss (`TrainConfig.packing_unserved`).
MOE_AUX_UNSERVED = ("the MoE load-balancing loss (a mean over microbatches, which packing composes differently than "
                    "--micro-batch-size does)")


class ConfigError(ValueError):
    """A bad configuration value; str() is one line naming the field or file."""


@dataclass
class TrainConfig:
    # --- inputs and output ---
    model: str | None = None
    """HF model directory, a checkpoint_convert Megatron directory, or a torch_dist checkpoint
    (Megatron-LM layout, e.g. from Megatron-LM, Megatron-Bridge or ms-swift); None = the embedded tiny default."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to the model's own tokenizer files."""
    chat_template: str | None = None
    """Jinja chat template file for conversational rows, replacing the tokenizer's (needed when it has none)."""
    ref_model: str | None = None
    """Reference model directory; defaults to --model."""
    data: str | list[str] | None = None
    """Preference data: a JSONL, JSON or Parquet file or a saved Hugging Face dataset directory; several
    make a mix, each with an optional weight (--data a.jsonl:0.7 b.parquet:0.3: 70% and 30% of each
    epoch's samples, drawn by --seed; without weights every pair of every file once). None = the
    embedded default data set."""
    eval_data: str | None = None
    """Held-out preference pairs for eval/ metrics; None = none (the embedded default has one)."""
    output_dir: str | None = None
    """Run directory (metrics.jsonl, config.yaml, checkpoints/, hf/); None = a fresh outputs/<UTC time>-<model>
    per run. One holding another run's outputs is refused unless --overwrite."""
    overwrite: bool = False
    """Empty an --output-dir that holds another run's outputs (or checkpoints) and start afresh there."""

    # --- parallelism and batching ---
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: int = 1
    """Virtual pipeline stages: model chunks per pipeline rank, run by megatron-core's interleaved 1F1B
    (chunk c of stage s holds the (c x pp + s)-th of pp x vpp equal slices of the layers). Needs pp >= 2,
    a layer count divisible by pp x vpp and a microbatch count divisible by pp (padded microbatches).
    See docs/DESIGN.md "Virtual pipeline stages"."""
    dp: int = 1
    """Data-parallel size."""
    cp: int = 1
    """Context-parallel size: each sequence split over cp ranks, 2 x cp chunks of a row with cp rank i
    holding chunks i and 2cp-1-i (causal attention's work balanced); rows are padded to a multiple of
    2 x cp (x tp with sequence parallelism). The world is tp x pp x dp x cp; the cp ranks of a replica
    run the same microbatches and gradients are reduced over dp x cp. Padded, packed and shared-prompt
    rows. Dense models; not with --ep > 1. See docs/DESIGN.md "Context parallelism"."""
    ep: int = 1
    """Expert-parallel size (MoE models): a layer's experts are split over ep ranks, carved from each stage's tp x dp ranks."""
    moe_aux_loss_coef: float | None = None
    """Weight of the routers' load-balancing loss added to the policy's loss (MoE models; docs/MODELS.md
    has the formula). Default: the model config's router_aux_loss_coef when output_router_logits is true, else 0."""
    micro_batch_size: int = 8
    """Pairs per microbatch (each pair is two rows: chosen and rejected)."""
    global_batch_size: int = 64
    """Pairs per optimizer step, over all microbatches and data-parallel ranks."""
    packing: bool | None = None
    """Packed sequences (padding-free): a step's pairs are split over dp ranks and microbatches by
    tokens (--max-tokens-per-microbatch), each microbatch one row of sequences laid end to end,
    each attending only to itself. --packing insists (modes it does not serve are then refused);
    --no-packing: padded microbatches of --micro-batch-size pairs. (default: decided by the ranks'
    attention: on where it runs in Transformer Engine's THD layout (a GPU), off on the local
    attention (the CPU), whose W x W packed rows cost more than padding, see docs/PACKING.md; off
    too with a mode packing does not serve, --ep > 1 or the MoE load-balancing loss, said at
    startup; --max-tokens-per-microbatch alone turns it on)"""
    max_tokens_per_microbatch: int | None = None
    """Packed: token budget of one microbatch, at least 2 x --max-length (a pair's two sequences
    always share a microbatch). (default: 2 x --micro-batch-size x --max-length, what one padded
    microbatch holds at most, so packing never widens a microbatch)"""
    prefix_sharing: bool = False
    """Shared-prompt rows: each pair's prompt computed once for its chosen and rejected completions
    (one row [prompt | chosen | rejected], the rejected branch at the chosen branch's positions and
    blind to it), in the policy's forward and backward and in the reference's forward; the
    log-prob tables and so every loss are today's. Packed or padded rows alike. See
    docs/PREFIX_SHARING.md."""
    max_steps: int = 120
    """Optimizer steps to run."""
    max_length: int = 64
    """Maximum tokens of prompt + completion; longer pairs keep their start."""
    seed: int = 1234
    """Seed of the data order (and of a weighted mix's draw)."""
    data_workers: int | None = None
    """Processes that tokenize the data into the token store, in batched calls (None = the cores of the
    machine, at most 8, and one per 4 MB of data). A store already built is opened, not tokenized again."""
    data_cache: str | None = None
    """Directory of the token stores (None = $MCORE_DPO_CACHE/data, default ~/.cache/mcore_dpo/data).
    Multi-node runs need one every node sees, as --output-dir (docs/DATA.md)."""
    no_shuffle: bool = False
    """Keep the file order instead of a seeded shuffle."""

    # --- loss ---
    objective: str = "dpo"
    """dpo | cpo | orpo | kto | reward: what is trained (docs/OBJECTIVES.md). cpo (CPO, SimPO, AlphaPO) and
    orpo are reference-free: no reference model is built or run. kto trains on unpaired rows {prompt,
    completion, label} (or pairs, unpaired as TRL 1.16 does). reward: a Bradley-Terry reward model (a
    score head; --model a causal LM or a *ForSequenceClassification; exported as one)."""
    beta: float = 0.1
    """β: DPO's temperature; cpo's reward scale."""
    loss_type: str = "sigmoid"
    """dpo: one of the names below, or a comma list of them with --loss-weights. cpo: one of sigmoid, hinge,
    ipo, simpo, alphapo. kto: kto (its default) or apo_zero_unpaired."""
    loss_weights: str | None = None
    """Comma list of weights, one per --loss-type entry (default: all 1)."""
    label_smoothing: float = 0.0
    """Label smoothing epsilon (robust, exo_pair, cdpo)."""
    ref_mode: str = "interleaved"
    """interleaved | sequential | precomputed | separate | none (reference-free). `separate` runs
    the reference as its own Ray worker group with --ref-tp/--ref-pp/--ref-dp."""
    ref_tp: int = 1
    """Tensor-parallel size of the reference group (--ref-mode separate)."""
    ref_pp: int = 1
    """Pipeline-parallel size of the reference group (--ref-mode separate)."""
    ref_dp: int = 1
    """Data-parallel size of the reference group (--ref-mode separate)."""
    f_divergence_type: str = "reverse_kl"
    """reverse_kl | forward_kl | js_divergence | alpha_divergence (TRL 1.16 `DPOConfig.f_divergence_type`)."""
    f_alpha_divergence_coef: float = 0.5
    """α of alpha_divergence."""
    discopop_tau: float = 0.05
    """Temperature τ of the discopop loss."""
    ld_alpha: float | None = None
    """LD-DPO: weight in [0, 1] of the completion tokens past the shorter completion of the pair (None = off)."""
    use_weighting: bool = False
    """WPO: weight each pair's loss by the policy's length-normalised sequence probabilities."""
    sync_ref_model: bool = False
    """TR-DPO: mix the reference toward the policy every --ref-model-sync-steps steps."""
    ref_model_mixup_alpha: float = 0.6
    """TR-DPO α: reference <- α·policy + (1-α)·reference."""
    ref_model_sync_steps: int = 512
    """TR-DPO τ: steps between reference syncs."""
    cpo_alpha: float = 1.0
    """cpo: weight of the NLL (behaviour cloning) term on the chosen completions (alphapo: 0)."""
    simpo_gamma: float = 0.5
    """cpo --loss-type simpo / alphapo: SimPO's target reward margin γ."""
    alpha: float = 0.0
    """cpo: AlphaPO's reward shape a, rewards (1 - p^(-a))/a of the mean token probability p (0: log p)."""
    desirable_weight: float = 1.0
    """kto: weight of the loss of each desirable sample (label true)."""
    undesirable_weight: float = 1.0
    """kto: weight of the loss of each undesirable sample (label false)."""
    center_rewards_coefficient: float | None = None
    """reward: κ of the term κ·(r+ + r-)² that pulls each pair's reward sum towards 0 (None: off; TRL suggests 0.01)."""

    # --- LoRA ---
    lora_rank: int | None = None
    """LoRA rank r: train low-rank adapters on the frozen base instead of every weight (None = full
    fine-tuning; --init-adapter alone takes the adapter's rank). The reference is then the starting
    policy itself, adapters off or at their starting copy, with no second model (docs/LORA.md)."""
    lora_alpha: float | None = None
    """LoRA alpha: updates are scaled by alpha/r (default: r, or the --init-adapter's)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input (PEFT's lora_dropout); the reference never uses it."""
    lora_targets: str | None = None
    """Comma list of linears to adapt: qkv, proj, fc1, fc2; on MoE models qkv, proj, expert_fc1, expert_fc2
    (experts = both). Default: every one the model has, or the --init-adapter's."""
    init_adapter: str | None = None
    """PEFT LoRA adapter directory to start from (e.g. a LoRA SFT result); the reference is its frozen copy."""
    merge_lora: bool = True
    """Export the merged model to OUTPUT/hf (--no-merge-lora: only the PEFT adapter in OUTPUT/adapter)."""

    # --- optimizer ---
    lr: float = 1e-3
    """Peak learning rate (the tiny default needs a large one; real models use ~5e-7)."""
    lr_schedule: str = "constant"
    """constant | cosine."""
    lr_warmup_steps: int = 0
    """Linear warmup steps."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay, in [0, 1)."""
    adam_beta2: float = 0.999
    """AdamW second-moment decay, in [0, 1)."""
    adam_eps: float = 1e-8
    """AdamW epsilon added to the denominator."""
    clip_grad: float = 1.0
    """Clip by the global gradient norm (0 = off)."""
    distributed_optimizer: bool = True
    """Shard the fp32 master weights and AdamW moments over the dp ranks (ZeRO-1; CPU and GPU;
    with ep > 1 the experts' over the expert-data-parallel ranks): gradients are
    reduce-scattered, parameters all-gathered. --no-distributed-optimizer keeps
    the whole state on every dp rank (gradients all-reduced). Same results either way."""
    sequence_parallel: bool | None = None
    """Split the activations outside the tensor-parallel linears over tp along the sequence.
    Default (unset): on for tp > 1 on GPUs, off on the CPU, and always on for MoE models at tp > 1
    (megatron-core's MoE layer needs it); --sequence-parallel needs tp > 1."""
    moe_grouped_gemm: bool | None = None
    """MoE models: run each layer's local experts as one grouped GEMM per projection (megatron-core's
    TEGroupedMLP) instead of one GEMM per expert. Default (unset): on wherever Transformer Engine
    (>= 1.9) is present, else sequential experts (the CPU, LoRA runs). Checkpoints are the same
    either way. --no-moe-grouped-gemm keeps sequential experts on GPUs too."""
    recompute: str = "none"
    """none | selective | full: activation recompute (megatron-core's own), compute traded for the
    memory the policy keeps between its forward and its backward. none: every activation is kept. selective: each layer's
    core attention (the attention scores and softmax probabilities, s x s per head on the local
    layer spec) is recomputed in the backward (megatron-core's recompute_granularity "selective",
    recompute_modules ["core_attn"]). full: each group of --recompute-num-layers layers keeps
    only its input and runs its forward again in the backward (recompute_granularity "full",
    recompute_method "uniform"), about one more policy forward per step; dense models only for
    now. The results are the same either way; docs/GUIDE.md says when to use which."""
    recompute_num_layers: int | None = None
    """With --recompute full: the layers of each recomputed group (megatron-core's
    recompute_num_layers with recompute_method "uniform"); it must divide every pipeline stage's
    layer count. More layers per group keep fewer inputs but rerun a larger group at once in the
    backward. (default: 1, each layer its own group)"""

    # --- run ---
    eval_interval: int = 40
    """Evaluate on --eval-data every N steps (0 = only at the start and the end)."""
    memory_interval: int = 50
    """Count the exact tensor memory by category (the memory/* metrics: policy stash, reference in
    flight, carried, log-prob tables, buffers, the run-long state) on steps 1 and 2 and every N-th
    step; 1 = every step, 0 = steps 1 and 2 only. The count hooks every tensor a forward saves and
    walks the live tensors after each op: about 5% of a step of the tiny default model on the CPU."""
    dtype: str = "float32"
    """Parameter dtype: float32 | bfloat16 | float16 (fp32, bf16, fp16 are read as these)."""
    fused_kernels: bool | None = None
    """megatron-core's and Transformer Engine's fused kernels: bias-SwiGLU, RoPE (THD too, with no
    host sync), weight-gradient accumulation into the fp32 main grads, MoE token permutation.
    (default: on where the ranks run the Transformer Engine spec on a GPU, off elsewhere, where
    they do not exist; --no-fused-kernels turns them off, as the GPU parity checks compare)"""
    deterministic: bool = False
    """Deterministic GPU kernels, so that a resumed bf16 run repeats an uninterrupted one bit for
    bit: torch's deterministic algorithms (the packed rows' segment sums included), deterministic
    cuBLAS workspaces, Transformer Engine's deterministic attention backward, megatron-core's
    deterministic mode. Slower on GPUs (docs/GUIDE.md); the CPU is deterministic either way."""
    timeout_s: float | None = None
    """Timeout of collectives and point-to-point communication, the one a stuck peer is found by.
    (default: the ranks' platform decides, platform.default_timeout_s: 1800 on GPUs, where a large
    model's first step, with its weights loading and NCCL connecting, must fit; 300 on the CPU's
    gloo, where a dead peer should end a small run in minutes). Joining the ranks' world waits at
    least 300 s whatever this is (ranks start seconds apart)."""
    placement_timeout_s: float = 120.0
    """How long to wait for the cluster to provide every rank's device before giving up."""
    on_bad_row: str = "error"
    """error | skip: what to do with malformed data rows."""
    trust_remote_code: bool = False
    """Allow tokenizers with custom code (off unless asked)."""
    export_hf: bool = True
    """Write the trained policy as an HF directory to OUTPUT/hf at the end."""

    # --- reliability ---
    save_interval: int = 500
    """Write a checkpoint every N steps (0 = by step never); rerunning the same command resumes from it."""
    save_interval_min: float = 30.0
    """Also write a checkpoint when this many minutes passed since the last one (0 = by time never)."""
    keep_last: int = 0
    """Keep only the newest K checkpoints (0 = keep all)."""
    save_format: str = "safetensors"
    """Training checkpoint format: safetensors (this project's) or torch_dist (Megatron-LM's layout, model and
    optimizer state, with megatron-core dist_checkpointing: Megatron-LM can continue from it)."""
    resume: bool = True
    """Continue from OUTPUT's latest checkpoint when there is one (--no-resume refuses to run over it)."""
    max_restarts: int = 0
    """When a worker dies: rebuild the group and resume from the latest checkpoint, up to N times."""
    resume_with_changes: bool = False
    """Resume even when --data (its content), --seed, --global-batch-size, shuffling, the model or
    the loss differ from the checkpoint's run (which changes the data order or the objective)."""

    # --- logging ---
    wandb: bool = False
    """Also log metrics to Weights & Biases (needs `pip install wandb`; WANDB_MODE=offline works)."""
    wandb_project: str | None = None
    """Weights & Biases project (with --wandb; default mcore_dpo)."""

    def accounts_memory(self, step: int) -> bool:
        """Whether `step` counts the exact tensor memory (--memory-interval)."""
        return step <= 2 or (self.memory_interval > 0 and step % self.memory_interval == 0)

    def loss_spec(self) -> LossSpec:
        types = tuple(t.strip() for t in self.loss_type.split(",") if t.strip())
        if self.loss_weights:
            try:
                weights = tuple(float(w) for w in self.loss_weights.split(","))
            except ValueError:
                raise ConfigError(f"loss_weights: {self.loss_weights!r} is not a comma list of numbers") from None
        else:
            weights = tuple(1.0 for _ in types)
        return LossSpec(
            loss_types=types,
            loss_weights=weights,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            reference_free=self.ref_mode == "none",
            discopop_tau=self.discopop_tau,
            f_divergence_type=self.f_divergence_type,
            f_alpha_divergence_coef=self.f_alpha_divergence_coef,
            use_weighting=self.use_weighting,
        )

    @property
    def packing_budget(self) -> int:
        """Tokens per packed microbatch: --max-tokens-per-microbatch, else what one padded
        microbatch holds at most (2 x micro_batch_size x max_length)."""
        return self.max_tokens_per_microbatch or 2 * self.micro_batch_size * self.max_length

    def packing_unserved(self) -> str | None:
        """The mode of this run that packing does not serve, as a phrase; None when it serves
        every mode asked for."""
        if self.ep > 1:
            return (f"--ep {self.ep} (expert-parallel ranks must run the same microbatches; packed dp replicas "
                    "each run their own count)")
        if self.moe_aux_loss_coef:
            return MOE_AUX_UNSERVED
        return None

    @property
    def packed(self) -> bool:
        """Whether this run may pack: --packing / --no-packing as given; unset, unless a mode
        packing does not serve is on (`packing_unserved`), the ranks decide by their attention
        (`platform.default_packing`)."""
        return self.packing if self.packing is not None else self.packing_unserved() is None

    def decide_packing(self) -> tuple[TrainConfig, str | None]:
        """This config with what the driver can decide of an unset --packing, and, when it falls
        back to padded microbatches, the one line that says why. An explicit budget
        (--max-tokens-per-microbatch) asks for packing; otherwise it stays unset for the ranks
        to decide by their attention (`platform.default_packing`). Call it once the MoE
        load-balancing coefficient is resolved (`resolve_moe_aux_loss_coef`)."""
        if self.packing is not None:
            return self, None
        self.validate()  # the budget and the padded layout's rules, with the coefficient now known
        unserved = self.packing_unserved()
        if unserved is None:
            return (dataclasses.replace(self, packing=True) if self.max_tokens_per_microbatch else self), None
        return dataclasses.replace(self, packing=False), (f"packing: off for {unserved}; running padded microbatches "
                                                          f"of {self.micro_batch_size} pairs (--no-packing asks for them "
                                                          "explicitly)")

    def __post_init__(self) -> None:
        # One internal name per dtype, whichever spelling came in (bf16 and bfloat16 are one run).
        if isinstance(self.dtype, str):
            self.dtype = canonical_dtype(self.dtype)
        # A reference-free objective runs no reference: its default reference mode is none.
        if self.objective in registry.OBJECTIVES and not registry.OBJECTIVES[self.objective].reference \
                and self.ref_mode == "interleaved":
            self.ref_mode = "none"
        # The shared --loss-type default is DPO's; an objective without that type names its own.
        own_default = registry.OBJECTIVES[self.objective].default_loss_type if self.objective in registry.OBJECTIVES \
            else None
        if own_default is not None and self.loss_type == TrainConfig.loss_type:
            self.loss_type = own_default
        # --data: one source is a string, a mix a list (of two or more)
        if isinstance(self.data, (list, tuple)):
            self.data = self.data[0] if len(self.data) == 1 else list(self.data)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    def validate(self) -> None:
        for name in ("tp", "pp", "vpp", "dp", "cp", "ref_tp", "ref_pp", "ref_dp", "micro_batch_size", "global_batch_size", "max_steps",
                     "max_length"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {getattr(self, name)}")
        self._validate_packing()
        # Unset, the ranks may run padded (the local attention): the padded rule binds then too.
        if self.packing is not True and self.global_batch_size % (self.dp * self.micro_batch_size) != 0:
            raise ConfigError(
                f"global_batch_size: {self.global_batch_size} is not a multiple of dp*micro_batch_size "
                f"= {self.dp}*{self.micro_batch_size}" + ("" if self.packing is False else " (padded microbatches)"
                                                          if self.packing_unserved() else
                                                          " (padded microbatches; --packing lifts this rule)")
            )
        self._validate_expert_parallel()
        self._validate_context_parallel()
        self._validate_virtual_pipeline()
        self._validate_recompute()
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel: needs tensor parallelism (tp > 1), got tp 1")
        if self.ref_mode not in RUN_REF_MODES:
            raise ConfigError(f"ref_mode: {self.ref_mode!r} is not one of {', '.join(RUN_REF_MODES)}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ConfigError(f"lr_schedule: {self.lr_schedule!r} is not constant or cosine")
        if self.on_bad_row not in ("error", "skip"):
            raise ConfigError(f"on_bad_row: {self.on_bad_row!r} is not error or skip")
        if self.save_format not in ("safetensors", "torch_dist"):
            raise ConfigError(f"save_format: {self.save_format!r} is not safetensors or torch_dist")
        if self.save_format == "torch_dist" and self.lora:
            raise ConfigError("save_format: LoRA checkpoints are PEFT adapter files; torch_dist is for full-weight "
                              "runs (drop --save-format torch_dist)")
        if self.save_format == "torch_dist" and self.sync_ref_model:
            raise ConfigError("save_format: torch_dist does not yet store the moving reference of --sync-ref-model; "
                              "use --save-format safetensors")
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype: {self.dtype!r} is not float32, bfloat16 or float16 (or fp32, bf16, fp16)")
        for name in ("lr", "adam_eps", "timeout_s", "placement_timeout_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        for name in ("lr_warmup_steps", "weight_decay", "clip_grad", "eval_interval", "memory_interval", "save_interval",
                     "keep_last", "max_restarts", "save_interval_min"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be in [0, 1), got {getattr(self, name)}")
        self._validate_objective()
        if self.wandb_project is not None and not self.wandb:
            raise ConfigError("wandb_project: given without --wandb (Weights & Biases logging is off unless asked)")
        self._validate_trl_options()
        self._validate_lora()
        try:
            sources = [s.path for s in parse_sources(self.data)] if self.data is not None else []
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if self.data_workers is not None and self.data_workers <= 0:
            raise ConfigError(f"data_workers: must be a positive integer, got {self.data_workers}")
        if self.data_cache is not None and os.path.exists(self.data_cache) and not os.path.isdir(self.data_cache):
            raise ConfigError(f"data_cache: {self.data_cache} is a file, not a directory")
        for name, path in [("data", source) for source in sources] + [
                (name, getattr(self, name)) for name in ("model", "ref_model", "tokenizer", "eval_data", "chat_template",
                                                          "init_adapter")]:
            if path is not None and not os.path.exists(path):
                hint = hub_name_hint(path) if name in ("model", "ref_model", "tokenizer") else ""
                raise ConfigError(f"{name}: {path} does not exist{hint}")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ConfigError(f"chat_template: {self.chat_template} is not a file")

    def resolve_moe_aux_loss_coef(self, *, num_experts: int, default: float, source: str) -> float:
        """The load-balancing loss weight for a model with `num_experts` (0: dense) whose config
        says `default`; MoE layouts and combinations not supported are refused (ConfigError)."""
        if num_experts and self.tp > 1 and self.sequence_parallel is False:
            # megatron-core's MoE layer trains at tp > 1 with sequence parallelism only (it is on by default).
            raise ConfigError(f"sequence_parallel: {source} describes a mixture-of-experts model, which needs "
                              f"sequence parallelism at tp {self.tp} > 1 (drop --no-sequence-parallel)")
        coef = default if self.moe_aux_loss_coef is None else self.moe_aux_loss_coef
        if coef < 0:
            raise ConfigError(f"moe_aux_loss_coef: must be >= 0, got {coef}")
        if coef and not num_experts:
            raise ConfigError(f"moe_aux_loss_coef: {source} describes a dense model (no experts, no routers)")
        if coef and self.packing:  # unset: decide_packing falls back to padded microbatches
            raise ConfigError(f"packing: cannot serve {MOE_AUX_UNSERVED}; use --no-packing or --moe-aux-loss-coef 0")
        if coef and self.prefix_sharing:
            # The load-balancing loss counts each sequence's tokens; a shared prompt is routed once.
            raise ConfigError("prefix_sharing: cannot serve the MoE load-balancing loss (it counts the prompt's tokens "
                              "once per sequence); use --no-prefix-sharing or --moe-aux-loss-coef 0")
        return coef

    def check_moe_grouped_gemm(self, *, num_experts: int, source: str) -> None:
        """--moe-grouped-gemm needs experts: refused (ConfigError) for a dense model (`source`: its config)."""
        if self.moe_grouped_gemm and not num_experts:
            raise ConfigError(f"moe_grouped_gemm: {source} describes a dense model (no experts)")

    def _validate_expert_parallel(self) -> None:
        if self.ep <= 0:
            raise ConfigError(f"ep: must be a positive integer, got {self.ep}")
        if self.ep == 1:
            return
        # megatron-core carves the expert groups from each stage's tp x dp ranks, each expert
        # whole on its rank (expert tp 1): ep x (tp x dp / ep) x pp, so ep must divide tp x dp.
        if (self.tp * self.dp) % self.ep:
            raise ConfigError(f"ep: {self.ep} x pp {self.pp} does not fit the world of tp x pp x dp = "
                              f"{self.tp * self.pp * self.dp} ranks (ep must divide tp x dp = {self.tp * self.dp})")

    def _validate_context_parallel(self) -> None:
        if self.cp == 1:
            return
        if self.ep > 1:
            raise ConfigError(f"cp: context parallelism is for dense models; not with expert parallelism (--ep {self.ep})")

    def _validate_virtual_pipeline(self) -> None:
        """--vpp > 1: megatron-core's interleaved 1F1B takes pp >= 2 and padded microbatches in groups
        of pp (the packer cuts packed ones so: data/packing.py)."""
        if self.vpp == 1:
            return
        if self.pp < 2:
            raise ConfigError(f"vpp: --vpp {self.vpp} needs pipeline parallelism (pp >= 2), got pp {self.pp}")
        padded = self.packing is not True and self.global_batch_size % (self.dp * self.micro_batch_size) == 0
        if padded and self.num_microbatches % self.pp:  # packed: the packer cuts a multiple of pp (data/packing.py)
            raise ConfigError(f"vpp: the microbatch count per dp rank ({self.num_microbatches} = global_batch_size "
                              f"{self.global_batch_size} / (dp {self.dp} x micro_batch_size {self.micro_batch_size})) "
                              f"must be a multiple of pp ({self.pp}): megatron-core's interleaved 1F1B runs "
                              "microbatches in groups of pp")

    def check_virtual_pipeline(self, *, num_layers: int, source: str) -> None:
        """--vpp > 1 against the model (its config: `source`): every model chunk holds as many
        layers (ConfigError otherwise)."""
        if self.vpp == 1:
            return
        if num_layers % (self.pp * self.vpp):
            raise ConfigError(f"vpp: {source} has {num_layers} layers, not a multiple of pp x vpp = {self.pp} x "
                              f"{self.vpp} = {self.pp * self.vpp} (every model chunk holds as many layers)")

    def check_context_parallel(self, *, num_experts: int, multi_latent_attention: bool, family: str,
                               source: str) -> None:
        """--cp > 1 against the model (its config: `source`): dense models of the standard layer
        spec only (ConfigError otherwise)."""
        if self.cp == 1:
            return
        what = ("a mixture-of-experts model" if num_experts else "multi-latent attention" if multi_latent_attention
                else "Gemma 3 (its own attention module)" if family == "gemma3_text" else None)
        if what:
            raise ConfigError(f"cp: {source} describes {what}; context parallelism supports dense models with "
                              f"standard attention (use --cp 1)")

    def _validate_recompute(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"recompute: {self.recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}")
        if self.recompute_num_layers is None:
            return
        if self.recompute != "full":
            raise ConfigError(f"recompute_num_layers: given with --recompute {self.recompute}; it sizes the layer "
                              "groups of --recompute full")
        if self.recompute_num_layers <= 0:
            raise ConfigError(f"recompute_num_layers: must be a positive integer, got {self.recompute_num_layers}")

    def check_recompute(self, *, num_layers: int, num_experts: int, source: str) -> None:
        """--recompute against the model (its config: `source`): full recompute of a dense model
        only, and each pipeline stage's `num_layers` share split into whole groups of
        --recompute-num-layers (ConfigError otherwise)."""
        from checkpoint_convert.mapping import stage_layers

        if self.recompute != "full":
            return
        if num_experts:
            # The routers' statistics and load-balancing gradient are taken in the policy's forward,
            # which full recompute runs without gradients and then again inside the backward.
            raise ConfigError(f"recompute: full is not supported yet for mixture-of-experts models ({source}); "
                              "use --recompute selective or none")
        group = self.recompute_num_layers or 1
        for stage in range(self.pp):
            count = len(stage_layers(num_layers, pp=self.pp, pp_rank=stage))
            where = f"pipeline stage {stage}" if self.pp > 1 else "the model"
            if group > count:
                raise ConfigError(f"recompute_num_layers: {group} is more than the {count} layers of {where} "
                                  f"({source}: {num_layers} layers over pp {self.pp})")
            if count % group:
                raise ConfigError(f"recompute_num_layers: {group} does not divide the {count} layers of {where} "
                                  f"({source}: {num_layers} layers over pp {self.pp})")

    def _validate_packing(self) -> None:
        budget = self.max_tokens_per_microbatch
        if self.packing is False:
            if budget is not None:
                raise ConfigError("max_tokens_per_microbatch: given with --no-packing (it is the packed microbatches' "
                                  "budget)")
            return
        unserved = self.packing_unserved()
        if unserved is not None:
            if self.packing:
                raise ConfigError(f"packing: cannot serve {unserved}; use --no-packing")
            if budget is not None:
                raise ConfigError(f"max_tokens_per_microbatch: packing is off for {unserved}; drop the budget "
                                  "(or pass --no-packing)")
            return
        if budget is not None and budget < 2 * self.max_length:
            raise ConfigError(f"max_tokens_per_microbatch: {budget} is below 2 x max_length = {2 * self.max_length}, "
                              "the longest pair (its two sequences share a microbatch)")
        if self.global_batch_size < self.dp:
            raise ConfigError(f"global_batch_size: {self.global_batch_size} pairs cannot give each of dp {self.dp} "
                              "ranks one")

    def _validate_trl_options(self) -> None:
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ConfigError(f"ld_alpha: must be in [0, 1] (1 = plain DPO), got {self.ld_alpha}")
        if self.ref_model_sync_steps < 1:
            raise ConfigError(f"ref_model_sync_steps: must be a positive integer, got {self.ref_model_sync_steps}")
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise ConfigError(f"ref_model_mixup_alpha: must be in [0, 1], got {self.ref_model_mixup_alpha}")
        if self.sync_ref_model and self.ref_mode not in ("interleaved", "sequential"):
            why = {"none": "there is no reference", "precomputed": "precomputed log-probs would go stale",
                   "separate": "the reference lives on other ranks with another layout"}[self.ref_mode]
            raise ConfigError(f"sync_ref_model: needs --ref-mode interleaved or sequential, not {self.ref_mode} ({why})")

    @property
    def lora(self) -> bool:
        """Whether this run trains LoRA adapters (rank given or taken from --init-adapter)."""
        return self.lora_rank is not None or self.init_adapter is not None

    def _validate_objective(self) -> None:
        """--objective and the options of each objective (`registry.Entry.options`): another
        objective's option is an error, not silently unused."""
        if self.objective not in registry.OBJECTIVES:
            raise ConfigError(f"objective: unknown {self.objective!r}; choose from {', '.join(registry.OBJECTIVES)}")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        own = registry.OBJECTIVES[self.objective].options  # an option two objectives share (ref_model) is both's
        for name, entry in registry.OBJECTIVES.items():
            for option in entry.options if name != self.objective else ():
                if option not in own and getattr(self, option) != defaults[option]:
                    raise ConfigError(f"{option}: an option of --objective {name}, not of {self.objective}")
        if not registry.OBJECTIVES[self.objective].reference and self.ref_mode != "none":
            raise ConfigError(f"ref_mode: {self.objective} is reference-free (no reference model runs); "
                              f"--ref-mode {self.ref_mode} does not apply")
        if self.objective == "dpo":  # torch-free, before the slow imports of the default run
            unknown = [t for t in self.loss_type.split(",") if t.strip() not in LOSS_TYPES]
            if unknown:
                raise ConfigError(f"loss_type: unknown {unknown[0].strip()!r}; choose from {', '.join(LOSS_TYPES)}")
            spec = self.loss_spec()
        else:
            try:
                spec = registry.spec_of(self)  # imports torch: only for these objectives
            except ValueError as e:
                raise ConfigError(str(e)) from None
        try:
            spec.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _validate_lora(self) -> None:
        if self.lora_rank is not None and self.lora_rank <= 0:
            raise ConfigError(f"lora_rank: must be a positive integer, got {self.lora_rank}")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha: must be positive, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora_dropout: must be in [0, 1), got {self.lora_dropout}")
        if self.lora_targets is not None:
            from checkpoint_convert.peft_adapter import ALL_TARGETS, TARGET_ALIASES, unknown_targets

            unknown = unknown_targets(self.lora_targets)
            if unknown:
                raise ConfigError(f"lora_targets: unknown target {unknown[0]!r}; "
                                  f"choose from {', '.join(ALL_TARGETS + tuple(TARGET_ALIASES))}")
        if not self.lora:
            given = [n for n in ("lora_alpha", "lora_targets") if getattr(self, n) is not None]
            given += ["lora_dropout"] if self.lora_dropout else []
            if given:
                raise ConfigError(f"{given[0]}: needs --lora-rank or --init-adapter (LoRA is off)")
            return
        if self.sync_ref_model:
            raise ConfigError("sync_ref_model: not with LoRA (the reference is the starting adapter, it does not move)")
        if self.sequence_parallel:
            raise ConfigError("sequence_parallel: not supported with LoRA (the adapters need whole-sequence inputs)")
        if self.moe_grouped_gemm:
            raise ConfigError("moe_grouped_gemm: not with LoRA (the adapters hook each expert's own linear; LoRA runs "
                              "sequential experts, drop --moe-grouped-gemm)")
        if self.ep > 1:
            # The adapters' expert parts live on their ep ranks; the checkpoint and OUTPUT/adapter
            # writers do not gather them over ep yet.
            raise ConfigError(f"ep: LoRA with ep {self.ep} > 1 is not supported yet (its adapter files would miss "
                              "the other ep ranks' experts); use --ep 1")
        if self.ref_mode == "separate" and not self.ref_model:
            raise ConfigError("ref_mode: separate with LoRA needs --ref-model (without it the reference is the policy's "
                              "own base and adapter, on the policy's ranks)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def write_resolved(config: TrainConfig, output_dir: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "config.yaml"), "w", encoding="utf-8") as fh:
        yaml.safe_dump(config.to_dict(), fh, sort_keys=False)


def world_size(config: TrainConfig) -> int:
    """Ranks the run starts: the policy mesh, plus the reference's own with --ref-mode separate."""
    world = config.tp * config.pp * config.dp * config.cp
    if config.ref_mode == "separate":
        world += config.ref_tp * config.ref_pp * config.ref_dp
    return world


def starting_line(config: TrainConfig, *, ray_address: str | None) -> str:
    """What a run is about to do, printed before anything slow: the workers, the Ray cluster
    they will run on and what is loaded. Ray starts later, once the run's inputs and output
    directory passed their checks (`run.train` says so then)."""
    ray = f"the Ray cluster at {ray_address}" if ray_address else "a local Ray cluster"
    world = world_size(config)
    workers = f"{world} worker{'s' if world > 1 else ''} (tp {config.tp} x pp {config.pp} x dp {config.dp}"
    workers += f" x cp {config.cp}" if config.cp > 1 else ""
    workers += f", + ref tp {config.ref_tp} x pp {config.ref_pp} x dp {config.ref_dp})" if config.ref_mode == "separate" else ")"
    model = config.model or "the tiny default model"
    data = " ".join(as_list(config.data)) or ("the default preference data" if config.model is None else "no --data")
    return f"preparing {workers} on {ray}; loading {model} and {data}"
