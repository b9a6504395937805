"""Every device decision lives here: CUDA + NCCL when a GPU is present, CPU + gloo otherwise.

This is also the only module that adapts megatron-core to a CPU-only machine. Nothing
else in the project names a device or patches megatron-core.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    device: torch.device
    backend: str  # torch.distributed backend: "nccl" or "gloo"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


_ADAPTED = False


def detect(*, local_rank: int = 0) -> Platform:
    """The device this process computes on and the matching process-group backend."""
    # MCORE_DPO_FORCE_CPU is read first: a process told to stay on the CPU (the CPU test suite
    # on a GPU machine, verify) never asks the CUDA driver anything, so it can run forked from a
    # parent that initialised CUDA.
    if os.environ.get("MCORE_DPO_FORCE_CPU") != "1" and torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        return Platform(device=torch.device("cuda", index), backend="nccl")
    return Platform(device=torch.device("cpu"), backend="gloo")


def fused_adamw(device: torch.device) -> bool:
    """Whether the optimizer runs torch's fused AdamW: on a GPU, one kernel over all parameters
    with no temporaries (the multi-tensor implementation allocates about 4 B per parameter of
    the shard for the step). On the CPU, torch's default AdamW, which the parity tests compare
    bit for bit with a one-process torch AdamW."""
    return device.type == "cuda"


def fused_kernel_fields(*, requested: bool | None, use_te: bool, on_gpu: bool, moe: bool) -> dict[str, bool]:
    """megatron-core TransformerConfig fields of the fused kernels: on (unless --no-fused-kernels)
    where the rank builds the Transformer Engine spec on a GPU, which provides them (fused RoPE
    also keeps THD rows free of the unfused path's per-sequence host syncs; weight gradients
    accumulate straight into DDP's fp32 main_grad where apex's extension is built); off on the
    CPU and the local spec, where the unfused code is what the parity tests check."""
    on = requested is not False and use_te and on_gpu
    # megatron-core's own linears (the output layer, also on the TE spec) refuse this fusion
    # without apex's fused_weight_gradient_mlp_cuda extension.
    wgrad_fusion = on and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    # Unfused, megatron-core's THD RoPE loops over a packed row's sequences in Python and reads
    # their lengths off the device (`.tolist()`) in every layer: a host sync per layer.
    rope_fusion = on and _te_rope_kernels()
    fields = {"bias_activation_fusion": on, "bias_dropout_fusion": on, "apply_rope_fusion": rope_fusion,
              "gradient_accumulation_fusion": wgrad_fusion, "masked_softmax_fusion": False,
              "persist_layer_norm": False}
    if moe:
        fields["moe_permute_fusion"] = on
    return fields


def deterministic_settings() -> dict[str, str]:
    """Environment for --deterministic, read when CUDA, cuBLAS and Transformer Engine start:
    cuBLAS with a fixed workspace (required by torch's deterministic mode), Transformer Engine's
    attention without its nondeterministic (atomic) backward."""
    return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


def make_deterministic(enabled: bool) -> None:
    """--deterministic: call before the platform is activated (the settings are read when CUDA
    starts). torch's deterministic algorithms include `index_add` on CUDA, the packed rows'
    segment sums (logprobs.segment_sums), which otherwise accumulate atomically."""
    if not enabled:
        return
    for name, value in deterministic_settings().items():
        os.environ[name] = value
    torch.use_deterministic_algorithms(True)


def activate(platform: Platform) -> None:
    """Make the platform current for this process (and adapt megatron-core on the CPU)."""
    if platform.is_cuda:
        torch.cuda.set_device(platform.device)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        _adapt_megatron_for_cpu()
    _adapt_megatron_without_te()


class _HostStream:
    """Stands in for the current CUDA stream on the CPU, where work runs in program order:
    waiting on an event or another stream has nothing to wait for."""

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: object = None) -> "_HostStream":
        return self  # an event that is already complete: synchronize() returns at once


_HOST_STREAM = _HostStream()


def _adapt_megatron_for_cpu() -> None:
    """megatron-core's model path asks torch.cuda for the current device in many places
    (buffers, RNG, masks). Without a GPU those calls point at the CPU instead.

    Since 0.19, DDP's gradient sync also takes `torch.cuda.current_stream()` on every call (to
    wait for CUDA-graph gradient events, which the CPU never records); a host stand-in whose
    waits do nothing serves it, and every other release alike.

    The MoE all-to-all token dispatcher creates a side stream (`torch.cuda.Stream()`) for its
    device-to-host copies of the split sizes and enters it with `torch.cuda.stream`; on the
    CPU the copies run in program order, so the host stream stands in for it too."""
    global _ADAPTED
    if _ADAPTED:
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM  # type: ignore[assignment]
    torch.cuda.Stream = lambda *args, **kwargs: _HOST_STREAM  # type: ignore[assignment,misc]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    _import_megatron_without_compile()
    _adapt_moe_dispatcher_for_cpu()
    _adapt_recompute_rng_for_cpu()
    _ADAPTED = True


def _import_megatron_without_compile() -> None:
    """megatron-core wraps its fused elementwise functions in `torch.compile` as its modules load
    (`megatron.core.jit.jit_fuser`), and the first `torch.compile` call imports TorchInductor:
    seconds of CPU in every rank process, for functions the CPU path never calls (the model
    config turns every fusion off). On the CPU, megatron-core is imported with `torch.compile`
    handing each function back as it is, and its own switch then keeps the modules it loads
    later uncompiled too (`disable_jit_fuser`). A process that imported megatron-core before
    keeps it as it was."""
    import sys

    if "megatron.core.jit" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = _uncompiled  # type: ignore[assignment]
    try:
        from megatron.core import jit
    finally:
        torch.compile = compile_  # type: ignore[assignment]
    jit.disable_jit_fuser()


def _uncompiled(model=None, **_options):
    """`torch.compile` that compiles nothing: the function itself, or (called with options
    only) a decorator that returns it."""
    return model if model is not None else (lambda fn: fn)


def _adapt_moe_dispatcher_for_cpu() -> None:
    """The all-to-all dispatcher turns its split sizes into numpy arrays only when it copies them
    off a GPU (`maybe_move_tensor_to_cpu`); gloo's all_to_all_single wants sequences, not CPU
    tensors. On the CPU the same conversion applies to tensors already there."""
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu


def _adapt_recompute_rng_for_cpu() -> None:
    """megatron-core's activation recompute (`tensor_parallel.checkpoint`, --recompute) stores the
    CPU generator's state, the CUDA generator's and its RNG tracker's with each checkpointed part
    and sets them back before that part reruns in the backward. Without a GPU there is no CUDA
    generator to read or set: the CPU generator, stored beside it, is the only one a CPU forward
    draws from, so the CUDA state is stood in for by None and setting it does nothing."""
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: None
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None


def _adapt_megatron_without_te() -> None:
    """megatron-core 0.16's MoE router asks `te_general_gemm is not None`, but the name only
    exists when Transformer Engine imported: without it, define it as None so the router
    takes its plain torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@contextlib.contextmanager
def building_models(platform: Platform):
    """Context for megatron-core model construction. On the CPU, `Tensor.cuda()` (used when
    tied embeddings are synchronised across pipeline stages) keeps the tensor where it is."""
    if platform.is_cuda:
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[assignment]


@contextlib.contextmanager
def saving_dist_checkpoint(platform: Platform, *, directory: str | os.PathLike | None = None):
    """Context for megatron-core `dist_checkpointing.save` into `directory`. On the CPU its
    torch_dist writer calls `torch.cuda.synchronize()`, which has nothing to wait for: make it a
    no-op there (`torch.cuda.current_device` already points at the CPU, see `activate`). Loading
    needs no adaptation, as long as the fully parallel load wrapper (it calls `.cuda()`) is not used.

    megatron-core 0.19 stopped writing the common (non-tensor) state to `common.pt` and keeps it
    as an object inside the .distcp files. Every megatron-core release and Megatron-LM read
    `common.pt` when it is there; releases before 0.19 read only that file (this project's
    restricted reader, checkpoint_convert.torch_dist, reads either). With `directory` given,
    rank 0 writes it after the save when the release did not: the same dict, the file the older
    releases write, so a checkpoint written under 0.19 also loads with them."""
    original = torch.cuda.synchronize
    if not platform.is_cuda:
        torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.synchronize = original  # type: ignore[assignment]
    if directory is not None:
        _write_common_pt(directory)


def _write_common_pt(directory: str | os.PathLike) -> None:
    """Collective: the common state of the torch_dist checkpoint just saved in `directory`, as
    `common.pt` (rank 0 writes; nothing when the release wrote it)."""
    from megatron.core import dist_checkpointing

    path = os.path.join(directory, "common.pt")
    if torch.distributed.get_rank() == 0 and not os.path.exists(path):
        common = dist_checkpointing.load_common_state_dict(str(directory))  # weights_only load
        torch.save(common, path)
    torch.distributed.barrier()


def init_model_rng(platform: Platform, seed: int) -> None:
    """Seed torch and megatron-core's tensor-parallel RNG tracker.

    On the CPU the CUDA RNG tracker cannot fork CUDA generators; the inference tracker's
    fork() is a no-op, which is exact here because DPO runs with dropout off.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if platform.is_cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


GPU_TIMEOUT_S = 1800.0  # NCCL: a 70B model's first step (loading, lazy connections) fits
CPU_TIMEOUT_S = 300.0  # gloo: small runs, where a dead peer should end the run in minutes


def default_timeout_s(platform: Platform) -> float:
    """The collectives' timeout when --timeout-s is not given."""
    return GPU_TIMEOUT_S if platform.is_cuda else CPU_TIMEOUT_S


def nccl_error_settings() -> dict[str, str]:
    """NCCL settings under which a failed or stuck peer surfaces as an error the rank raises
    (naming the transfer and the peer, pipeline.PeerError) rather than the watchdog killing the
    process: on a timeout or error the watchdog aborts the communicators and leaves the process
    alive (2 = clean up only), so the rank's next wait raises. Set where the user has not."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


# Joining the world: ranks start seconds apart (each imports megatron-core, several to a loaded
# node), so the rendezvous waits this long for all of them whatever the collectives' timeout.
JOIN_TIMEOUT_S = 300.0


def init_process_group(
    platform: Platform, *, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float
) -> None:
    """Join the group's torch.distributed world (a TCP store at master_addr:master_port, rank 0
    serving it). Joining waits up to max(timeout_s, JOIN_TIMEOUT_S) for every rank to arrive;
    once all have, the store's waits and the collectives time out after timeout_s (a short
    --timeout-s bounds a stuck peer, not a rank that started late)."""
    kwargs = {}
    if platform.is_cuda:
        kwargs["device_id"] = platform.device
        for name, value in nccl_error_settings().items():  # read when the NCCL group is created
            os.environ.setdefault(name, value)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(
        master_addr, master_port, world_size, is_master=rank == 0, wait_for_workers=True, multi_tenant=True,
        timeout=datetime.timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S)),
    )  # fmt: skip
    store.set_timeout(timeout)
    torch.distributed.init_process_group(
        backend=platform.backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs
    )


def synchronize(platform: Platform) -> None:
    """Wait for queued device work (for honest step timings)."""
    if platform.is_cuda:
        torch.cuda.synchronize(platform.device)


class IntervalClock:
    """Adds up the time between each start() and the next stop().

    On the CPU: host time (perf_counter). On a GPU: CUDA events recorded on the current
    stream, so an interval is what the device spent there, e.g. the compute stream waiting
    for a NCCL transfer that the host only queued. The events are read once, in total_s(),
    after the step's work is done (no host sync per interval).
    """

    def __init__(self, platform: Platform):
        self._cuda = platform.is_cuda
        self._host_s = 0.0
        self._start: float | torch.cuda.Event | None = None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _now(self) -> float | torch.cuda.Event:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> None:
        if self._start is None:
            raise RuntimeError("IntervalClock.stop() without start()")
        end = self._now()
        if self._cuda:
            self._events.append((self._start, end))
        else:
            self._host_s += end - self._start
        self._start = None

    def total_s(self) -> float:
        """Seconds in all closed intervals (on a GPU: waits for the last recorded event)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._host_s += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
            self._events.clear()
        return self._host_s


def max_memory_bytes(platform: Platform) -> int:
    """Peak memory of this process: allocator peak on a GPU, peak RSS (VmHWM) on the CPU.
    (ru_maxrss is not used: Linux carries it over fork+exec from the parent.)"""
    if platform.is_cuda:
        return int(torch.cuda.max_memory_allocated(platform.device))
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def use_sequence_parallel(platform: Platform, *, requested: bool | None, tp: int) -> bool:
    """Sequence parallelism for a group of tensor-parallel size `tp`: as asked, or by default
    (None) on GPUs whenever tp > 1 (it divides the activations outside the tp linears by tp).
    On the CPU it stays off unless asked: its gathers cost more there than the memory it saves."""
    if tp <= 1:
        return False
    return platform.is_cuda if requested is None else requested


def default_packing(*, thd_attention: bool) -> bool:
    """Packing when --packing is unset and the run's modes allow it: on where packed rows run in
    Transformer Engine's THD layout (each sequence's own causal triangle: no more attention than
    the padded rows it replaces), off on the local attention, which computes a packed row's whole
    W x W score matrix: on the CPU the default job's steps took 4-5x longer packed than padded
    (docs/PACKING.md)."""
    return thd_attention


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports (it needs CUDA)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def _te_rope_kernels() -> bool:
    """megatron-core found both of Transformer Engine's fused RoPE kernels (padded rows and the
    packed THD layout)."""
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.fused_apply_rotary_pos_emb is not None and rope_utils.fused_apply_rotary_pos_emb_thd is not None


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without blocking the host: on a GPU, copied from pinned memory
    with `non_blocking` (a copy from pageable memory waits for the GPU); already there (the
    CPU), the tensor itself."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def te_grouped_linear_available() -> bool:
    """True when megatron-core has its Transformer Engine grouped linear, which its grouped GEMM
    experts (TEGroupedMLP) are made of: Transformer Engine imports and is 1.9 or newer."""
    if not transformer_engine_available():
        return False
    try:
        from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear
    except Exception:
        return False
    return TEColumnParallelGroupedLinear is not None


def use_grouped_experts(*, requested: bool | None, num_experts: int, use_te: bool,
                        grouped_linear: bool) -> tuple[bool, str | None]:
    """Whether a MoE model's experts run as grouped GEMMs (megatron-core's TEGroupedMLP), and a
    one-line note when they were expected to but cannot. `requested`: --moe-grouped-gemm (True),
    --no-moe-grouped-gemm (False) or unset (None: on wherever the Transformer Engine spec runs);
    `use_te`: the rank builds the Transformer Engine spec; `grouped_linear`:
    `te_grouped_linear_available()`. Without Transformer Engine (the CPU, LoRA runs) the experts
    are sequential, as megatron-core's local grouped experts (legacy GroupedMLP) are bf16-only
    and keep their weights in another layout."""
    if not num_experts or requested is False:
        return False, None
    if use_te and grouped_linear:
        return True, None
    if use_te:
        return False, ("moe_grouped_gemm: this Transformer Engine has no grouped linear (megatron-core's grouped "
                       "experts need Transformer Engine >= 1.9); running sequential experts")
    if requested:
        return False, ("moe_grouped_gemm: Transformer Engine is not importable on the ranks (grouped GEMM needs "
                       "it and a GPU); running sequential experts")
    return False, None


# megatron-core's (and torch's) warnings that say nothing a user of this project can act on.
# Each is (name, category, message pattern, why it is harmless). Every other warning still shows.
KNOWN_HARMLESS_WARNINGS: tuple[tuple[str, type[Warning], str, str], ...] = (
    ("cpu-device-max-connections", UserWarning, r"When using async grad allreduce it is recommended to set the "
     r"environment variable CUDA_DEVICE_MAX_CONNECTIONS",
     "on the CPU there are no CUDA connections to order (filtered only where no GPU is visible; on a "
     "GPU it is a real hint about overlapping the tensor-parallel all-reduce)"),
    ("no-transformer-engine-or-apex", UserWarning, r"Transformer Engine and Apex are not installed",
     "megatron-core's optimizer and FSDP modules fall back to torch's multi-tensor ops, which this "
     "project's optimizer does not use; `python -m mcore_dpo.doctor` reports a missing Transformer "
     "Engine or apex once, and neither exists for a CPU"),
    ("no-apex-norm", UserWarning, r"Apex is not installed\. Falling back to Torch Norm",
     "the local layer spec's RMSNorm is torch's, the norm this project's parity tests check"),
    ("cuda-graph-full-scope", UserWarning, r"full scope is deprecated",
     "megatron-core's own default cuda_graph_scope ('full') warns in every TransformerConfig; "
     "this project captures no CUDA graphs"),
    ("c10d-tensor-collective-rename", FutureWarning,
     r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
     "torch 2.13 renamed the two collectives (reduce_scatter_single, all_gather_single); the old "
     "names still run the same collective, and megatron-core 0.16-0.19 call them"),
)


def skip_unused_imports() -> None:
    """In a rank process, before megatron-core is imported: make `import wandb` fail as if W&B
    were not installed. megatron-core imports it where it is installed (for its inference
    contexts, which tolerate its absence), about 0.7 s of a core in every rank process at start;
    the ranks never log to W&B (the driver does, driver/metrics_log.py). Never in the driver."""
    import sys

    sys.modules.setdefault("wandb", None)


def quiet_known_warnings() -> None:
    """Ignore the warnings in KNOWN_HARMLESS_WARNINGS in this process. Call it before
    megatron-core is imported: most of them are raised at import time."""
    import warnings

    for name, category, pattern, _why in KNOWN_HARMLESS_WARNINGS:
        if name.startswith("cpu-") and torch.cuda.is_available():
            continue
        warnings.filterwarnings("ignore", message=pattern, category=category)
