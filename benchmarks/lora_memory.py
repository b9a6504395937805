"""Benchmark 7: peak memory per rank and step time of LoRA DPO against full DPO.

Same layout and model for both (benchmark 1's hidden-512 model, tp 1, pp 2, fp32, the
reference interleaved): full DPO keeps a policy, a frozen reference copy, fp32 gradient buffers
and AdamW moments for every weight; LoRA DPO keeps the frozen base once, and gradients and AdamW
state for the adapters only (rank 16 on qkv, proj, fc1, fc2), its reference being the same
module with the adapters off. Each (mode, repeat) is a fresh pair of rank processes running one
warm-up and three measured steps; every rank reads its peak RSS (VmHWM) at the end, minus its RSS
right after the imports (the interpreter, torch, megatron-core: the same in both modes).

    python benchmarks/lora_memory.py                 # 3 repeats x 2 modes
    python benchmarks/lora_memory.py --tiny --repeats 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

GOAL_RATIO = 0.55
LORA = dict(lora_rank=16, lora_alpha=32.0, lora_targets="qkv,proj,fc1,fc2")


def run(*, shape: common.LlamaShape, repeats: int, seq_len: int, num_microbatches: int, work_dir: Path,
        steps: int = 3) -> dict:
    model_dir = common.write_random_llama(work_dir / "model", shape=shape)
    gbs = num_microbatches  # microbatches of one pair
    prompt_len = seq_len // 4
    data = dict(num_pairs=gbs * 5, prompt_len=prompt_len, completion_len=seq_len - prompt_len,
                vocab_size=shape.vocab_size, seed=3)
    samples: dict[str, dict[int, dict[str, list[float]]]] = {"full": {}, "lora": {}}
    step_times: dict[str, list[float]] = {"full": [], "lora": []}
    for repeat in range(repeats):
        for mode in ("full", "lora"):  # alternate so that slow drift hits both alike
            config = dict(model=str(model_dir), tp=1, pp=2, dp=1, micro_batch_size=1, global_batch_size=gbs,
                          max_steps=steps + 1, max_length=seq_len, ref_mode="interleaved", lr=1e-5, packing=False,
                          **(LORA if mode == "lora" else {}))
            job = common.RankJob(name=mode, config=config, num_steps=steps, warmup_steps=1)
            results = common.run_ranks(world_size=2, jobs=[job], data=data, out_dir=work_dir / f"ranks_{mode}_{repeat}")
            step_times[mode].extend(common.reporting(results, 0)["step_time_s"])
            for rank, per_job in enumerate(results):
                r = per_job[0]
                entry = samples[mode].setdefault(rank, {"peak_above_baseline_bytes": [], "optimizer_state_bytes": []})
                entry["peak_above_baseline_bytes"].append(r["peak_rss_bytes"] - r["baseline_rss_bytes"])
                entry["optimizer_state_bytes"].append(r["optimizer_state_bytes"])
    out = {"shape": shape.__dict__, "seq_len": seq_len, "num_microbatches": num_microbatches, "repeats": repeats,
           "lora": LORA, "ranks": {}}
    for rank in sorted(samples["full"]):
        row = {mode: {k: common.summary(v) for k, v in samples[mode][rank].items()} for mode in ("full", "lora")}
        row["peak_ratio"] = (row["lora"]["peak_above_baseline_bytes"]["median"]
                             / row["full"]["peak_above_baseline_bytes"]["median"])
        out["ranks"][str(rank)] = row
    out["step_time_s"] = {mode: common.summary(v) for mode, v in step_times.items()}
    out["step_time_ratio"] = out["step_time_s"]["lora"]["median"] / out["step_time_s"]["full"]["median"]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mcore_dpo_bench/lora_memory.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run (after one warm-up)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mcore_dpo_lora_memory_"))
    result = run(shape=common.TINY_SHAPE if args.tiny else common.SMALL_SHAPE, repeats=args.repeats,
                 seq_len=16 if args.tiny else args.seq_len, num_microbatches=args.microbatches, work_dir=work,
                 steps=args.steps)
    result["machine"] = common.machine()
    mib = 1 / 2**20
    for rank, row in result["ranks"].items():
        print(f"rank {rank}: peak RSS above baseline, MiB: full {common.fmt(row['full']['peak_above_baseline_bytes'], digits=1, scale=mib)}"
              f"  lora {common.fmt(row['lora']['peak_above_baseline_bytes'], digits=1, scale=mib)}"
              f"  ratio {row['peak_ratio']:.2f} (goal <= {GOAL_RATIO})")
    print(f"step time, s: full {common.fmt(result['step_time_s']['full'])}  lora {common.fmt(result['step_time_s']['lora'])}"
          f"  ratio {result['step_time_ratio']:.2f}")
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
