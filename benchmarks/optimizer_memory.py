"""Optimizer memory per rank: the dp-sharded optimizer at dp 1 and dp 2, and the replicated one
at dp 2.

Each (configuration, repeat) is a fresh set of rank processes (tp 1, pp 1) that builds the worker
and runs two steps. Per rank it records the optimizer state's exact tensor bytes
(`state_bytes()`: the fp32 master copies, none for fp32 parameters, plus AdamW's two moments)
and the process's peak RSS (VmHWM). RSS also holds the interpreter, torch, megatron-core, the
parameters, DDP's fp32 gradient buffer and the activations, which do not shrink with dp; the
RSS difference dp 1 - dp 2 is compared with the state bytes the sharding saves.

    python benchmarks/optimizer_memory.py                       # 3 repeats, fp32, ~4 min on 2 cores
    python benchmarks/optimizer_memory.py --dtype bfloat16      # fp32 masters appear in the state
    python benchmarks/optimizer_memory.py --tiny --repeats 1
    python benchmarks/optimizer_memory.py --tiny --repeats 1 --share-launch   # smoke: the two dp-2
        # configurations in one set of rank processes (exact state bytes; RSS then not per configuration)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.memory import SHAPE  # noqa: E402  (parameters dominate: hidden 1024, vocab 8192)

CONFIGS = (("dp1_sharded", 1, True), ("dp2_sharded", 2, True), ("dp2_replicated", 2, False))


def run(*, shape: common.LlamaShape, dtype: str, repeats: int, seq_len: int, work_dir: Path,
        share_launch: bool = False) -> dict:
    model_dir = common.write_random_llama(work_dir / "model", shape=shape)
    micro_batch_size, num_microbatches = 1, 2
    data = dict(num_pairs=16, prompt_len=seq_len // 4, completion_len=seq_len - seq_len // 4,
                vocab_size=shape.vocab_size, seed=3)
    samples: dict[str, dict[int, dict[str, list[float]]]] = {name: {} for name, _, _ in CONFIGS}
    # One launch per configuration (its own peak RSS), or with share_launch one per dp size.
    launches = [[c for c in CONFIGS if c[1] == dp] for dp in sorted({c[1] for c in CONFIGS})] if share_launch \
        else [[c] for c in CONFIGS]
    for repeat in range(repeats):
        for launch in launches:  # alternate so that drift on a shared box hits all alike
            dp = launch[0][1]
            jobs = []
            for name, _, sharded in launch:
                config = dict(model=str(model_dir), tp=1, pp=1, dp=dp, micro_batch_size=micro_batch_size,
                              global_batch_size=micro_batch_size * num_microbatches * dp, max_steps=2,
                              max_length=seq_len, ref_mode="none", lr=1e-5, dtype=dtype, distributed_optimizer=sharded,
                              packing=False)
                jobs.append(common.RankJob(name=name, config=config, num_steps=1, warmup_steps=1))
            label = "_".join(name for name, _, _ in launch)
            results = common.run_ranks(world_size=dp, jobs=jobs, data=data, out_dir=work_dir / f"{label}_{repeat}")
            for j, (name, _, _) in enumerate(launch):
                for rank, per_job in enumerate(results):
                    entry = samples[name].setdefault(rank, {"optimizer_state_bytes": [], "peak_rss_bytes": []})
                    entry["optimizer_state_bytes"].append(per_job[j]["optimizer_state_bytes"])
                    entry["peak_rss_bytes"].append(per_job[j]["peak_rss_bytes"])
    out = {"shape": shape.__dict__, "dtype": dtype, "seq_len": seq_len, "repeats": repeats,
           "share_launch": share_launch, "configs": {}}
    for name, _, _ in CONFIGS:
        out["configs"][name] = {str(rank): {k: common.summary(v) for k, v in row.items()}
                                for rank, row in samples[name].items()}
    one = out["configs"]["dp1_sharded"]["0"]
    for name in ("dp2_sharded", "dp2_replicated"):
        for rank, row in out["configs"][name].items():
            row["state_over_dp1"] = row["optimizer_state_bytes"]["median"] / one["optimizer_state_bytes"]["median"]
            row["rss_saved_bytes"] = one["peak_rss_bytes"]["median"] - row["peak_rss_bytes"]["median"]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mcore_dpo_bench/optimizer_memory.json")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--share-launch", action="store_true",
                        help="smoke runs: configurations of one dp size share rank processes (peak RSS is then theirs together)")
    args = parser.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mcore_dpo_optimizer_memory_"))
    result = run(shape=common.TINY_SHAPE if args.tiny else SHAPE, dtype=args.dtype, repeats=args.repeats,
                 seq_len=16 if args.tiny else args.seq_len, work_dir=work, share_launch=args.share_launch)
    result["machine"] = common.machine()
    mib = 1 / 2**20
    for name, ranks in result["configs"].items():
        for rank, row in ranks.items():
            line = (f"{name:<15} rank {rank}: optimizer state {row['optimizer_state_bytes']['median'] * mib:8.1f} MiB, "
                    f"peak RSS {common.fmt(row['peak_rss_bytes'], digits=1, scale=mib)} MiB")
            if "state_over_dp1" in row:
                line += (f"; state / dp1 = {row['state_over_dp1']:.3f}, "
                         f"RSS dp1 - this = {row['rss_saved_bytes'] * mib:.1f} MiB")
            print(line)
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
