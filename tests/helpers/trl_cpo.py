"""TRL 1.16's CPOTrainer as the reference of `--objective cpo` (tests/test_cpo_parity.py).

The loss, its gradient and the metrics come from TRL's own methods (`get_batch_loss_metrics`,
which calls `concatenated_inputs`, `concatenated_forward`, `get_batch_logps` and `cpo_loss`),
called unbound on a SimpleNamespace standing in for the trainer: it carries the attributes
`CPOTrainer.__init__` sets from a `CPOConfig` (TRL's defaults, the options given on top, and
`CPOConfig.__post_init__`'s alphapo mapping). Around them, what the engine does and TRL's
Trainer would do otherwise: the Hugging Face model in fp32, one whole global batch per step (so
TRL's per-device means are global-batch means), torch's clip_grad_norm_ and AdamW with the
engine's conventions (decay on matrices only; tests/helpers/reference.py).

Nothing here comes from mcore_dpo's objective code: a bug there cannot hide in the reference.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from types import MethodType, SimpleNamespace
from unittest import mock

import torch

from mcore_dpo.data.pairs import TokenizedPair

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# The CPOConfig fields the loss reads: --loss-type, --beta, --label-smoothing, --cpo-alpha,
# --simpo-gamma, --alpha.
LOSS_FIELDS = ("loss_type", "beta", "label_smoothing", "cpo_alpha", "simpo_gamma", "alpha")


def cpo_config(**options) -> SimpleNamespace:
    """The loss fields of a `CPOConfig(**options)`: TRL 1.16's defaults for the others, then its
    `__post_init__` (alphapo -> simpo with cpo_alpha 0), without TrainingArguments' own checks."""
    from trl.experimental.cpo import CPOConfig
    from trl.trainer.base_config import _BaseConfig

    unknown = set(options) - set(LOSS_FIELDS)
    assert not unknown, unknown
    defaults = {f.name: f.default for f in dataclasses.fields(CPOConfig) if f.name in LOSS_FIELDS}
    config = object.__new__(CPOConfig)
    for name, value in {**defaults, **options}.items():
        setattr(config, name, value)
    with mock.patch.object(_BaseConfig, "__post_init__", lambda self: None):
        CPOConfig.__post_init__(config)
    return SimpleNamespace(**{name: getattr(config, name) for name in LOSS_FIELDS})


def stand_in(config: SimpleNamespace, *, pad_token_id: int) -> SimpleNamespace:
    """A CPOTrainer stand-in with the attributes `CPOTrainer.__init__` sets from `config`, on the CPU."""
    from trl.experimental.cpo import CPOTrainer

    trainer = SimpleNamespace(
        beta=config.beta, label_smoothing=config.label_smoothing, loss_type=config.loss_type,
        cpo_alpha=config.cpo_alpha, alpha=config.alpha, is_encoder_decoder=False, pad_token_id=pad_token_id,
        aux_loss_enabled=False,
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda tensor: tensor),
        concatenated_inputs=CPOTrainer.concatenated_inputs, get_batch_logps=CPOTrainer.get_batch_logps,
    )
    if config.loss_type == "simpo":  # as __init__: only simpo keeps gamma
        trainer.simpo_gamma = config.simpo_gamma
    for name in ("cpo_loss", "concatenated_forward", "get_batch_loss_metrics"):
        setattr(trainer, name, MethodType(getattr(CPOTrainer, name), trainer))
    return trainer


def trl_batch(pairs: list[TokenizedPair], *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """TRL's decoder-only batch (as its DPODataCollatorWithPadding leaves it): for each side the ids
    of prompt + completion right-padded with the pad id, the attention mask, and the labels: -100
    over the prompt and the padding, the completion's ids elsewhere."""
    batch = {}
    for side in ("chosen", "rejected"):
        rows = [(pair.prompt_ids, getattr(pair, f"{side}_ids")) for pair in pairs]
        length = max(len(prompt) + len(completion) for prompt, completion in rows)
        ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        labels = torch.full((len(rows), length), -100, dtype=torch.long)
        for i, (prompt, completion) in enumerate(rows):
            n = len(prompt) + len(completion)
            ids[i, :n] = torch.tensor(prompt + completion)
            mask[i, :n] = 1
            labels[i, len(prompt):n] = torch.tensor(completion)
        batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"], batch[f"{side}_labels"] = ids, mask, labels
    return batch


class _Recording(torch.nn.Module):
    """The model, keeping the logits of its last forward (TRL's concatenated [chosen; rejected] batch)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.logits: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.logits = out.logits.detach()
        return out


def exact_logit_means(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The vocabulary-mean logit averaged over every completion token of the batch, at the position
    that predicts it (the engine's logits/chosen and logits/rejected), from TRL's concatenated
    logits [chosen rows; rejected rows]. TRL 1.16 logs the mean of the whole padded tensor instead."""
    b = batch["chosen_labels"].shape[0]
    means = []
    for rows, side in ((slice(0, b), "chosen"), (slice(b, 2 * b), "rejected")):
        labels = batch[f"{side}_labels"]
        predicts = (labels[:, 1:] != -100).double()  # position t-1 predicts label t
        vocab_mean = logits[rows, : labels.shape[1] - 1].double().mean(-1)
        means.append(float((vocab_mean * predicts).sum() / predicts.sum()))
    return means[0], means[1]


def adamw(policy: torch.nn.Module, *, lr: float, weight_decay: float, adam_eps: float) -> torch.optim.AdamW:
    """torch's AdamW with the engine's conventions: decay on the matrices only."""
    named = list(policy.named_parameters())
    decayed = [p.dim() >= 2 and not n.endswith("bias") for n, p in named]
    groups = [{"params": [p for (_, p), d in zip(named, decayed) if d], "weight_decay": weight_decay},
              {"params": [p for (_, p), d in zip(named, decayed) if not d], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=adam_eps)


def cpo_reference_run(*, model_dir: Path, batches: list[list[TokenizedPair]], options: dict, lr: float,
                      clip_grad: float, weight_decay: float, adam_eps: float, pad_token_id: int) -> dict:
    """Train the HF model at `model_dir` (fp32) on `batches` (one global batch per step) with TRL's
    CPO loss for `options` (CPOConfig loss fields). Returns per step TRL's metrics plus "loss",
    "logits_exact/chosen", "logits_exact/rejected" (exact_logit_means) and "grad_norm" (before
    clipping), and the weights after the last step."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    policy.train()  # the parity models have no dropout; as TRL's Trainer
    recording = _Recording(policy)
    trainer = stand_in(cpo_config(**options), pad_token_id=pad_token_id)
    opt = adamw(policy, lr=lr, weight_decay=weight_decay, adam_eps=adam_eps)
    steps = []
    for pairs in batches:
        opt.zero_grad()
        batch = trl_batch(pairs, pad_token_id=pad_token_id)
        loss, metrics = trainer.get_batch_loss_metrics(recording, batch, train_eval="train")
        loss.backward()
        metrics = {"loss": float(loss.detach()), **metrics}
        metrics["logits_exact/chosen"], metrics["logits_exact/rejected"] = exact_logit_means(recording.logits, batch)
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), clip_grad if clip_grad > 0 else float("inf"))
        metrics["grad_norm"] = float(norm)
        steps.append(metrics)
        opt.step()
    weights = {n: p.detach().clone() for n, p in policy.named_parameters()}
    if policy.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return {"metrics": steps, "weights": weights}
