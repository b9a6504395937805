"""TRL 1.16's CPOTrainer and ORPOTrainer as the references of `--objective cpo` and
`--objective orpo` through the command line (tests/test_cpo_parity.py, tests/test_orpo_parity.py).

The reference: the loss, its gradient and the metrics come from TRL's own methods
(`get_batch_loss_metrics`, which calls `concatenated_inputs`, `concatenated_forward`,
`get_batch_logps` and `cpo_loss` / `odds_ratio_loss`), called unbound on a SimpleNamespace
standing in for the trainer: it carries the attributes the trainer's `__init__` sets from its
config (TRL's defaults, the options given on top, and `CPOConfig.__post_init__`'s alphapo
mapping) and from the model's config (the MoE aux loss: on only with `output_router_logits`,
off for the parity models, as the engine's default --moe-aux-loss-coef). Around them, what the
engine does and TRL's Trainer would do otherwise: the Hugging Face model in fp32 (wrapped by
PEFT for a LoRA run: a fresh adapter as the engine draws it, the merged weights at the end), one
whole global batch per step (so TRL's per-device means are global-batch means), torch's
clip_grad_norm_ and AdamW with the engine's conventions (decay on matrices only;
tests/helpers/reference.py) over the trainable parameters.

The run: the real command line in this process on the session's Ray cluster
(`main_in_process`), a JSONL of text pairs (`write_pairs`: file order, --no-shuffle), STEPS steps
of GLOBAL_BATCH pairs in microbatches of MICRO_BATCH (or packed), fp32, the parity tests'
learning rate, clipping and weight decay, the export to OUTPUT/hf. The reference reads the same
file through the engine's loader (`load_pairs`, the token store's single-process reference) and
builds TRL's decoder-only batches from those ids.

`check_run` compares at every step within RTOL (relative; a metric that is a difference of
two others relative to their size, DIFFERENCES): loss, rewards/*, logps/*, grad_norm and the
objective's own metrics under TRL's names; logits/* against the exact mean over the
completion tokens of the vocabulary-mean logit of the reference's logits (TRL averages the
whole padded tensor instead); then every tensor of OUTPUT/hf against the reference's weights
after the last step, within RTOL of the tensor's largest entry.

Nothing here comes from mcore_dpo's objective code: a bug there cannot hide in the reference.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from pathlib import Path
from types import MethodType, SimpleNamespace
from unittest import mock

import torch
import yaml

from checkpoint_convert.gather import fused_hf_sources
from checkpoint_convert.io import open_hf_dir
from mcore_dpo.data.pairs import TokenizedPair
from tests.helpers.models import PAD, hub_tensors
from tests.helpers.moe_parity import hub_experts
from tests.helpers.preference_runs import ADAM_EPS, CLIP, LR, WD, run_argv, text_pairs
from tests.helpers.ray_runs import main_in_process
from tests.helpers.reference import assert_close, assert_exported_weights, engine_adamw

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# tests/test_parity_losses.py's optimizer settings
# A fresh adapter's step 2 reads step 1's B = -lr·g/(|g| + eps): tests/helpers/lora_parity.py's eps.
LORA_ADAM_EPS = 1e-2
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.0"]  # every target: lora_parity.SHAPE
RTOL = 1e-5
STEPS, GLOBAL_BATCH, MICRO_BATCH = 2, 8, 2
MAX_LENGTH = 20  # the rows have at most 1 + 8 + 8 + 1 tokens
# Packed microbatches of at most 40 tokens: a step's 8 pairs take several.
PACKED = ["--packing", "--max-length", str(MAX_LENGTH), "--max-tokens-per-microbatch", "40"]
# The metrics both trainers log under these names; logits/* are compared to the exact token means.
COMMON_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                  "logps/chosen", "logps/rejected", "nll_loss", "grad_norm")

# Differences of two metrics (fp32 rounds each side in both trainers): within RTOL of their size.
DIFFERENCES = {"rewards/margins": ("rewards/chosen", "rewards/rejected"),
               "log_odds_chosen": ("logps/chosen", "logps/rejected")}


@dataclasses.dataclass(frozen=True)
class Trainer:
    """What tests/helpers/trl_parity.py needs of one TRL trainer."""

    fields: tuple[str, ...]
    """The config fields the loss reads (each the engine's flag of the same name)."""
    loss_method: str
    """The trainer's method that turns the log-probs into the loss."""
    metrics: tuple[str, ...]
    """The metrics compared to TRL's values."""


TRAINERS = {
    "cpo": Trainer(fields=("loss_type", "beta", "label_smoothing", "cpo_alpha", "simpo_gamma", "alpha"),
                   loss_method="cpo_loss", metrics=COMMON_METRICS),
    "orpo": Trainer(fields=("beta",), loss_method="odds_ratio_loss",
                    metrics=(*COMMON_METRICS, "log_odds_ratio", "log_odds_chosen")),
}


def _trl(objective: str, what: str):
    """TRL 1.16's CPOConfig / CPOTrainer / ORPOConfig / ORPOTrainer."""
    return getattr(importlib.import_module(f"trl.experimental.{objective}"), f"{objective.upper()}{what}")


def trl_config(objective: str, **options) -> SimpleNamespace:
    """The loss fields of a `CPOConfig(**options)` / `ORPOConfig(**options)`: TRL 1.16's defaults
    for the others, then the config's own `__post_init__` (CPO's alphapo -> simpo with cpo_alpha 0),
    without TrainingArguments' own checks."""
    from trl.trainer.base_config import _BaseConfig

    fields, cls = TRAINERS[objective].fields, _trl(objective, "Config")
    unknown = set(options) - set(fields)
    assert not unknown, unknown
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name in fields}
    config = object.__new__(cls)
    for name, value in {**defaults, **options}.items():
        setattr(config, name, value)
    if "__post_init__" in vars(cls):
        with mock.patch.object(_BaseConfig, "__post_init__", lambda self: None):
            cls.__post_init__(config)
    return SimpleNamespace(**{name: getattr(config, name) for name in fields})


def stand_in(objective: str, config: SimpleNamespace, *, model_config, pad_token_id: int) -> SimpleNamespace:
    """A CPOTrainer / ORPOTrainer stand-in with the attributes its `__init__` sets from `config` and
    from the model's config, on the CPU."""
    trainer_cls, spec = _trl(objective, "Trainer"), TRAINERS[objective]
    trainer = SimpleNamespace(
        **vars(config), is_encoder_decoder=False, pad_token_id=pad_token_id, padding_value=pad_token_id,
        aux_loss_enabled=getattr(model_config, "output_router_logits", False),
        aux_loss_coef=getattr(model_config, "router_aux_loss_coef", 0.0),
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda tensor: tensor),
        concatenated_inputs=trainer_cls.concatenated_inputs, get_batch_logps=trainer_cls.get_batch_logps,
    )
    if objective == "cpo" and config.loss_type != "simpo":  # as CPOTrainer.__init__: only simpo keeps gamma
        del trainer.simpo_gamma
    for name in (spec.loss_method, "concatenated_forward", "get_batch_loss_metrics"):
        setattr(trainer, name, MethodType(getattr(trainer_cls, name), trainer))
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


def reference_model(model_dir: Path, *, lora: bool) -> torch.nn.Module:
    """The HF model at `model_dir` in fp32; with `lora`, under PEFT with the fresh adapter the
    engine draws (every target, TrainConfig's default seed)."""
    from transformers import AutoModelForCausalLM

    if not lora:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    from tests.helpers.lora_parity import fresh_peft_model

    return fresh_peft_model(model_dir)


def reference_run(objective: str, *, model: torch.nn.Module, model_dir: Path, batches: list[list[TokenizedPair]],
                  options: dict, adam_eps: float, pad_token_id: int) -> dict:
    """Train `model` (reference_model) on `batches` (one global batch per step) with TRL's loss of
    `objective` for `options` (the trainer config's loss fields). Returns per step TRL's metrics
    plus "loss", "logits_exact/chosen", "logits_exact/rejected" (exact_logit_means) and
    "grad_norm" (before clipping), and the weights after the last step as save_pretrained writes
    them (a PEFT model's merged)."""
    model.train()  # the parity models have no dropout; as TRL's Trainer
    recording = _Recording(model)
    trainer = stand_in(objective, trl_config(objective, **options), model_config=model.config,
                       pad_token_id=pad_token_id)
    assert not trainer.aux_loss_enabled  # the engine's aux loss is off by default here too
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = engine_adamw(model, lr=LR, weight_decay=WD, adam_eps=adam_eps)  # frozen (LoRA base): no grad, no step
    steps = []
    for pairs in batches:
        opt.zero_grad()
        batch = trl_batch(pairs, pad_token_id=pad_token_id)
        loss, metrics = trainer.get_batch_loss_metrics(recording, batch, train_eval="train")
        loss.backward()
        metrics = {"loss": float(loss.detach()), **metrics}
        metrics["logits_exact/chosen"], metrics["logits_exact/rejected"] = exact_logit_means(recording.logits, batch)
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_([p for _, p in named], CLIP))
        steps.append(metrics)
        opt.step()
    merged = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
    return {"metrics": steps, "weights": hub_weights(merged, spec=open_hf_dir(model_dir).spec)}


def hub_weights(model: torch.nn.Module, *, spec) -> dict[str, torch.Tensor]:
    """The weights under the names an HF checkpoint on the hub holds (OUTPUT/hf's): what
    save_pretrained writes, each expert's tensors apart."""
    tensors = hub_tensors(model)
    experts = hub_experts(tensors, spec)
    in_memory = {stored for stored, *_ in fused_hf_sources(spec, stored=set(tensors)).values()}
    return {**{k: v for k, v in tensors.items() if k not in in_memory}, **experts}


# --------------------------------------------------------------------------- the command-line run
@dataclasses.dataclass(frozen=True)
class Run:
    """One command-line run against TRL."""

    layout: tuple[int, ...]
    """(tp, pp, dp) or (tp, pp, dp, ep)."""
    options: dict
    """The trainer config's loss fields (the rest at TRL's defaults), each passed as its flag."""
    packed: bool = False
    model: str = "llama"
    """A parity_models family or a moe_models name (tests/conftest.py)."""
    lora: bool = False
    """A fresh LoRA adapter on every target, against PEFT."""
    engine: dict = dataclasses.field(default_factory=dict)
    """Engine fields that do not change what is computed (TRL has no counterpart), each passed as its flag."""


def write_pairs(directory: Path, *, tokenizer_dir: Path, seed: int) -> dict:
    """A JSONL of STEPS global batches in `directory` and its pairs as the engine tokenizes them, one
    list per step: {"path", "batches"}."""
    from transformers import AutoTokenizer

    from mcore_dpo.data.pairs import load_pairs

    path = directory / "prefs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in text_pairs(STEPS * GLOBAL_BATCH, seed=seed)))
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    pairs, stats = load_pairs(str(path), tokenizer=tokenizer, max_length=MAX_LENGTH)
    assert len(pairs) == STEPS * GLOBAL_BATCH and stats.num_truncated_pairs == 0
    assert [p.source_line for p in pairs] == list(range(1, len(pairs) + 1))
    # Both completions end in the EOS; the prompt is not empty.
    assert all(p.prompt_ids and p.chosen_ids[-1] == p.rejected_ids[-1] == tokenizer.eos_token_id for p in pairs)
    return {"path": path, "batches": [pairs[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(STEPS)]}


def argv(objective: str, run: Run, *, model: Path, data_path: Path, out: Path) -> list[str]:
    args = run_argv(model=model, data=data_path, out=out, objective=objective, layout=run.layout, steps=STEPS,
                    global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH,
                    adam_eps=LORA_ADAM_EPS if run.lora else ADAM_EPS)
    args += [*(PACKED if run.packed else ["--max-length", str(MAX_LENGTH), "--no-packing"]), *(LORA if run.lora else [])]
    for name, value in {**run.options, **run.engine}.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def _relative(ours: float, ref: float) -> float:
    return abs(ours - ref) / max(abs(ref), 1e-300) if ours != ref else 0.0


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the runs read (tests/conftest.py's `trl_parity` fixture)."""

    models: dict
    """name -> (policy dir, reference dir): the dense and the MoE parity models."""
    data: dict
    """write_pairs'."""
    cluster: object
    """The session's Ray cluster."""


def check_run(objective: str, name: str, run: Run, *, setup: Setup, tmp_path: Path) -> list[dict]:
    """`run` through the command line against TRL (module docstring). Returns the logged rows and
    prints the largest relative difference of each comparison."""
    model, data = setup.models[run.model][0], setup.data
    out = tmp_path / "run"
    result = main_in_process(argv(objective, run, model=model, data_path=data["path"], out=out),
                             cluster=setup.cluster)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    tp, pp, dp, *ep = run.layout
    assert (resolved["objective"], resolved["ref_mode"], resolved["tp"], resolved["pp"], resolved["dp"],
            resolved["ep"]) == (objective, "none", tp, pp, dp, ep[0] if ep else 1), resolved
    assert resolved["packing"] is run.packed and (resolved["lora_rank"] is not None) is run.lora, resolved
    assert all(resolved[key] == value for key, value in {**run.options, **run.engine}.items()), resolved
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))

    ref = reference_run(objective, model=reference_model(model, lora=run.lora), model_dir=model,
                        batches=data["batches"], options=run.options,
                        adam_eps=LORA_ADAM_EPS if run.lora else ADAM_EPS, pad_token_id=PAD)
    worst: dict[str, float] = {}
    for step, (ours, theirs, pairs) in enumerate(zip(rows, ref["metrics"], data["batches"]), start=1):
        # The engine read the same tokens: no reference model, every real token of the batch.
        assert ours["memory/reference_params_peak_bytes"] == 0, ours
        assert ours["tokens/real"] == sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids)
                                          for p in pairs), ours
        for key in TRAINERS[objective].metrics:
            what = f"{name} step {step} {key}: ours {ours[key]!r}, TRL {theirs[key]!r}"
            scale = max(abs(theirs[term]) for term in DIFFERENCES.get(key, (key,)))
            assert_close(torch.tensor(ours[key], dtype=torch.float64), torch.tensor(theirs[key], dtype=torch.float64),
                         what=what, rtol=RTOL, scale=scale)
            worst[key] = max(worst.get(key, 0.0), abs(ours[key] - theirs[key]) / scale if scale else 0.0)
        # A mean of near-cancelling vocabulary means (|value| ~ 1e-2 of the logits' size): the two fp32
        # forwards put it ~5e-6 apart, relative.
        for side in ("chosen", "rejected"):
            key, exact = f"logits/{side}", theirs[f"logits_exact/{side}"]
            assert_close(torch.tensor(ours[key], dtype=torch.float64), torch.tensor(exact, dtype=torch.float64),
                         what=f"{name} step {step} {key}: ours {ours[key]!r}, exact token mean {exact!r} "
                              f"(TRL's padded mean {theirs[key]!r})", rtol=RTOL)
            worst[key] = max(worst.get(key, 0.0), _relative(ours[key], exact))
    # Not degenerate: both preference outcomes occur.
    assert 0 < rows[0]["rewards/accuracies"] < 1, rows[0]

    worst["weights"] = assert_exported_weights(out / "hf", ref["weights"], initial=model, what=name, rtol=RTOL)
    print(f"\n{name}: largest relative differences " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    return rows
