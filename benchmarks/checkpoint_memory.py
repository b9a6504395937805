"""Memory a checkpoint save costs on each rank of a MoE run: peak RSS while
`PolicyWorker.save_checkpoint` runs against the RSS of the training steady state just before it,
at ep 1 and ep 2 (two gloo ranks each), compared with the largest single tensor a rank holds,
one kind (fp32 masters, or one Adam moment) of the rank's own state, and of the whole model.

Each (layout, repeat) is a fresh pair of rank processes: build the worker, train `--steps`
steps, then save one checkpoint (masters, both moments, RNG states). Each rank resets its peak
RSS (`/proc/self/clear_refs` = 5, VmHWM) right before the save and reads it right after. The ranks
run with glibc's mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_`, 64 KiB by default), so that a
freed tensor's pages go back to the kernel and the RSS follows the live tensors: with the default
(dynamic) threshold, a save could reuse heap the steps freed and show no extra at all.

    PYTHONPATH=$PWD python -m benchmarks.checkpoint_memory                    # 5 repeats, ~11 min on 2 shared cores
    PYTHONPATH=$PWD python -m benchmarks.checkpoint_memory --tiny --repeats 1 --layouts 2x1x2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import traceback
from pathlib import Path

import torch

from benchmarks import common

# tp x dp x ep (pp 1; world 2). ep 1: every rank holds every expert and the sharded optimizer
# gathers each kind of the state to dp rank 0, which writes the file. ep 2 at dp 2: each rank
# writes its own ep file. ep 2 at tp 2: the ep group is the tp group, so two of the four files
# get their experts from the other rank, one tensor at a time (mcore_dpo/checkpoint/expert_files.py).
LAYOUTS = ("1x2x1", "1x2x2", "2x1x2")
# Experts dominate: 4 layers x 8 experts x 3 x 256 x 512 = 12.6 M of the 13.6 M parameters.
SHAPE = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, intermediate_size=512, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2)
TINY_SHAPE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=64, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2)
_EXPERT = ".local_experts."


def write_model(directory: Path, shape: dict) -> Path:
    """A random Qwen3-MoE (every layer sparse) in HF form."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**shape, max_position_embeddings=256, tie_word_embeddings=False, decoder_sparse_step=1,
                            bos_token_id=common.BOS_ID, eos_token_id=common.EOS_ID, pad_token_id=common.PAD_ID)
    Qwen3MoeForCausalLM(config).float().save_pretrained(str(directory))
    return directory


def _reset_peak() -> None:
    """Set this process's VmHWM to its current RSS (Linux 4.0+)."""
    Path("/proc/self/clear_refs").write_text("5")


def _rank(rank: int, world: int, port: int, config: dict, steps: int, data: dict, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        from mcore_dpo.config import TrainConfig
        from mcore_dpo.model.builder import open_weights, shard_names
        from mcore_dpo.rank.worker import PolicyWorker, StepBatch

        cfg = TrainConfig(**config)
        worker = PolicyWorker(config=cfg, spec=open_weights(cfg.model).spec, pad_token_id=common.PAD_ID, rank=rank,
                              master_addr="127.0.0.1", master_port=port)
        pairs = common.make_pairs(**data)
        gbs = cfg.global_batch_size
        rss_after_step = []
        for k in range(steps):
            if k == steps - 1:
                _reset_peak()
            worker.train_step(StepBatch(step=k + 1, pairs=pairs[k * gbs:(k + 1) * gbs],
                                        next_pairs=pairs[(k + 1) * gbs:(k + 2) * gbs], pair_ids=list(range(gbs))))
            rss_after_step.append(common.current_rss_bytes())
        step_peak = common.peak_rss_bytes()
        before = common.current_rss_bytes()
        _reset_peak()
        worker.save_checkpoint(str(Path(out_dir, "checkpoint")), step=steps)
        save_peak = common.peak_rss_bytes()
        # fp32 bytes of one kind, by file name (sequential experts' `local_experts.{i}`, whatever ran)
        own = {n: p.numel() * 4 for n, p in shard_names(dict(worker.policy.module.named_parameters())).items()}
        result = {
            "coordinates": worker.coordinates(),
            "rss_after_step_bytes": rss_after_step,
            "last_step_peak_rss_bytes": step_peak,
            "rss_before_save_bytes": before,
            "save_peak_rss_bytes": save_peak,
            "save_extra_bytes": save_peak - before,
            "rss_after_save_bytes": common.current_rss_bytes(),
            "largest_tensor_bytes": max(own.values()),
            "own_kind_bytes": sum(own.values()),
            "own_expert_bytes": sum(b for n, b in own.items() if _EXPERT in n),
            "optimizer_state_bytes": worker.optimizer.state_bytes(),
            "loadavg_1min": os.getloadavg()[0],
        }
        worker.shutdown()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def measure(model: Path, *, layout: str, steps: int, seq_len: int, mmap_threshold: int, out_dir: Path) -> list[dict]:
    """One fresh pair of ranks at `layout` (tp x dp x ep): per rank, its figures."""
    tp, dp, ep = (int(x) for x in layout.split("x"))
    gbs = 4
    config = dict(model=str(model), ref_model=str(model), tp=tp, dp=dp, ep=ep, micro_batch_size=1,
                  global_batch_size=gbs, max_steps=steps, max_length=seq_len, ref_mode="interleaved",
                  distributed_optimizer=True, export_hf=False, save_interval=0, save_interval_min=0, timeout_s=600.0,
                  packing=False)
    data = dict(num_pairs=gbs * (steps + 1), prompt_len=seq_len // 2, completion_len=seq_len // 2,
                vocab_size=json.loads((model / "config.json").read_text())["vocab_size"], seed=1)
    if mmap_threshold:  # read by glibc at the ranks' start; spawned processes inherit it
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    try:
        port = common.free_port()
        return common.spawn_ranks(_rank, lambda r: (r, 2, port, config, steps, data, str(out_dir)), world_size=2,
                                  out_dir=out_dir, timeout_s=1200)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)


def run(*, shape: dict, layouts: list[str], repeats: int, steps: int, seq_len: int, mmap_threshold: int,
        work_dir: Path) -> dict:
    model = write_model(work_dir / "model", shape)
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as handle:  # the whole model, fp32
        model_kind_bytes = sum(4 * math.prod(handle.get_slice(n).get_shape()) for n in handle.keys())
    samples: dict[str, list[list[dict]]] = {layout: [] for layout in layouts}
    for repeat in range(repeats):
        for layout in layouts:  # alternate the layouts so that load changes hit all alike
            samples[layout].append(measure(model, layout=layout, steps=steps, seq_len=seq_len,
                                           mmap_threshold=mmap_threshold, out_dir=work_dir / f"{layout}_{repeat}"))
    out = {"shape": shape, "steps": steps, "seq_len": seq_len, "repeats": repeats, "mmap_threshold": mmap_threshold,
           "model_kind_bytes": model_kind_bytes}
    out["layouts"] = {layout: summarize(runs, model_kind_bytes=model_kind_bytes) for layout, runs in samples.items()}
    return out


def summarize(runs: list[list[dict]], *, model_kind_bytes: int) -> dict:
    """Per rank of one layout: medians over the runs, the rank's fixed sizes, and the extra a
    save costs against them. `own_dense_bytes`: one kind of the rank's tensors other than
    experts (what the sharded optimizer rebuilds whole when its dp group shards them)."""
    ranks = {}
    for r in range(len(runs[0])):
        rows = [run_[r] for run_ in runs]
        fixed = rows[0]
        entry = {key: common.summary([row[key] for row in rows])
                 for key in ("rss_before_save_bytes", "last_step_peak_rss_bytes", "save_peak_rss_bytes",
                             "save_extra_bytes", "loadavg_1min")}
        entry.update({key: fixed[key] for key in ("coordinates", "largest_tensor_bytes", "own_kind_bytes",
                                                  "own_expert_bytes", "optimizer_state_bytes")})
        entry["own_dense_bytes"] = fixed["own_kind_bytes"] - fixed["own_expert_bytes"]
        extra = entry["save_extra_bytes"]["median"]
        entry["extra_over_largest_tensor"] = extra / fixed["largest_tensor_bytes"]
        entry["extra_over_own_dense_plus_largest"] = extra / (entry["own_dense_bytes"] + fixed["largest_tensor_bytes"])
        entry["extra_over_own_kind"] = extra / fixed["own_kind_bytes"]
        entry["extra_over_model_kind"] = extra / model_kind_bytes
        entry["samples"] = rows
        ranks[str(r)] = entry
    return ranks


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mcore_dpo_bench/checkpoint_memory.json")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="tp x dp x ep, comma-separated (world 2 each)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--mmap-threshold", type=int, default=65536,
                        help="MALLOC_MMAP_THRESHOLD_ of the ranks; 0 leaves glibc's dynamic default")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mcore_dpo_checkpoint_memory_"))
    result = run(shape=TINY_SHAPE if args.tiny else SHAPE, layouts=args.layouts.split(","), repeats=args.repeats,
                 steps=args.steps, seq_len=16 if args.tiny else args.seq_len, mmap_threshold=args.mmap_threshold,
                 work_dir=work)
    result["machine"] = common.machine()
    mib = 1 / 2**20
    print(f"model: {result['model_kind_bytes'] * mib:.1f} MiB per kind (fp32)")
    for layout, ranks in result["layouts"].items():
        for rank, row in ranks.items():
            rss = {k: common.fmt(row[k], digits=1, scale=mib)
                   for k in ("rss_before_save_bytes", "save_peak_rss_bytes", "save_extra_bytes")}
            print(f"tp x dp x ep {layout} rank {rank}: before save {rss['rss_before_save_bytes']} MiB, save peak "
                  f"{rss['save_peak_rss_bytes']} MiB, extra {rss['save_extra_bytes']} MiB = "
                  f"{row['extra_over_largest_tensor']:.2f} x largest tensor ({row['largest_tensor_bytes'] * mib:.2f} MiB), "
                  f"{row['extra_over_own_dense_plus_largest']:.2f} x own dense + largest tensor "
                  f"({(row['own_dense_bytes'] + row['largest_tensor_bytes']) * mib:.1f} MiB), "
                  f"{row['extra_over_own_kind']:.3f} x own kind ({row['own_kind_bytes'] * mib:.1f} MiB), "
                  f"{row['extra_over_model_kind']:.3f} x model kind")
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
