"""TRL 1.16's KTOTrainer as the reference of `--objective kto` (tests/test_kto_parity.py).

The data comes from TRL's own `KTOTrainer._prepare_dataset` (prompt extraction, unpairing,
EOS, tokenization, the prompt cut, dropped prompts, KL completions rotated within chunks of
per_device_train_batch_size) and its `DataCollatorForUnpairedPreference` (max_length cut,
padding); the loss, its gradient and the metrics from its own `_compute_loss` and
`_compute_kl_logps`, called unbound on a SimpleNamespace standing in for the trainer with the
attributes `KTOTrainer.__init__` sets, on Hugging Face models in fp32 given TRL's fused LM head
(`add_fused_lm_head`, as `__init__` adds it: on the base model under PEFT). For a LoRA run the
policy is tests/helpers/trl_parity.py's `reference_model` (PEFT with the fresh adapter the engine
draws) and there is no reference model: TRL's `_compute_loss` then scores the reference with the
adapter disabled, and the weights at the end are PEFT's merged ones. A MoE model's weights are
compared under their hub names (trl_parity's `hub_weights`); its load-balancing loss is off in
both (KTOConfig's router_aux_loss_coef 0.0, the engine's default for a config without
output_router_logits). Around them, what the engine does and TRL's Trainer would do otherwise:
one whole global batch per forward call (so TRL's per-call KL estimate and means are the global
batch's; its KL pairing still follows the per-device chunks), torch's clip_grad_norm_ and AdamW
with the engine's conventions (tests/helpers/reference.py `engine_adamw`) over the trainable
parameters.

Nothing here comes from mcore_dpo's objective code: a bug there cannot hide in the reference.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from types import MethodType, SimpleNamespace

import torch

from checkpoint_convert.io import open_hf_dir
from tests.helpers.reference import engine_adamw
from tests.helpers.trl_parity import hub_weights, reference_model

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "logits/chosen", "logits/rejected")


def trl_samples(rows: list[dict], *, tokenizer, loss_type: str, max_length: int, micro_batch_size: int) -> list[dict]:
    """The rows (paired or unpaired) as TRL 1.16's KTOTrainer trains them, in its order: dicts
    with prompt_ids, completion_ids, label and (kto) KL_completion_ids."""
    from datasets import Dataset
    from trl import KTOTrainer

    trainer = SimpleNamespace(_tokenizer=tokenizer, calculate_KL=loss_type != "apo_zero_unpaired",
                              desirable_weight=1.0, undesirable_weight=1.0)
    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, per_device_train_batch_size=micro_batch_size)
    prepared = KTOTrainer._prepare_dataset(trainer, Dataset.from_list(rows), tokenizer, args, "train")
    return [dict(row) for row in prepared]


def _stand_in(policy, reference, *, options: dict) -> SimpleNamespace:
    """`reference` None: the policy is a PEFT model, its reference the policy with the adapter
    disabled (as KTOTrainer.__init__ leaves ref_model None under PEFT)."""
    from trl import KTOTrainer

    # KTOTrainer.__init__'s aux switch with KTOConfig(router_aux_loss_coef=0.0): off, as the engine's default
    text_config = policy.config.get_text_config()
    router_aux_loss_coef = 0.0
    trainer = SimpleNamespace(
        model=policy, ref_model=reference, beta=options.get("beta", 0.1), loss_type=options.get("loss_type", "kto"),
        desirable_weight=options.get("desirable_weight", 1.0),
        undesirable_weight=options.get("undesirable_weight", 1.0), router_aux_loss_coef=router_aux_loss_coef,
        aux_loss_enabled=hasattr(text_config, "output_router_logits") and router_aux_loss_coef != 0.0,
        precompute_ref_logps=False, _tp_size=1, _total_train_tokens=0,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda tensor: tensor,
                                    unwrap_model=lambda model: model),
    )
    trainer.calculate_KL = trainer.loss_type != "apo_zero_unpaired"
    for name in ("_compute_loss", "_compute_kl_logps"):
        setattr(trainer, name, MethodType(getattr(KTOTrainer, name), trainer))
    return trainer


def kto_reference_run(*, model_dir: Path, ref_dir: Path | None, batches: list[list[dict]], options: dict,
                      max_length: int, lr: float, clip_grad: float, weight_decay: float, adam_eps: float,
                      pad_token_id: int, lora: bool = False) -> dict:
    """Train the HF model at `model_dir` (fp32; with `lora`, under PEFT with the engine's fresh
    adapter and no `ref_dir`) against the frozen one at `ref_dir` on `batches` (trl_samples, one
    global batch per step) with TRL's KTO loss for `options` (KTOConfig loss fields). Returns per
    step TRL's metrics plus "grad_norm" (before clipping), and the weights after the last step under
    the hub's names (a PEFT model's merged)."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference
    from trl.trainer.utils import add_fused_lm_head

    assert (ref_dir is None) is lora
    policy = reference_model(model_dir, lora=lora)
    policy.train()  # the parity models have no dropout; as TRL's Trainer
    add_fused_lm_head(policy.get_base_model() if lora else policy, outputs=("log_probs", "entropy", "mean_logits"))
    reference = None
    if not lora:
        reference = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()
        add_fused_lm_head(reference)
    trainer = _stand_in(policy, reference, options=options)
    assert not trainer.aux_loss_enabled
    collate = DataCollatorForUnpairedPreference(pad_token_id=pad_token_id, max_length=max_length)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    opt = engine_adamw(policy, lr=lr, weight_decay=weight_decay, adam_eps=adam_eps)  # frozen (LoRA base): no step
    steps = []
    for samples in batches:
        opt.zero_grad()
        loss = trainer._compute_loss(policy, collate.torch_call(samples), return_outputs=False)
        loss.backward()
        metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
        metrics["loss"] = float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(trainable, clip_grad if clip_grad > 0 else float("inf"))
        metrics["grad_norm"] = float(norm)
        steps.append(metrics)
        trainer._metrics["train"].clear()
        opt.step()
    merged = policy.merge_and_unload() if lora else policy
    return {"metrics": steps, "weights": hub_weights(merged, spec=open_hf_dir(model_dir).spec)}
