"""CPU step time of a tiny Qwen3-MoE at ep 1 vs ep 2 (two gloo ranks, dp 2 both), and the share
of the step spent in the experts' all-to-all (every `all_to_all_single` call, forward and
backward, timed on each rank).

    PYTHONPATH=$PWD python -m benchmarks.moe_ep --rounds 3 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks import common


def _model_dir(root: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=128,
                            num_experts=8, num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False)
    directory = root / "qwen3_moe_tiny"
    Qwen3MoeForCausalLM(config).float().save_pretrained(str(directory))
    return directory


def _rank(rank: int, world: int, port: int, config: dict, steps: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        from mcore_dpo.config import TrainConfig
        from mcore_dpo.model.builder import open_weights
        from mcore_dpo.rank.worker import PolicyWorker, StepBatch

        spent = [0.0]
        inner = dist.all_to_all_single

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        dist.all_to_all_single = timed
        cfg = TrainConfig(**config)
        worker = PolicyWorker(config=cfg, spec=open_weights(cfg.model).spec, pad_token_id=common.PAD_ID, rank=rank,
                              master_addr="127.0.0.1", master_port=port)
        pairs = common.make_pairs(cfg.global_batch_size * (steps + 2), prompt_len=48, completion_len=48,
                                  vocab_size=512, seed=1)
        gbs = cfg.global_batch_size
        rows = []
        for k in range(steps + 1):  # step 1 is the warm-up
            spent[0] = 0.0
            start = time.perf_counter()
            worker.train_step(StepBatch(step=k + 1, pairs=pairs[k * gbs:(k + 1) * gbs],
                                        next_pairs=pairs[(k + 1) * gbs:(k + 2) * gbs], pair_ids=list(range(gbs))))
            if k:
                rows.append({"step_s": time.perf_counter() - start, "all_to_all_s": spent[0]})
        worker.shutdown()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def measure(model: Path, *, ep: int, steps: int, out_dir: Path) -> list[dict]:
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(model=str(model), ref_model=str(model), dp=2, ep=ep, micro_batch_size=2, global_batch_size=8,
                  max_steps=steps + 1, ref_mode="interleaved", distributed_optimizer=False, export_hf=False,
                  save_interval=0, save_interval_min=0, timeout_s=300.0, packing=False)
    port = common.free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, port, config, steps, str(out_dir))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
    errors = sorted(out_dir.glob("error_rank*.txt"))
    if errors or any(p.exitcode != 0 for p in procs):
        raise RuntimeError(errors[0].read_text() if errors else "a rank failed")
    per_rank = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    # One step ends when its slowest rank ends; the all-to-all share is the ranks' mean.
    return [{"step_s": max(r[k]["step_s"] for r in per_rank),
             "all_to_all_share": statistics.mean(r[k]["all_to_all_s"] / r[k]["step_s"] for r in per_rank)}
            for k in range(steps)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = _model_dir(Path(tmp))
        runs: dict[int, list[dict]] = {1: [], 2: []}
        for r in range(args.rounds):  # alternate the layouts so load changes hit both
            for ep in (1, 2):
                runs[ep].extend(measure(model, ep=ep, steps=args.steps, out_dir=Path(tmp, f"ep{ep}_{r}")))
    step = {ep: statistics.median(x["step_s"] for x in rows) for ep, rows in runs.items()}
    share = {ep: statistics.median(x["all_to_all_share"] for x in rows) for ep, rows in runs.items()}
    print(json.dumps({"median_step_s": step, "median_all_to_all_share": share, "ep2_over_ep1": step[2] / step[1],
                      "steps_per_layout": len(runs[1]), "loadavg_1min": os.getloadavg()[0]}, indent=2))


if __name__ == "__main__":
    main()
