"""Shared machinery of the parity tests: tiny models, a batch with uneven lengths, the
single-process Hugging Face reference, and a harness that runs PolicyWorker ranks as real
gloo processes.

Tolerance: for every compared tensor, max|ours - reference| <= RTOL * max|reference| (+1e-12).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(__file__))
from convert_helpers import save_hf  # noqa: E402

from mcore_dpo.data import TokenizedPair  # noqa: E402
from mcore_dpo.ports import free_port  # noqa: E402

RTOL = 1e-5
# Packed microbatches (--packing) for make_pairs' data: the smallest budget --max-length 20
# allows (its sequences have at most 18 tokens), so a global batch of 8 pairs takes 6 or 7
# packed rows where micro_batch_size 2 gives 4 padded microbatches.
PACKED = {"packing": True, "max_length": 20, "max_tokens_per_microbatch": 40}
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
# Written from TRL's DPOTrainer formulas, independently of the engine: no collate, pair_losses,
# metric_sums or finalize_metrics here, so a bug in those cannot hide in the reference too.


def _sequences(pairs: list[TokenizedPair]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's concatenated batch: chosen rows then rejected rows, prompt + completion, right-padded;
    the attention mask and the completion mask (1 on completion tokens)."""
    rows = [(p.prompt_ids, p.chosen_ids) for p in pairs] + [(p.prompt_ids, p.rejected_ids) for p in pairs]
    seq_len = max(len(prompt) + len(completion) for prompt, completion in rows)
    input_ids = torch.full((len(rows), seq_len), PAD, dtype=torch.long)
    attention = torch.zeros(len(rows), seq_len, dtype=torch.long)
    completion_mask = torch.zeros(len(rows), seq_len)
    for i, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        input_ids[i, :n] = torch.tensor(prompt + completion)
        attention[i, :n] = 1
        completion_mask[i, len(prompt):n] = 1
    return input_ids, attention, completion_mask


def _completion_sums(model, pairs: list[TokenizedPair]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: summed log-probs of the completion tokens, their count, and the sum over them of
    the vocabulary-mean logit (at the position that predicts each token)."""
    input_ids, attention, completion_mask = _sequences(pairs)
    logits = model(input_ids=input_ids, attention_mask=attention).logits.float()[:, :-1]
    targets, mask = input_ids[:, 1:], completion_mask[:, 1:]
    token_logps = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (token_logps * mask).sum(-1), mask.sum(-1), (logits.detach().mean(-1) * mask).sum(-1)


def _trl_losses(loss_type: str, *, c, r, c0, r0, lc, lr, beta: float, eps: float):
    """Per-pair loss of one loss type (ARCHITECTURE's table and TRL 1.16's
    `DPOTrainer._compute_loss`); aot and aot_unpaired sort over the whole batch, which here is
    the global batch (their per-pair losses come in sorted order; only their mean is used)."""
    uc, ur = c - c0, r - r0
    z = beta * (uc - ur)
    logsig = torch.nn.functional.logsigmoid

    def aot(delta):
        return -(1 - eps) * logsig(beta * delta) - eps * logsig(-beta * delta)

    formulas = {
        "sigmoid": lambda: -logsig(z),
        "cdpo": lambda: -(1 - eps) * logsig(z) - eps * logsig(-z),
        "hinge": lambda: torch.relu(1 - z),
        "ipo": lambda: (uc / lc - ur / lr - 1 / (2 * beta)) ** 2,
        "robust": lambda: (-(1 - eps) * logsig(z) + eps * logsig(-z)) / (1 - 2 * eps),
        "exo_pair": lambda: (torch.sigmoid(z) * (logsig(z) - math.log(1 - eps))
                             + torch.sigmoid(-z) * (logsig(-z) - math.log(eps))),
        "nca_pair": lambda: -logsig(beta * uc) - 0.5 * logsig(-beta * uc) - 0.5 * logsig(-beta * ur),
        "bco_pair": lambda: -logsig(beta * uc) - logsig(-beta * ur),
        "sppo_hard": lambda: (uc - 1 / (2 * beta)) ** 2 + (ur + 1 / (2 * beta)) ** 2,
        "apo_zero": lambda: 1 - torch.sigmoid(beta * uc) + torch.sigmoid(beta * ur),
        "apo_down": lambda: torch.sigmoid(beta * uc) + 1 - torch.sigmoid(z),
        "discopop": lambda: ((1 - torch.sigmoid(z / DISCOPOP_TAU)) * -logsig(z)
                             + torch.sigmoid(z / DISCOPOP_TAU) * torch.exp(-z)),
        "sigmoid_norm": lambda: -logsig(beta * (uc / lc - ur / lr)),
        "aot": lambda: aot(torch.sort(c - r)[0] - torch.sort(c0 - r0)[0]),
        "aot_unpaired": lambda: aot(torch.sort(uc)[0] - torch.sort(ur)[0]),
    }
    return formulas[loss_type]()


# Loss types the reference can compute: "sft" is the token-mean NLL of the chosen completions.
REFERENCE_LOSS_TYPES = ("sigmoid", "cdpo", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard",
                        "apo_zero", "apo_down", "discopop", "sigmoid_norm", "aot", "aot_unpaired", "sft")
DISCOPOP_TAU = 0.05


def _loss_and_metrics(policy, reference, pairs, *, loss_type: str, beta: float, eps: float, reference_free: bool):
    """The batch loss (differentiable) and TRL's metrics over ONE batch = the whole global batch."""
    b = len(pairs)
    sums, counts, logit_sums = _completion_sums(policy, pairs)
    c, r, lc, lr = sums[:b], sums[b:], counts[:b], counts[b:]
    if reference_free:
        c0 = r0 = torch.zeros(b)
    else:
        with torch.no_grad():
            ref_sums, _, _ = _completion_sums(reference, pairs)
        c0, r0 = ref_sums[:b], ref_sums[b:]
    uc, ur = c - c0, r - r0
    if loss_type == "sft":
        loss = -c.sum() / lc.sum()
    else:
        loss = _trl_losses(loss_type, c=c, r=r, c0=c0, r0=r0, lc=lc, lr=lr, beta=beta, eps=eps).mean()
    with torch.no_grad():
        d = lambda t: t.detach().double()  # noqa: E731
        metrics = {
            "loss": float(loss),
            "rewards/chosen": float(d(beta * uc).mean()),
            "rewards/rejected": float(d(beta * ur).mean()),
            "rewards/accuracies": float((uc > ur).double().mean()),
            "rewards/margins": float(d(beta * (uc - ur)).mean()),
            "logps/chosen": float(d(c).mean()),
            "logps/rejected": float(d(r).mean()),
            # The exact mean over every completion token of the batch (TRL: a mean of microbatch means).
            "logits/chosen": float(d(logit_sums[:b]).sum() / d(lc).sum()),
            "logits/rejected": float(d(logit_sums[b:]).sum() / d(lr).sum()),
        }
        if loss_type == "sft":
            metrics["nll_loss"] = float(-d(c).sum() / d(lc).sum())
    return loss, metrics


def reference_run(*, policy_dir: Path, ref_dir: Path, batches: list[list[TokenizedPair]], loss_type: str, beta: float,
                  label_smoothing: float, reference_free: bool, lr: float, clip_grad: float, weight_decay: float,
                  adam_eps: float, eval_pairs: list[TokenizedPair] = ()) -> dict:
    """HF forward + TRL's formulas + torch AdamW, one process, whole global batches; then, at the
    final weights, the metrics over all of eval_pairs."""
    if loss_type not in REFERENCE_LOSS_TYPES:
        raise KeyError(f"no reference formula for loss type {loss_type!r}: add it to tests/parity.py")
    policy = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()
    # Decay matrices only (norms and biases are not decayed), as the engine does.
    params = list(policy.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=adam_eps)
    kw = dict(loss_type=loss_type, beta=beta, eps=label_smoothing, reference_free=reference_free)
    metrics, grads = [], []
    for pairs in batches:
        opt.zero_grad()
        loss, m = _loss_and_metrics(policy, reference, pairs, **kw)
        loss.backward()
        step_grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}  # before clipping
        if policy.config.tie_word_embeddings:
            step_grads.pop("lm_head.weight", None)
        grads.append(step_grads)
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), clip_grad if clip_grad > 0 else float("inf"))
        m["grad_norm"] = float(norm)
        metrics.append(m)
        opt.step()
    weights = {n: p.detach().clone() for n, p in policy.named_parameters()}
    if policy.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    eval_metrics = None
    if eval_pairs:
        with torch.no_grad():
            _, eval_metrics = _loss_and_metrics(policy, reference, list(eval_pairs), **kw)
    return {"metrics": metrics, "grads": grads, "weights": weights, "eval": eval_metrics}


# --------------------------------------------------------------------------- distributed harness
def _ref_tables(out_dir: str, j: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The reference group's [pairs, 2] tables of job j: one per step, and the eval pairs'."""
    files = sorted(Path(out_dir).glob(f"job{j}_ref_step*.safetensors"), key=lambda f: int(f.stem.rsplit("step", 1)[1]))
    eval_file = Path(out_dir, f"job{j}_ref_eval.safetensors")
    return [load_file(str(f))["table"] for f in files], load_file(str(eval_file))["table"] if eval_file.exists() else None


def _ref_rank_main(rank: int, world_size: int, port: int, jobs: list[dict], out_dir: str) -> None:
    """One rank of the reference group (--ref-mode separate): it writes, for every separate job,
    the reference log-prob tables the driver would hand to the policy group."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        from mcore_dpo.config import TrainConfig
        from mcore_dpo.model import open_weights
        from mcore_dpo.worker import ReferenceWorker

        worker = None
        for j, job in enumerate(jobs):
            if job["config"]["ref_mode"] != "separate":
                continue
            config = TrainConfig(**job["config"])
            spec = open_weights(config.model).spec
            worker = ReferenceWorker(config=config, spec=spec, pad_token_id=PAD, rank=rank, master_addr="127.0.0.1",
                                     master_port=port)
            named = [(f"step{k + 1}", pairs) for k, pairs in enumerate(job["batches"])]
            named += [("eval", job["eval_pairs"])] if job.get("eval_pairs") else []
            for name, pairs in named:
                table = worker.reference_logps(pairs)
                if table is not None:
                    save_file({"table": table.contiguous()}, os.path.join(out_dir, f"job{j}_ref_{name}.safetensors"))
        if worker is not None:
            worker.shutdown()
    except BaseException:
        Path(out_dir, f"error_ref_rank{rank}.txt").write_text(traceback.format_exc())
        raise


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
            # A test's own instruments in the rank (a module with install(job, rank, out_dir) and
            # report(job_index, rank, out_dir)), e.g. tests/host_sync_guard.py.
            instruments = importlib.import_module(job["setup"]) if job.get("setup") else None
            if instruments is not None:
                instruments.install(job, rank, out_dir)
            if worker is not None and worker.layout != _policy_layout(config):  # another layout, the same world
                from mcore_dpo.mesh import release_layout

                release_layout()
            worker = PolicyWorker(config=config, spec=spec, pad_token_id=PAD, rank=rank,
                                  master_addr="127.0.0.1", master_port=port)
            batches = job["batches"]
            ids = job["batch_ids"]
            eval_pairs = job.get("eval_pairs") or []
            ref_steps, ref_eval = _ref_tables(out_dir, j) if config.ref_mode == "separate" else ([None] * len(batches), None)
            if config.ref_mode == "precomputed":
                worker.precompute_reference(job["all_pairs"], eval_pairs)
            metrics = []
            tp, pp, dp = worker.coordinates()
            tag = f"job{j}_tp{tp}_pp{pp}_dp{dp}"
            for k, pairs in enumerate(batches):
                nxt = batches[k + 1] if k + 1 < len(batches) else None
                metrics.append(worker.train_step(StepBatch(step=k + 1, pairs=pairs, next_pairs=nxt, pair_ids=ids[k],
                                                           ref_logps=ref_steps[k])))
                save_file(worker.grad_shard(), os.path.join(out_dir, f"{tag}_grads{k + 1}.safetensors"))
            save_file(worker.policy_shard() or {}, os.path.join(out_dir, f"{tag}_weights.safetensors"))
            if eval_pairs:
                metrics.append(worker.evaluate(eval_pairs, ref_eval))
            if metrics[0] is not None:
                Path(out_dir, f"job{j}_metrics.json").write_text(json.dumps(metrics))
            if instruments is not None:
                instruments.report(j, rank, out_dir)
        worker.shutdown()
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _policy_layout(config):
    from mcore_dpo.mesh import Layout

    return Layout(tp=config.tp, pp=config.pp, dp=config.dp, ep=config.ep)


# Rank processes fork from a server that has imported torch, megatron-core and the worker once
# (about 10 s of CPU per process otherwise, paid by every rank of every launch); each still
# starts with a fresh interpreter state of its own and the caller's environment at launch time.
_PRELOAD = ["torch", "megatron.core", "mcore_dpo.worker", "parity"]


def _with_environment(environ: dict, target, *args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def spawn_ranks(target, *, world_size: int, jobs: list[dict], out_dir: Path) -> None:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_with_environment, args=(environ, target, r, world_size, port, jobs, str(out_dir)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    errors = sorted(out_dir.glob("error_*rank*.txt"))
    if errors:
        raise AssertionError(errors[0].read_text())
    for p in procs:
        if p.exitcode != 0:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank process exited with {p.exitcode}")


def run_ranks(*, world_size: int, jobs: list[dict], out_dir: Path) -> None:
    """Run the jobs on world_size policy ranks. Jobs with --ref-mode separate first get their
    reference tables from a reference group of their own layout (ref_tp x ref_pp x ref_dp ranks),
    as the driver feeds them to the policy group."""
    out_dir.mkdir(parents=True, exist_ok=True)
    separate = [job["config"] for job in jobs if job["config"]["ref_mode"] == "separate"]
    if separate:
        ref_worlds = {c.get("ref_tp", 1) * c.get("ref_pp", 1) * c.get("ref_dp", 1) for c in separate}
        assert len(ref_worlds) == 1, "all separate jobs of one run share the reference group's size"
        spawn_ranks(_ref_rank_main, world_size=ref_worlds.pop(), jobs=jobs, out_dir=out_dir)
    spawn_ranks(_rank_main, world_size=world_size, jobs=jobs, out_dir=out_dir)


def check_ran_packed(out_dir: Path, *, padded: int, packed: int) -> None:
    """Job `packed` of a launch really ran packed rows: every training step the same real tokens
    as job `padded` (the same batches), fewer token positions, more microbatches."""
    on, off = (json.loads((out_dir / f"job{j}_metrics.json").read_text()) for j in (packed, padded))
    steps = [(a, b) for a, b in zip(on, off) if a is not None and "tokens/real" in a]  # not the evaluation
    assert steps, f"job {packed}: no training step metrics"
    for a, b in steps:
        assert a["tokens/real"] == b["tokens/real"] and a["tokens/padded"] < b["tokens/padded"], (a, b)
        assert a["microbatches"] > b["microbatches"], (a, b)


def load_rank_tensors(out_dir: Path, job: int, kind: str, *, layout: tuple[int, int, int]
                      ) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    """Every rank's file of one kind; a missing rank file is an error, not a smaller comparison."""
    tp, pp, dp = layout
    expected = {(t, p, d) for t in range(tp) for p in range(pp) for d in range(dp)}
    out = {}
    for path in out_dir.glob(f"job{job}_tp*_{kind}.safetensors"):
        parts = path.name.split("_")
        out[(int(parts[1][2:]), int(parts[2][2:]), int(parts[3][2:]))] = load_file(str(path))
    missing = sorted(expected - set(out))
    assert not missing and set(out) == expected, f"job {job} {kind}: no file from ranks (tp, pp, dp) {missing}"
    return out


def assert_close(ours: torch.Tensor, ref: torch.Tensor, *, what: str, rtol: float = RTOL, scale: float | None = None) -> None:
    err = (ours.double() - ref.double()).abs().max().item()
    if scale is None:
        scale = ref.double().abs().max().item()
    assert err <= rtol * scale + 1e-12, f"{what}: max abs error {err:.3e} > {rtol:g} x max|ref| {scale:.3e}"
