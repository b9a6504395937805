"""Benchmark 6: one DPO step configuration on GPUs: tokens/s, MFU and peak memory.

A ~1.2B Llama-architecture model (the Llama-3.2-1B shape: hidden 2048, 16 layers, 32 heads,
8 kv heads, ffn 8192, vocab 128256, tied embeddings) with random weights is written to
/tmp on first use. The policy and its frozen reference run in bf16, reference interleaved,
Transformer Engine layer spec when TE imports (the local spec otherwise; the JSON says which).
No Ray and no `datasets`: `PolicyWorker` is driven directly, in this process for one GPU
(it initialises torch.distributed itself), or in one spawned process per GPU.

    python benchmarks/gpu_step.py --out /tmp/gpu_step.json                 # 1 GPU
    python benchmarks/gpu_step.py --out /tmp/gpu_step.json --tp 2 --pp 2   # 4 GPUs of one node
    python benchmarks/gpu_step.py --out /tmp/gpu_step.json --dp 8 --global-batch-size 64
    python benchmarks/gpu_step.py --tiny --out /tmp/tiny.json              # CPU smoke size

MFU = model FLOPs per second / (device bf16 dense peak x GPUs). Model FLOPs per step:
    8 * N * T                   policy forward + backward (6NT) and reference forward (2NT)
  + 16 * L * s * (heads * d) * T   attention scores and values, full s x s (no causal halving),
                                   4 L s (heads d) per token per forward, times 4 forwards' worth
with N = parameters in matrix multiplies (all layer weights + the output layer; the embedding
lookup is free), T = tokens in the step, s = sequence length, L layers. Both MFU with and
without the attention term are written. The peak defaults to 989 TFLOP/s on H100/H200
(dense bf16, SXM); pass --peak-tflops for other devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from mcore_dpo.parallel.ports import free_port  # noqa: E402

ONE_B = common.LlamaShape(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                          intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)
TINY = dataclasses.replace(common.TINY_SHAPE, tie_word_embeddings=True)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0}


def matmul_params(shape: common.LlamaShape) -> int:
    """N: weights that take part in a matrix multiply per token (output layer included)."""
    h, d = shape.hidden_size, shape.hidden_size // shape.num_heads
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * shape.intermediate_size
    return shape.num_layers * per_layer + shape.vocab_size * h


def step_flops(*, shape: common.LlamaShape, tokens: int, seq_len: int) -> dict[str, float]:
    dense = 8.0 * matmul_params(shape) * tokens
    q_width = shape.num_heads * (shape.hidden_size // shape.num_heads)
    attention = 16.0 * shape.num_layers * seq_len * q_width * tokens
    return {"dense": dense, "with_attention": dense + attention}


def _rank(rank: int, world_size: int, port: int, settings: dict, out_dir: str) -> None:
    """Build one rank's worker, run warm-up + measured steps, write this rank's figures."""
    try:
        import torch

        from mcore_dpo.config import TrainConfig
        from mcore_dpo.model.builder import open_weights
        from mcore_dpo.rank.worker import PolicyWorker, StepBatch

        config = TrainConfig(**settings["config"])
        spec = open_weights(config.model).spec
        worker = PolicyWorker(config=config, spec=spec, pad_token_id=common.PAD_ID, rank=rank,
                              master_addr="127.0.0.1", master_port=port, local_rank=rank)
        device = worker.platform.device
        pairs = common.make_pairs(**settings["data"])
        gbs = config.global_batch_size
        num_steps = settings["warmup_steps"] + settings["steps"]
        batches = [[pairs[(k * gbs + i) % len(pairs)] for i in range(gbs)] for k in range(num_steps + 1)]
        times, tokens = [], []
        for k in range(num_steps):
            if k == settings["warmup_steps"] and worker.platform.is_cuda:
                torch.cuda.reset_peak_memory_stats(device)  # steady-state peak, after warm-up
            metrics = worker.train_step(StepBatch(step=k + 1, pairs=batches[k], next_pairs=batches[k + 1]))
            if metrics is not None and k >= settings["warmup_steps"]:
                times.append(metrics["step_time_s"])
                tokens.append(common.pair_tokens(batches[k]))
        if worker.platform.is_cuda:
            peak = int(torch.cuda.max_memory_allocated(device))
            memory_kind = "torch.cuda.max_memory_allocated (after warm-up)"
        else:
            peak = common.peak_rss_bytes()
            memory_kind = "peak RSS (CPU run)"
        result = {"rank": rank, "reports": bool(times), "step_time_s": times, "tokens_per_step": tokens,
                  "peak_memory_bytes": peak, "memory_kind": memory_kind,
                  "layer_spec": "transformer_engine" if worker.use_te else "local", "device": str(device),
                  "device_name": torch.cuda.get_device_name(device) if worker.platform.is_cuda else "cpu"}
        worker.shutdown()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON result path")
    parser.add_argument("--tiny", action="store_true", help="tiny model, float32, runs on the CPU too")
    parser.add_argument("--model-dir", default=None, help="an HF Llama directory; written with random weights if it has no config.json (default: /tmp)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (prompt 1/4)")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="pairs per microbatch")
    parser.add_argument("--global-batch-size", type=int, default=16, help="pairs per step")
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--dtype", default=None, help="bfloat16 (default; --tiny: float32)")
    parser.add_argument("--ref-mode", default="interleaved")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device dense bf16 peak (default by name)")
    args = parser.parse_args(argv)

    import torch

    shape = TINY if args.tiny else ONE_B
    if args.tiny:
        args.seq_len, args.micro_batch_size, args.global_batch_size = 32, 1, 2 * args.dp
        args.dtype, args.warmup_steps = args.dtype or "float32", 1
    args.dtype = args.dtype or "bfloat16"
    on_gpu = torch.cuda.is_available()
    default_dir = Path(tempfile.gettempdir()) / ("mcore_dpo_bench_tiny_llama" if args.tiny else "mcore_dpo_bench_llama_1b")
    model_dir = Path(args.model_dir) if args.model_dir else default_dir
    if not (model_dir / "config.json").exists() or not args.model_dir:
        start = time.perf_counter()
        common.write_random_llama(model_dir, shape=shape, dtype="float32" if args.tiny else "bfloat16",
                                  device="cuda" if on_gpu else "cpu")
        print(f"random model ready in {model_dir} ({time.perf_counter() - start:.1f} s)")
    world_size = args.tp * args.pp * args.dp
    prompt_len = args.seq_len // 4
    settings = {
        "config": dict(model=str(model_dir), tp=args.tp, pp=args.pp, dp=args.dp,
                       micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                       max_steps=args.warmup_steps + args.steps, max_length=args.seq_len, ref_mode=args.ref_mode,
                       dtype=args.dtype, lr=1e-6, timeout_s=900.0, packing=False),
        "data": dict(num_pairs=args.global_batch_size * 4, prompt_len=prompt_len,
                     completion_len=args.seq_len - prompt_len, vocab_size=shape.vocab_size, seed=17),
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
    }
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    port = free_port()
    with tempfile.TemporaryDirectory() as rank_dir:
        if world_size == 1:
            _rank(0, 1, port, settings, rank_dir)
        else:
            import torch.multiprocessing as mp

            mp.start_processes(_rank, args=(world_size, port, settings, rank_dir), nprocs=world_size,
                               start_method="spawn")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(rank_dir).glob("rank*.json"))]
    if len(ranks) != world_size:
        raise SystemExit(f"gpu_step: {world_size - len(ranks)} rank(s) wrote no result")
    rep = next(r for r in ranks if r["reports"])
    times, tokens = rep["step_time_s"], rep["tokens_per_step"]
    tokens_per_s = [t / s for t, s in zip(tokens, times)]
    step = common.summary(times)
    flops = step_flops(shape=shape, tokens=tokens[0], seq_len=args.seq_len)
    device_name = rep["device_name"]
    peak_tflops = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)
    mfu = {}
    if peak_tflops and on_gpu:
        for kind, value in flops.items():
            mfu[kind] = value / step["median"] / (peak_tflops * 1e12 * world_size)
    result = {
        "machine": common.machine(),
        "device_name": device_name,
        "layer_spec": rep["layer_spec"],
        "dtype": args.dtype,
        "ref_mode": args.ref_mode,
        "layout": {"tp": args.tp, "pp": args.pp, "dp": args.dp, "world_size": world_size},
        "shape": shape.__dict__,
        "matmul_params": matmul_params(shape),
        "seq_len": args.seq_len,
        "micro_batch_size_pairs": args.micro_batch_size,
        "global_batch_size_pairs": args.global_batch_size,
        "tokens_per_step": tokens[0],
        "step_time_s": step,
        "tokens_per_s": common.summary(tokens_per_s),
        "tokens_per_s_per_device": tokens[0] / step["median"] / world_size,
        "model_flops_per_step": flops,
        "peak_tflops_per_device": peak_tflops,
        "mfu": mfu,
        "peak_memory_bytes_per_rank": {str(r["rank"]): r["peak_memory_bytes"] for r in ranks},
        "memory_kind": rep["memory_kind"],
    }
    common.write_json(args.out, result)
    gib = 2**30
    print(f"{device_name} x{world_size} ({result['layer_spec']} spec, {args.dtype}): step {common.fmt(step)} s, "
          f"{common.fmt(result['tokens_per_s'], digits=0)} tokens/s, "
          f"MFU {', '.join(f'{k} {v:.1%}' for k, v in mfu.items()) or 'n/a'}, "
          f"peak memory {max(r['peak_memory_bytes'] for r in ranks) / gib:.2f} GiB")
    return result


if __name__ == "__main__":
    main()
