"""Benchmark 11's gaps, taken apart: why packed real tokens/s is below the FLOP ratio, and what
a packed row holds in memory against a padded microbatch.

One process, one thread, the whole model on one rank (tp 1, pp 1, dp 1) and benchmark 11's
batches (`benchmarks/packing.py`: the same model, lengths, seeds and budget). Three parts:

- `exact` (no timing): per step and layout, token positions, microbatches, forward FLOPs by
  kind (linear layers, attention products as the CPU computes them and as THD would), the
  W x W score elements per layer (the masked product, its softmax and their backward touch
  each once), and the parameter-sized work per microbatch (the fp32 main-grad accumulation).
  Per microbatch, the bytes autograd saves (split into the W x W probabilities and the rest)
  and the peak of live tensor bytes inside one forward + backward, temporaries included
  (the profiler's allocation events).
- `timed`: a step's compute (per microbatch: policy forward + backward, reference forward)
  in each layout, taking turns batch by batch, `--reps` times, in thread CPU seconds (time
  the thread ran, not wall time: other processes on the box slow it far less), with the
  profiler's self CPU time per op class over the same runs, and the optimizer step.
- `gemm`: the rate of the MLP's first product at every microbatch size M the two layouts
  use (is there a shape penalty at the packed rows' widths?).
- a summary: the share of each op class, and the ratio padded / packed of each.

    python benchmarks/packing_decompose.py --reps 6
    python benchmarks/packing_decompose.py --tiny --reps 1 --steps 1    # smoke size
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks import packing as bench  # noqa: E402
from benchmarks.ref_cost import SHAPES  # noqa: E402

LAYOUTS = ("padded", "packed")
# Op classes of the profiler breakdown (by op name and input shapes; see `op_class`).
CLASSES = ("linear_gemm", "attention_gemm", "attention_wxw", "parameter_sized", "other")


def op_class(name: str, shapes: list, *, param_shapes: set[tuple[int, ...]]) -> str:
    """linear_gemm: the linear layers' matrix products (every token position); attention_gemm:
    the batched score and weighted-sum products; attention_wxw: anything else on a tensor
    whose last two dims are a W x W score matrix (scale, mask, softmax, their backward);
    parameter_sized: work on a parameter-shaped tensor (main-grad accumulation, the
    embedding's dense gradient): once per microbatch whatever its width; other: the rest
    (elementwise work on activations, log-probs, dispatch)."""
    if name in ("aten::mm", "aten::addmm"):
        return "linear_gemm"
    if name in ("aten::bmm", "aten::baddbmm"):
        return "attention_gemm"
    dims = [tuple(s) for s in shapes if isinstance(s, (list, tuple)) and s and all(isinstance(d, int) for d in s)]
    if any(len(d) >= 3 and d[-1] == d[-2] > 1 for d in dims):
        return "attention_wxw"
    if any(d in param_shapes for d in dims if len(d) == 2):
        return "parameter_sized"
    return "other"


def _setup(shape: common.LlamaShape, lengths: bench.Lengths, *, gbs: int, mbs: int, steps: int, work: Path):
    """A one-rank PolicyWorker (policy, reference, optimizer), the configs of both layouts and
    the measured batches (benchmark 11's steps 2.. after its warm-up step)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    from mcore_dpo.config import TrainConfig
    from mcore_dpo.model.builder import open_weights
    from mcore_dpo.parallel.ports import free_port
    from mcore_dpo.rank.worker import PolicyWorker

    model = common.write_random_llama(work / "model", shape=shape)
    drawn = bench.draw_lengths(gbs * (steps + 2), lengths=lengths, seed=11)
    pairs = bench.make_pairs(drawn, vocab_size=shape.vocab_size, seed=7)
    padded = TrainConfig(model=str(model), tp=1, pp=1, dp=1, micro_batch_size=mbs, global_batch_size=gbs,
                         max_steps=steps + 1, max_length=lengths.max_length, lr=1e-5, packing=False)
    packed = replace(padded, packing=True, max_tokens_per_microbatch=2 * mbs * lengths.max_length)
    worker = PolicyWorker(config=padded, spec=open_weights(str(model)).spec, pad_token_id=common.PAD_ID, rank=0,
                          master_addr="127.0.0.1", master_port=free_port())
    batches = [pairs[k * gbs:(k + 1) * gbs] for k in range(1, steps + 1)]
    return worker, {"padded": padded, "packed": packed}, batches


def _microbatches(worker, config, batch):
    worker.config = config
    return worker.local_microbatches(batch)[0]


def _context(worker, mbs):
    ctx = worker.stage_context({0: mbs, 1: mbs}, policy=worker.policy, reference=worker.reference.model,
                               loss_fn=lambda mb, logps: logps.logp_sum.sum())
    ctx.stage_inputs()  # what run_ops does before the first op
    return ctx


def step_compute(worker, mbs) -> None:
    """A step's compute on one rank: every microbatch's policy forward and backward and its
    reference forward (what the pipeline's fwd, bwd and ref_fwd ops run, without transfers)."""
    from mcore_dpo.pipeline import executor as pipeline

    ctx = _context(worker, mbs)
    for mb in range(len(mbs)):
        pipeline._policy_forward(ctx, mb, 0)
        pipeline._policy_backward(ctx, mb, 0)
        pipeline._reference_forward(ctx, mb, 1, 0)


def microbatch_memory(worker, mb) -> dict:
    """One microbatch's policy forward + backward: bytes autograd saves (W x W probabilities
    and the rest, parameters excluded) and the peak of live tensor bytes over the forward and
    backward, temporaries included, above what was live before (profiler allocation events)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mcore_dpo.pipeline import executor as pipeline

    ctx = _context(worker, [mb])
    params = {p.untyped_storage().data_ptr() for p in worker.policy.module.parameters()}
    saved: dict[int, tuple[int, bool]] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            wxw = tensor.dim() >= 3 and tensor.shape[-1] == tensor.shape[-2] > 1
            saved[storage.data_ptr()] = (storage.nbytes(), wxw)
        return tensor

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            pipeline._policy_forward(ctx, 0, 0)
        pipeline._policy_backward(ctx, 0, 0)
    live = peak = 0
    # An op's own allocations net of its own frees (self memory, children apart), at its start;
    # "[memory]" events: frees (and allocations) outside any op.
    changes = [(e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
               for e in prof.events()]
    for _, change in sorted(changes, key=lambda c: c[0]):
        live += change
        peak = max(peak, live)
    mask = ctx._masks.get((0, 0), ctx._masks.get(0))
    return {"width": int(mb.tokens.shape[1]), "rows": int(mb.tokens.shape[0]),
            "stash_bytes": sum(b for b, _ in saved.values()),
            "stash_wxw_bytes": sum(b for b, wxw in saved.values() if wxw),
            "peak_live_bytes": peak, "mask_bytes": 0 if mask is None else mask.untyped_storage().nbytes()}


def exact(worker, configs, batches, *, shape: common.LlamaShape, mbs: int, max_tokens: int) -> dict:
    num_params = sum(p.numel() for p in worker.policy.module.parameters())
    out = {"num_params": num_params, "layouts": {}}
    for name, config in configs.items():
        steps, widest = [], None
        for batch in batches:
            micro = _microbatches(worker, config, batch)
            stats = bench.layout_stats(batch, packing=config.packing, micro_batch_size=mbs, max_tokens=max_tokens,
                                       shape=shape)
            wxw = sum(m.tokens.shape[0] * m.tokens.shape[1] ** 2 for m in micro) * shape.num_heads
            steps.append({"microbatches": len(micro), "positions": sum(m.tokens.numel() for m in micro),
                          "real": common.pair_tokens(batch), "widths": [m.tokens.shape[1] for m in micro],
                          "gemm_m": [m.tokens.numel() for m in micro],
                          "flops_linear": stats["masked"]["linear"],
                          "flops_attention_cpu": stats["masked"]["attention"],
                          "flops_attention_thd": stats["thd"]["attention"], "wxw_elements_per_layer": wxw,
                          "param_elements_accumulated": len(micro) * num_params})
            best = max(micro, key=lambda m: m.tokens.numel())
            if widest is None or best.tokens.numel() > widest.tokens.numel():
                widest = best
        out["layouts"][name] = {"steps": steps, "widest_microbatch": microbatch_memory(worker, widest)}
    return out


def gemm_rates(widths: dict[str, list[int]], *, shape: common.LlamaShape, reps: int) -> dict:
    """GFLOP/s of the MLP's first product, x [M, hidden] @ w [hidden, 2 x ffn], at every M a
    layout's microbatches have (padded: rows x width), in thread CPU time, all M taking
    turns; and each layout's FLOP-weighted rate over its steps' microbatches."""
    import torch

    h, f = shape.hidden_size, 2 * shape.intermediate_size
    w = torch.randn(h, f)
    sizes = sorted({m for ms in widths.values() for m in ms})
    xs = {m: torch.randn(m, h) for m in sizes}
    spent = dict.fromkeys(sizes, 0.0)
    inner = 20
    for _ in range(reps):
        for m in sizes:
            t0 = time.thread_time()
            for _ in range(inner):
                torch.mm(xs[m], w)
            spent[m] += time.thread_time() - t0
    rate = {m: 2 * m * h * f * inner * reps / spent[m] / 1e9 for m in sizes}
    weighted = {name: sum(ms) / sum(m / rate[m] for m in ms) for name, ms in widths.items()}
    return {"gflops_by_m": rate, "weighted_gflops": weighted}


def timed(worker, configs, batches, *, reps: int, param_shapes: set) -> dict:
    """Thread CPU seconds of each batch's step compute, layouts taking turns batch by batch;
    then the same runs under the profiler, whose self time per op class (wall clock, with
    the profiler's own overhead) gives each class's share of its layout's time."""
    from torch.profiler import ProfilerActivity, profile

    for config in configs.values():  # warm-up: first-call costs and allocator growth
        step_compute(worker, _microbatches(worker, config, batches[0]))
    seconds = {name: [] for name in configs}
    by_class = {name: dict.fromkeys(CLASSES, 0.0) for name in configs}
    optimizer = []
    for _ in range(reps):
        for batch in batches:
            for name, config in configs.items():
                micro = _microbatches(worker, config, batch)
                t0 = time.thread_time()
                step_compute(worker, micro)
                seconds[name].append(time.thread_time() - t0)
        for batch in batches:
            for name, config in configs.items():
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    step_compute(worker, _microbatches(worker, config, batch))
                for event in prof.events():
                    cls = op_class(event.name, event.input_shapes, param_shapes=param_shapes)
                    by_class[name][cls] += event.self_cpu_time_total / 1e6
        t0 = time.thread_time()
        worker.optimizer.step(lr=0.0)
        optimizer.append(time.thread_time() - t0)
    n = len(batches)
    per_step = {name: [sum(v[i:i + n]) for i in range(0, len(v), n)] for name, v in seconds.items()}
    ratios = [a / b for a, b in zip(seconds["padded"], seconds["packed"])]
    shares = {name: {cls: v / sum(c.values()) for cls, v in c.items()} for name, c in by_class.items()}
    # Each class's thread CPU seconds per rep: its profiled share of the layout's median time.
    cpu_by_class = {name: {cls: share * statistics.median(per_step[name]) for cls, share in shares[name].items()}
                    for name in configs}
    return {"step_compute_cpu_s": {k: common.summary(v) for k, v in per_step.items()},
            "ratio_per_batch": common.summary(ratios), "class_share": shares, "class_cpu_s": cpu_by_class,
            "optimizer_cpu_s": common.summary(optimizer), "loadavg_1min_after": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mcore_dpo_bench/packing_decompose.json")
    parser.add_argument("--tiny", action="store_true", help="smoke size: tiny model, short sequences")
    parser.add_argument("--steps", type=int, default=3, help="benchmark 11's measured steps (its batches)")
    parser.add_argument("--reps", type=int, default=6, help="times each batch runs in each layout")
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mcore_dpo_packing_decompose_"))
    shape = common.TINY_SHAPE if args.tiny else SHAPES["balanced"]
    lengths = bench.TINY_LENGTHS if args.tiny else bench.LENGTHS
    mbs = args.micro_batch_size
    max_tokens = 2 * mbs * lengths.max_length
    worker, configs, batches = _setup(shape, lengths, gbs=args.global_batch_size, mbs=mbs, steps=args.steps,
                                      work=work)
    result = {"machine": common.machine(), "loadavg_1min_before": os.getloadavg()[0], "shape": shape.__dict__,
              "lengths": lengths.__dict__, "max_tokens_per_microbatch": max_tokens}
    param_shapes = {tuple(p.shape) for p in worker.policy.module.parameters() if p.dim() == 2}
    result["exact"] = exact(worker, configs, batches, shape=shape, mbs=mbs, max_tokens=max_tokens)
    widths = {name: [w for step in layout["steps"] for w in step["gemm_m"]] for name, layout in
              result["exact"]["layouts"].items()}
    result["gemm"] = gemm_rates(widths, shape=shape, reps=max(3, args.reps))
    result["timed"] = timed(worker, configs, batches, reps=args.reps, param_shapes=param_shapes)
    worker.shutdown()
    report(result)
    common.write_json(args.out, result)
    return result


def report(result: dict) -> None:
    ex, tm = result["exact"], result["timed"]
    pad, pk = ex["layouts"]["padded"], ex["layouts"]["packed"]

    def total(layout, key):
        return sum(s[key] for s in layout["steps"])

    print(f"exact, {len(pad['steps'])} steps: padded / packed")
    for key in ("positions", "microbatches", "flops_linear", "flops_attention_cpu", "wxw_elements_per_layer",
                "param_elements_accumulated"):
        print(f"  {key:<28} {total(pad, key):>16,} {total(pk, key):>16,}  x{total(pad, key) / total(pk, key):.3f}")
    flops = {n: total(lay, "flops_linear") + total(lay, "flops_attention_cpu") for n, lay in (("pad", pad), ("pk", pk))}
    print(f"  forward FLOPs (CPU)          x{flops['pad'] / flops['pk']:.3f}")
    for name, lay in (("padded", pad), ("packed", pk)):
        w = lay["widest_microbatch"]
        print(f"  widest {name} microbatch {w['rows']} x {w['width']}: stash {w['stash_bytes'] / 2**20:.2f} MiB "
              f"(W x W {w['stash_wxw_bytes'] / 2**20:.2f}), peak live in fwd+bwd "
              f"{w['peak_live_bytes'] / 2**20:.2f} MiB, "
              f"mask {w['mask_bytes'] / 2**10:.0f} KiB")
    rates = result["gemm"]["weighted_gflops"]
    print(f"  linear GEMM rate at each layout's M (x @ w, [M, {result['shape']['hidden_size']}] x "
          f"[{result['shape']['hidden_size']}, {2 * result['shape']['intermediate_size']}]): padded "
          f"{rates['padded']:.1f} GFLOP/s, packed {rates['packed']:.1f} GFLOP/s "
          f"(x{rates['padded'] / rates['packed']:.3f})")
    cpu = tm["step_compute_cpu_s"]
    print(f"timed (thread CPU s of the {len(pad['steps'])} steps' compute, median of reps; load "
          f"{result['loadavg_1min_before']:.1f} -> {tm['loadavg_1min_after']:.1f})")
    print(f"  padded {common.fmt(cpu['padded'])}  packed {common.fmt(cpu['packed'])}  "
          f"ratio per batch {common.fmt(tm['ratio_per_batch'])}  optimizer step {common.fmt(tm['optimizer_cpu_s'])}")
    prof = tm["class_cpu_s"]
    for cls in CLASSES:
        a, b = prof["padded"][cls], prof["packed"][cls]
        print(f"  {cls:<16} padded {a:7.3f} s ({tm['class_share']['padded'][cls]:5.1%})  packed {b:7.3f} s "
              f"({tm['class_share']['packed'][cls]:5.1%})  x{a / b if b else float('nan'):.3f}")

if __name__ == "__main__":
    main()
