"""TRL 1.16's RewardTrainer as the reference of `--objective reward` (tests/test_reward_parity.py).

The loss and the metrics come from TRL's own `RewardTrainer.compute_loss`, called unbound on a
SimpleNamespace standing in for the trainer: it carries what `compute_loss` reads (`args` with
center_rewards_coefficient, `model.training`, the accelerator's gathers on one process, the token
count, `_metrics`). Around it, what the engine does and TRL's Trainer would do otherwise: the
Hugging Face `AutoModelForSequenceClassification` in fp32 (the causal LM's body and the score head
the run starts from; for a LoRA run under PEFT, `reward_model(lora=True)`), one whole global batch per step in TRL's collator layout (the b chosen rows,
then the b rejected rows, right-padded with the pad id), torch's clip_grad_norm_ and AdamW with
the engine's conventions (decay on matrices only; tests/helpers/reference.py).

Nothing here comes from mcore_dpo's objective code: a bug there cannot hide in the reference.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

from mcore_dpo.data.pairs import TokenizedPair
from tests.helpers.reference import engine_adamw

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def stand_in(*, model: torch.nn.Module, center_rewards_coefficient: float | None) -> SimpleNamespace:
    """A RewardTrainer stand-in on one CPU process, as `compute_loss` reads it."""
    return SimpleNamespace(
        model=model, args=SimpleNamespace(center_rewards_coefficient=center_rewards_coefficient),
        accelerator=SimpleNamespace(gather=lambda tensor: tensor, gather_for_metrics=lambda tensor: tensor),
        _total_train_tokens=0, _tp_size=1, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )


def reward_batch(pairs: list[TokenizedPair], *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """TRL's reward batch (DataCollatorForPreference): prompt + chosen rows, then prompt + rejected
    rows, right-padded with the pad id, the attention mask, and the pairs' margins (float32) when
    the pairs have them."""
    rows = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if pairs[0].margin is not None:
        batch["margin"] = torch.tensor([p.margin for p in pairs], dtype=torch.float)
    return batch


def reward_model(model_dir: Path, *, score: torch.Tensor, pad_token_id: int, lora: bool = False) -> torch.nn.Module:
    """The causal LM at `model_dir` as AutoModelForSequenceClassification (fp32, one label), its
    score head set to `score` [1, h]. With `lora`: under PEFT as TRL's RewardTrainer trains it with
    a LoraConfig(task_type="SEQ_CLS"): the body frozen, the fresh adapter the engine draws on every
    target (tests/helpers/lora_parity.py), the score head trained whole (PEFT's modules_to_save)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=1, dtype=torch.float32,
                                                               pad_token_id=pad_token_id)
    with torch.no_grad():
        model.score.weight.copy_(score)
    if not lora:
        return model
    from tests.helpers.lora_parity import fresh_peft_model

    return fresh_peft_model(model_dir, base=model, task_type="SEQ_CLS")


def reward_reference_run(*, model: torch.nn.Module, batches: list[list[TokenizedPair]],
                         center_rewards_coefficient: float | None, lr: float, clip_grad: float, weight_decay: float,
                         adam_eps: float, pad_token_id: int) -> dict:
    """Train `model` (a reward model) on `batches` (one global batch per step) with TRL's reward
    loss. Returns per step TRL's metrics (each the step's one value) plus "loss" and "grad_norm"
    (before clipping), and the weights after the last step."""
    from trl import RewardTrainer

    model.train()  # the parity models have no dropout; as TRL's Trainer
    trainer = stand_in(model=model, center_rewards_coefficient=center_rewards_coefficient)
    opt = engine_adamw(model, lr=lr, weight_decay=weight_decay, adam_eps=adam_eps)
    steps = []
    for pairs in batches:
        opt.zero_grad()
        for values in trainer._metrics["train"].values():
            values.clear()
        loss = RewardTrainer.compute_loss(trainer, model, reward_batch(pairs, pad_token_id=pad_token_id))
        loss.backward()
        metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
        metrics["loss"] = float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad if clip_grad > 0 else float("inf"))
        metrics["grad_norm"] = float(norm)
        steps.append(metrics)
        opt.step()
    return {"metrics": steps, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


@torch.no_grad()
def pair_rewards(model: torch.nn.Module, pairs: list[TokenizedPair], *, pad_token_id: int) -> torch.Tensor:
    """The rewards [2b] a reward model gives the pairs' chosen rows, then rejected rows."""
    model.eval()
    batch = reward_batch(pairs, pad_token_id=pad_token_id)
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
