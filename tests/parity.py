"""Shared machinery of the parity tests: tiny models, a batch with uneven lengths, the
single-process Hugging Face reference, and a harness that runs PolicyWorker ranks as real
gloo processes.

Tolerance: for every compared tensor, max|ours - reference| <= RTOL * max|reference| (+1e-12).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(__file__))
from convert_helpers import save_hf  # noqa: E402

from mcore_dpo.data import TokenizedPair, collate, padded_seq_len  # noqa: E402
from mcore_dpo.loss import LossSpec, PairLogps, finalize_metrics, metric_sums, pair_losses  # noqa: E402

RTOL = 1e-5
VOCAB = 100  # not a multiple of 128*tp: padded vocabulary columns must stay out of the softmax
PAD = 0


def _small_init(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
    return model


def make_model(family: str, seed: int) -> torch.nn.Module:
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    else:
        raise ValueError(family)
    return _small_init(model, seed).float()


def write_models(family: str, root: Path) -> tuple[Path, Path]:
    """Policy and reference with DIFFERENT weights (so u± are not zero at step 1)."""
    policy = save_hf(make_model(family, seed=1), root / f"{family}_policy")
    reference = save_hf(make_model(family, seed=2), root / f"{family}_ref")
    return policy, reference


def make_pairs(num_pairs: int, *, seed: int) -> list[TokenizedPair]:
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(int(x) for x in torch.randint(3, VOCAB, (n,), generator=gen))

    pairs = []
    for i in range(num_pairs):
        lp, lc, lr = (int(x) for x in torch.randint(1, 9, (3,), generator=gen))
        pairs.append(TokenizedPair(prompt_ids=(1,) + ids(lp), chosen_ids=ids(lc) + (2,), rejected_ids=ids(lr) + (2,), source_line=i + 1))
    return pairs


# --------------------------------------------------------------------------- reference
def _hf_sequence_logps(model, pairs):
    mb = collate(pairs, pad_token_id=PAD, seq_len=padded_seq_len(pairs))
    logits = model(input_ids=mb.tokens).logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
    mask = mb.loss_mask
    return (logp * mask).sum(-1), mask.sum(-1), (logits.detach().mean(-1) * mask).sum(-1)


def reference_run(*, policy_dir: Path, ref_dir: Path, batches: list[list[TokenizedPair]], spec: LossSpec,
                  lr: float, clip_grad: float, weight_decay: float, adam_eps: float) -> dict:
    """HF forward + the loss formula + torch AdamW, one process, whole global batches."""
    policy = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()
    # Decay matrices only (norms and biases are not decayed), as the engine does.
    params = list(policy.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=adam_eps)
    metrics = []
    grads = []
    for pairs in batches:
        b = len(pairs)
        opt.zero_grad()
        c_all, n_all, l_all = _hf_sequence_logps(policy, pairs)
        with torch.no_grad():
            rc_all, _, _ = _hf_sequence_logps(reference, pairs)
        if not spec.needs_reference:  # reference-free, or sft alone: no reference model runs
            rc_all = torch.zeros_like(rc_all)
        logps = PairLogps(
            chosen_logps=c_all[:b], rejected_logps=c_all[b:], ref_chosen_logps=rc_all[:b], ref_rejected_logps=rc_all[b:],
            chosen_num_tokens=n_all[:b], rejected_num_tokens=n_all[b:], chosen_logit_sum=l_all[:b], rejected_logit_sum=l_all[b:],
        )
        chosen_tokens = sum(len(p.chosen_ids) for p in pairs)
        loss = pair_losses(logps, spec=spec, num_pairs_global=b, chosen_tokens_global=chosen_tokens).mean()
        sums = metric_sums(logps, spec=spec, num_pairs_global=b, chosen_tokens_global=chosen_tokens)
        loss.backward()
        step_grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}  # before clipping
        if policy.config.tie_word_embeddings:
            step_grads.pop("lm_head.weight", None)
        grads.append(step_grads)
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), clip_grad if clip_grad > 0 else float("inf"))
        m = finalize_metrics(sums, spec=spec)
        m["grad_norm"] = float(norm)
        m["loss_autograd"] = float(loss.detach())
        metrics.append(m)
        opt.step()
    weights = {n: p.detach().clone() for n, p in policy.named_parameters()}
    if policy.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return {"metrics": metrics, "grads": grads, "weights": weights}


# --------------------------------------------------------------------------- distributed harness
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, jobs: list[dict], out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # fp32 means fp32 on a GPU too (settings of the parent process do not reach these ranks).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        from mcore_dpo.config import TrainConfig
        from mcore_dpo.model import open_weights
        from mcore_dpo.worker import PolicyWorker, StepBatch

        worker = None
        for j, job in enumerate(jobs):
            config = TrainConfig(**job["config"])
            spec = open_weights(config.model).spec
            worker = PolicyWorker(config=config, spec=spec, pad_token_id=PAD, rank=rank,
                                  master_addr="127.0.0.1", master_port=port)
            batches = job["batches"]
            ids = job["batch_ids"]
            if config.ref_mode == "precomputed":
                worker.precompute_reference(job["all_pairs"])
            metrics = []
            tp, pp, dp = worker.coordinates()
            tag = f"job{j}_tp{tp}_pp{pp}_dp{dp}"
            grads_before_step = _record_grads_before_step(worker)
            for k, pairs in enumerate(batches):
                nxt = batches[k + 1] if k + 1 < len(batches) else None
                metrics.append(worker.train_step(StepBatch(step=k + 1, pairs=pairs, next_pairs=nxt, pair_ids=ids[k])))
                save_file(grads_before_step.pop(), os.path.join(out_dir, f"{tag}_grads{k + 1}.safetensors"))
            save_file(worker.policy_shard() or {}, os.path.join(out_dir, f"{tag}_weights.safetensors"))
            if any(m is not None for m in metrics):
                Path(out_dir, f"job{j}_metrics.json").write_text(json.dumps(metrics))
        worker.shutdown()
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _record_grads_before_step(worker) -> list[dict[str, torch.Tensor]]:
    """The reference's gradients are taken before clipping: record ours at the same point (an
    optimizer may clip or shard the gradient buffers in place during its step)."""
    recorded: list[dict[str, torch.Tensor]] = []
    step = worker.optimizer.step

    def recording_step(**kwargs):
        recorded.append(worker.grad_shard())
        return step(**kwargs)

    worker.optimizer.step = recording_step
    return recorded


def run_ranks(*, world_size: int, jobs: list[dict], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, jobs, str(out_dir))) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    errors = sorted(out_dir.glob("error_rank*.txt"))
    if errors:
        raise AssertionError(errors[0].read_text())
    for p in procs:
        if p.exitcode != 0:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank process exited with {p.exitcode}")


def load_rank_tensors(out_dir: Path, job: int, kind: str) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    out = {}
    for path in out_dir.glob(f"job{job}_tp*_{kind}.safetensors"):
        parts = path.name.split("_")
        tp, pp, dp = int(parts[1][2:]), int(parts[2][2:]), int(parts[3][2:])
        out[(tp, pp, dp)] = load_file(str(path))
    return out


def assert_close(ours: torch.Tensor, ref: torch.Tensor, *, what: str, rtol: float = RTOL, scale: float | None = None) -> None:
    err = (ours.double() - ref.double()).abs().max().item()
    if scale is None:
        scale = ref.double().abs().max().item()
    assert err <= rtol * scale + 1e-12, f"{what}: max abs error {err:.3e} > {rtol:g} x max|ref| {scale:.3e}"
