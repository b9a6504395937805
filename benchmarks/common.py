"""Shared pieces of the benchmarks: random Llama checkpoints written straight to disk,
fixed-length preference pairs, a launcher that runs `PolicyWorker` ranks as plain spawned
processes (no Ray), and the median / min-max summary every figure uses.

Nothing here downloads anything; models are random and built locally.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from checkpoint_convert.families import spec_from_hf_config  # noqa: E402
from checkpoint_convert.mapping import hf_tensor_shapes  # noqa: E402
from mcore_dpo.data.pairs import TokenizedPair  # noqa: E402
from mcore_dpo.parallel.ports import free_port  # noqa: E402

BOS_ID, EOS_ID, PAD_ID = 1, 2, 0
FIRST_WORD_ID = 3  # ids below are special tokens


# ----------------------------------------------------------------------------- models
@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False

    def hf_config(self, *, dtype: str) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.hidden_size // self.num_heads,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
            "dtype": dtype,
        }


# Shapes several benchmarks share. SMALL: the hidden-512 model of benchmarks 1 (its
# "last-heavy" split), 3 and 4, where compute dominates the Python and p2p overhead and a
# step takes ~1-2 s. TINY: the smoke-test size.
SMALL_SHAPE = LlamaShape(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1408,
                         vocab_size=4096)
TINY_SHAPE = LlamaShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                        vocab_size=256)


def write_random_llama(
    directory: Path, *, shape: LlamaShape, dtype: str = "float32", seed: int = 0, device: str = "cpu"
) -> Path:
    """Write config.json + model.safetensors with random weights (std 0.02, norms 1).

    Tensors are generated one at a time straight into HF names, so a 1 GB model is written
    in seconds without instantiating a transformers model. Reuses the directory when its
    config already matches.
    """
    from safetensors.torch import save_file

    config = shape.hf_config(dtype=dtype)
    config_path = directory / "config.json"
    weights_path = directory / "model.safetensors"
    if config_path.exists() and weights_path.exists() and json.loads(config_path.read_text()) == config:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    spec = spec_from_hf_config(config, source=str(config_path))
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, size in hf_tensor_shapes(spec).items():
        if len(size) == 1:
            tensors[name] = torch.ones(size, dtype=torch_dtype)
        else:
            value = torch.randn(size, generator=gen, device=device, dtype=torch.float32) * 0.02
            tensors[name] = value.to(torch_dtype).cpu()
    tmp_path = directory / "model.safetensors.tmp"
    save_file(tensors, str(tmp_path), metadata={"format": "pt"})
    os.replace(tmp_path, weights_path)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return directory


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- data
def make_pairs(
    num_pairs: int, *, prompt_len: int, completion_len: int, vocab_size: int, seed: int
) -> list[TokenizedPair]:
    """Pairs of one fixed length (prompt_len + completion_len tokens each side): no padding,
    so every engine processes exactly the same tokens."""
    gen = torch.Generator().manual_seed(seed)

    def words(n: int) -> tuple[int, ...]:
        return tuple(int(x) for x in torch.randint(FIRST_WORD_ID, vocab_size, (n,), generator=gen))

    return [
        TokenizedPair(
            prompt_ids=(BOS_ID,) + words(prompt_len - 1),
            chosen_ids=words(completion_len - 1) + (EOS_ID,),
            rejected_ids=words(completion_len - 1) + (EOS_ID,),
            source_line=i + 1,
        )
        for i in range(num_pairs)
    ]


def pair_tokens(pairs) -> int:
    """Tokens of a batch as the engine counts them for tokens/s: prompt twice + both completions."""
    return sum(len(p.prompt_ids) * 2 + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)


# ----------------------------------------------------------------------------- statistics
def summary(values: list[float]) -> dict:
    """Median with min and max (and the samples, for the record)."""
    if not values:
        raise ValueError("summary of no samples")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "samples": list(values)}


def fmt(stat: dict, *, digits: int = 3, scale: float = 1.0) -> str:
    """`median (min-max)` for a markdown table."""
    return f"{stat['median'] * scale:.{digits}f} ({stat['min'] * scale:.{digits}f}-{stat['max'] * scale:.{digits}f})"


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far: VmHWM of /proc/self/status.

    Not `getrusage().ru_maxrss`: Linux carries that high-water mark over fork + exec, so a
    fresh child would start at its parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # non-Linux fallback


def current_rss_bytes() -> int:
    """Resident set size of this process now (VmRSS of /proc/self/status; 0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def machine() -> dict:
    info = {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_total_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def write_json(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


# ----------------------------------------------------------------------------- rank launcher
@dataclass(frozen=True)
class RankJob:
    """One engine configuration to run in every rank process, one after another."""

    name: str
    config: dict  # TrainConfig fields
    num_steps: int  # measured steps come after `warmup_steps`
    warmup_steps: int = 1
    precompute_pairs: int = 0  # ref_mode precomputed: the data set size of the one-off pass
    trace: bool = False  # record every measured step's op timeline on every rank


def _rank_main(rank: int, world_size: int, ports: list[int], jobs: list[dict], data: dict, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        from mcore_dpo.config import TrainConfig
        from mcore_dpo.model.builder import open_weights
        from mcore_dpo.rank.worker import PolicyWorker, StepBatch

        baseline_rss = peak_rss_bytes()  # interpreter + torch + megatron-core imports
        results = []
        for job, port in zip(jobs, ports):  # worker.shutdown() ends the process group: fresh port each
            config = TrainConfig(**job["config"])
            spec = open_weights(config.model).spec
            worker = PolicyWorker(config=config, spec=spec, pad_token_id=PAD_ID, rank=rank,
                                  master_addr="127.0.0.1", master_port=port)
            ref_bytes = 0
            if worker.reference.model is not None:
                ref_bytes = sum(p.numel() * p.element_size() for p in worker.reference.model.parameters())
            pairs = make_pairs(**data)
            gbs = config.global_batch_size
            num_batches = job["warmup_steps"] + job["num_steps"] + 1  # +1: the last step also has a next batch
            batches = [[(k * gbs + i) % len(pairs) for i in range(gbs)] for k in range(num_batches)]
            precompute_s = None
            if config.ref_mode == "precomputed":
                start = time.perf_counter()
                worker.precompute_reference(pairs[: job["precompute_pairs"]])
                precompute_s = time.perf_counter() - start
            worker.trace_ops = job["trace"]
            step_times, tokens, traces, bubbles, cpu_times = [], [], [], [], []
            for k in range(num_batches - 1):
                cpu_start = time.process_time()
                metrics = worker.train_step(StepBatch(
                    step=k + 1,
                    pairs=[pairs[i] for i in batches[k]],
                    next_pairs=[pairs[i] for i in batches[k + 1]],
                    pair_ids=batches[k],
                ))  # fmt: skip
                if k >= job["warmup_steps"]:  # this process's CPU seconds: not inflated by waiting or preemption
                    cpu_times.append(time.process_time() - cpu_start)
                if job["trace"] and k >= job["warmup_steps"]:
                    traces.append(worker.last_trace)
                if metrics is not None and k >= job["warmup_steps"]:
                    step_times.append(metrics["step_time_s"])
                    bubbles.append(metrics["bubble_fraction"])  # blocked in transfers / step, mean over ranks
                    tokens.append(pair_tokens([pairs[i] for i in batches[k]]))
            results.append({
                "name": job["name"],
                "coordinates": worker.coordinates(),
                "reports": bool(step_times),
                "step_time_s": step_times,
                "bubble_fraction": bubbles,
                "cpu_s": cpu_times,
                "tokens_per_step": tokens,
                "ref_param_bytes": ref_bytes,
                "optimizer_state_bytes": worker.optimizer.state_bytes(),  # fp32 master copies + moments
                "precompute_s": precompute_s,
                "baseline_rss_bytes": baseline_rss,
                "peak_rss_bytes": peak_rss_bytes(),
                "loadavg_1min_after": os.getloadavg()[0],  # the box may be shared: record contention
                "traces": traces,
            })  # fmt: skip
            worker.shutdown()
            del worker
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(*, world_size: int, jobs: list[RankJob], data: dict, out_dir: Path, timeout_s: float = 1800) -> list[list[dict]]:
    """Spawn `world_size` gloo rank processes that run `jobs` in order; returns, per rank, one
    result dict per job. Peak RSS is per process, so jobs that compare memory must each get
    their own call."""
    ports: list[int] = []
    while len(ports) < len(jobs):
        port = free_port()
        if port not in ports:
            ports.append(port)
    job_dicts = [asdict(j) for j in jobs]
    return spawn_ranks(_rank_main, lambda r: (r, world_size, ports, job_dicts, data, str(out_dir)),
                       world_size=world_size, out_dir=out_dir, timeout_s=timeout_s)


def spawn_ranks(target, args_of, *, world_size: int, out_dir: Path, timeout_s: float = 1800) -> list:
    """Run `target(*args_of(rank))` in `world_size` spawned processes. Each writes
    `out_dir/rank{r}.json` (its result) or `out_dir/error_rank{r}.txt` (its traceback); returns
    the results by rank, or raises with the first error's last line. A failed rank leaves its
    peers blocked in a collective, so they are polled and killed rather than joined."""
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks before torch loads
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in list(out_dir.glob("rank*.json")) + list(out_dir.glob("error_rank*.txt")):
        stale.unlink()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(r)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(out_dir.glob("error_rank*.txt")):
            time.sleep(1.0)  # let the failing rank finish writing
            break
        time.sleep(0.2)
    errors = sorted(out_dir.glob("error_rank*.txt"))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    if errors:
        raise RuntimeError(f"rank failed: {errors[0].read_text().strip().splitlines()[-1]}")
    if alive or any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"rank processes did not finish cleanly: exit codes {[p.exitcode for p in procs]}")
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]


def reporting(results: list[list[dict]], job_index: int) -> dict:
    """The result of the rank that reported metrics (tp 0 of the last stage, dp 0)."""
    found = [rank[job_index] for rank in results if rank[job_index]["reports"]]
    return found[0]


def pooled(results: list[list[dict]], name: str) -> dict:
    """Step times, tokens and load of every job called `name` (one per round), pooled."""
    out: dict = {"step_time_s": [], "tokens_per_step": [], "loadavg_1min_after": [], "precompute_s": []}
    for index, job in enumerate(results[0]):
        if job["name"] != name:
            continue
        rep = reporting(results, index)
        for key in ("step_time_s", "tokens_per_step"):
            out[key].extend(rep[key])
        out["loadavg_1min_after"].append(rep["loadavg_1min_after"])
        if rep["precompute_s"] is not None:
            out["precompute_s"].append(rep["precompute_s"])
    return out


def run_python(code: str, *, env_extra: dict | None = None, timeout_s: float = 1800) -> dict:
    """Run `code` in a fresh interpreter; it must print one JSON object as its last line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), **(env_extra or {}))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout_s)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise RuntimeError(f"subprocess failed with {done.returncode}: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])
