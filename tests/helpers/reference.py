"""The independent reference of the parity tests: a single-process Hugging Face model plus TRL's
loss and metric formulas, and the tolerance every comparison uses.

Tolerance: for every compared tensor, max|ours - reference| <= RTOL * max|reference| (+1e-12).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from mcore_dpo.data.pairs import TokenizedPair
from tests.helpers.models import PAD

RTOL = 1e-5


# --------------------------------------------------------------------------- reference
# Written from TRL's DPOTrainer formulas, independently of the engine: no collate, pair_losses,
# metric_sums or finalize_metrics here, so a bug in those cannot hide in the reference too.


def sequences(pairs: list[TokenizedPair]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    input_ids, attention, completion_mask = sequences(pairs)
    logits = model(input_ids=input_ids, attention_mask=attention).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))[:, :-1]  # at least fp32; fp64 stays
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


def loss_and_metrics(policy, reference, pairs, *, loss_type: str, beta: float, eps: float, reference_free: bool):
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
                  adam_eps: float, eval_pairs: list[TokenizedPair] = (), dtype: torch.dtype = torch.float32) -> dict:
    """HF forward + TRL's formulas + torch AdamW, one process, whole global batches; then, at the
    final weights, the metrics over all of eval_pairs.

    `dtype`: what the models compute in (weights upcast from the checkpoint's fp32); the gradients
    and weights come back in fp32 whatever it is. float64 is an exact reference only where the
    model has no float32 islands of its own (GPT-OSS: tests/helpers/gpt_oss.float64_reference)."""
    if loss_type not in REFERENCE_LOSS_TYPES:
        raise KeyError(f"no reference formula for loss type {loss_type!r}: add it to tests/helpers/reference.py")
    policy = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=dtype)
    reference = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=dtype).eval()
    opt = engine_adamw(policy, lr=lr, weight_decay=weight_decay, adam_eps=adam_eps)
    kw = dict(loss_type=loss_type, beta=beta, eps=label_smoothing, reference_free=reference_free)
    metrics, grads = [], []
    for pairs in batches:
        opt.zero_grad()
        loss, m = loss_and_metrics(policy, reference, pairs, **kw)
        loss.backward()
        # before clipping
        step_grads = {n: p.grad.detach().to(torch.float32, copy=True) for n, p in policy.named_parameters()}
        if policy.config.tie_word_embeddings:
            step_grads.pop("lm_head.weight", None)
        grads.append(step_grads)
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), clip_grad if clip_grad > 0 else float("inf"))
        m["grad_norm"] = float(norm)
        metrics.append(m)
        opt.step()
    weights = {n: p.detach().to(torch.float32, copy=True) for n, p in policy.named_parameters()}
    if policy.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    eval_metrics = None
    if eval_pairs:
        with torch.no_grad():
            _, eval_metrics = loss_and_metrics(policy, reference, list(eval_pairs), **kw)
    return {"metrics": metrics, "grads": grads, "weights": weights, "eval": eval_metrics}


def engine_adamw(model: torch.nn.Module, *, lr: float, weight_decay: float, adam_eps: float) -> torch.optim.AdamW:
    """torch's AdamW over an HF model with the engine's conventions: decay on matrices only (norms
    and biases are not decayed). The engine's parameters are matrices exactly where they have two
    dimensions or more; here stacked experts' biases (GPT-OSS's experts.gate_up_proj_bias [E, 2I])
    have two too, and are biases all the same."""
    named = list(model.named_parameters())
    decayed = [p.dim() >= 2 and not n.endswith("bias") for n, p in named]
    groups = [{"params": [p for (_, p), d in zip(named, decayed) if d], "weight_decay": weight_decay},
              {"params": [p for (_, p), d in zip(named, decayed) if not d], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=adam_eps)


def assert_close(ours: torch.Tensor, ref: torch.Tensor, *, what: str, rtol: float = RTOL, scale: float | None = None) -> None:
    err = (ours.double() - ref.double()).abs().max().item()
    if scale is None:
        scale = ref.double().abs().max().item()
    assert err <= rtol * scale + 1e-12, f"{what}: max abs error {err:.3e} > {rtol:g} x max|ref| {scale:.3e}"


def exported_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in `directory` (an OUTPUT/hf export, a model)."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def assert_exported_weights(export: Path, expected: dict[str, torch.Tensor], *, initial: Path, what: str,
                            rtol: float = RTOL) -> float:
    """The export at `export` holds `expected`'s tensors, each within rtol of its largest entry,
    and the steps moved them from the model at `initial` far beyond that (100 x rtol; over the
    names the two share: a MoE model's stacked experts are exported one file name per expert).
    Returns the largest relative difference."""
    trained, start = exported_weights(export), exported_weights(initial)
    assert set(trained) == set(expected)
    worst = moved = 0.0
    for key, tensor in expected.items():
        scale = tensor.abs().max().item()
        assert_close(trained[key], tensor, what=f"{what} weights {key}", rtol=rtol)
        worst = max(worst, (trained[key].double() - tensor.double()).abs().max().item() / scale)
        if key in start:
            moved = max(moved, (tensor - start[key]).abs().max().item() / scale)
    assert moved > 100 * rtol, moved  # the steps moved the weights far beyond the tolerance
    return worst
