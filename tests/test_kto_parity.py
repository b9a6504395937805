"""`--objective kto` through the command line against TRL 1.16's KTOTrainer (tests/helpers/trl_kto.py).

Each run is the real command line in this process on the session's Ray cluster
(`main_in_process`): the Llama (or Qwen3-MoE) parity policy against its reference (--ref-model), a JSONL of
unpaired text rows {prompt, completion, label} or of pairs written here, file order
(--no-shuffle), 2 steps of 8 samples in microbatches of 2 (or packed), fp32, the parity tests'
learning rate, Adam epsilon, clipping and weight decay, the export to OUTPUT/hf. The reference
prepares the same file with TRL's own `_prepare_dataset` (unpairing, tokenization, KL
completions by chunks of per_device_train_batch_size = --micro-batch-size) and collator, and
trains the HF model with TRL's `_compute_loss`, one global batch per step.

First the token store against TRL's prepared rows: the same prompt, completion and KL
completion ids (each cut to --max-length with the prompt, as TRL's collator cuts) and labels,
in the same order. Then at steps 1 and 2 within RTOL (relative): every metric TRL logs but
entropy and num_tokens (loss, kl, rewards/*, logps/*, logits/*) and grad_norm, the rewards
relative to β·|logps/*| and kl to at least |logps/*| (they are differences of fp32 log-prob
sums, `_scale`); then every
tensor of OUTPUT/hf against the reference's weights after step 2, within RTOL of the tensor's
largest entry.

Runs: kto with both weights, the reference precomputed, at (1,1,1); apo_zero_unpaired, the
reference sequential, at tp 2 x pp 2; kto on a paired file
(unpaired as TRL does: a step of desirable samples, then one of undesirable ones), packed (the
samples split over microbatches and dp ranks by tokens, the KL pairing still TRL's), at pp 2 x
dp 2, the reference interleaved; kto with LoRA (a fresh adapter on every target, against PEFT:
no --ref-model, the reference the policy with its adapter disabled, as TRL's under PEFT; the
merged weights exported) at pp 2, interleaved; kto on a paired file on the Qwen3-MoE parity
model (its load-balancing loss off, the engine's default) at dp 2 x ep 2 (the experts split over
the ranks), the reference sequential. Then the one-line refusals of bad unpaired rows and of
options.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from mcore_dpo.data.pairs import data_notes
from mcore_dpo.data.store import open_or_build
from mcore_dpo.data.unpaired import Unpaired
from tests.helpers.cli import train_input_error
from tests.helpers import trl_parity
from tests.helpers.models import PAD
from tests.helpers.preference_runs import ADAM_EPS, CLIP, LR, WD, run_argv, text_pairs
from tests.helpers.ray_runs import main_in_process
from tests.helpers.reference import assert_close, assert_exported_weights
from tests.helpers.trl_kto import kto_reference_run, trl_samples
from tests.helpers.trl_parity import LORA, LORA_ADAM_EPS

RTOL = 1e-5
STEPS, GLOBAL_BATCH, MICRO_BATCH = 2, 8, 2
MAX_LENGTH = 14  # a prompt of up to 9 tokens and completions of up to 9: some are cut
PACKED = ["--packing", "--max-tokens-per-microbatch", "40"]
FLAGS = {"loss_type": "--loss-type", "beta": "--beta", "desirable_weight": "--desirable-weight",
         "undesirable_weight": "--undesirable-weight"}



@dataclasses.dataclass(frozen=True)
class Run(trl_parity.Run):
    """One command-line run against TRL: trl_parity's (layout, KTOConfig's loss options, packed,
    model, lora: then no --ref-model) and the file and the reference mode."""

    ref_mode: str = "interleaved"
    paired: bool = False


RUNS = {
    "kto-weighted-precomputed-tp1pp1dp1": Run((1, 1, 1), {"loss_type": "kto", "beta": 0.5, "desirable_weight": 1.3,
                                                          "undesirable_weight": 0.8}, ref_mode="precomputed"),
    "apo-sequential-tp2pp2dp1": Run((2, 2, 1), {"loss_type": "apo_zero_unpaired", "beta": 0.3,
                                                "undesirable_weight": 1.5}, ref_mode="sequential"),
    "kto-paired-packed-tp1pp2dp2": Run((1, 2, 2), {"loss_type": "kto", "beta": 0.2}, packed=True, paired=True),
    # A fresh adapter: the KL estimate is 0 at step 1 (the policy is its reference), > 0 at step 2.
    "kto-lora-tp1pp2dp1": Run((1, 2, 1), {"loss_type": "kto", "beta": 0.5, "desirable_weight": 1.3}, lora=True),
    # The paired file: on the unpaired one the two MoE models' KL estimate is clamped to 0 at both steps.
    "kto-moe-paired-tp1pp1dp2ep2": Run((1, 1, 2, 2), {"loss_type": "kto", "beta": 0.3, "undesirable_weight": 1.2},
                                       model="qwen3_moe", ref_mode="sequential", paired=True),
    # two model chunks per pipeline rank (--vpp 2)
    "kto-interleaved-vpp2-tp1pp2dp1": Run((1, 2, 1), {"loss_type": "kto", "beta": 0.2}, engine={"vpp": 2}),
}


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(3, 100)}" for _ in range(n))


def _unpaired_rows(num: int, *, seed: int) -> list[dict]:
    """Text rows of the parity tokenizer's words: 1-8 prompt words, 1-8 completion words, mixed labels."""
    rng = random.Random(seed)
    return [{"prompt": _words(rng, rng.randint(1, 8)), "completion": " " + _words(rng, rng.randint(1, 8)),
             "label": rng.random() < 0.5, "id": i} for i in range(num)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[bool, tuple[Path, list[dict]]]:
    root = tmp_path_factory.mktemp("kto_data")
    out = {}
    for paired, rows in ((False, _unpaired_rows(STEPS * GLOBAL_BATCH, seed=5)),
                         (True, text_pairs(STEPS * GLOBAL_BATCH // 2, seed=13))):  # a seed with kl > 0
        path = root / ("pairs.jsonl" if paired else "unpaired.jsonl")
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        out[paired] = (path, rows)
    return out


def _trl_samples(parity_models, files, *, paired: bool, loss_type: str) -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(str(parity_models["llama"][0]))
    return trl_samples(files[paired][1], tokenizer=tokenizer, loss_type=loss_type, max_length=MAX_LENGTH,
                       micro_batch_size=MICRO_BATCH)


@pytest.mark.parametrize("paired, loss_type", [(False, "kto"), (True, "kto"), (False, "apo_zero_unpaired")],
                         ids=["kto-unpaired", "kto-paired", "apo-unpaired"])
def test_the_token_store_holds_trls_samples(paired, loss_type, parity_models, files, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(parity_models["llama"][0]))
    theirs = _trl_samples(parity_models, files, paired=paired, loss_type=loss_type)
    kl = loss_type == "kto"
    store = open_or_build([str(files[paired][0])], tokenizer_dir=None, tokenizer=tokenizer, max_length=MAX_LENGTH,
                          cache_dir=tmp_path, workers=1, log=lambda _line: None,
                          unpaired=Unpaired(kl_batch_size=MICRO_BATCH if kl else None))
    assert len(store) == len(theirs) == STEPS * GLOBAL_BATCH
    cut = 0
    for i, (ours, row) in enumerate(zip(store, theirs)):
        budget = MAX_LENGTH - len(row["prompt_ids"])
        cut += len(row["completion_ids"]) > budget
        expected = (tuple(row["prompt_ids"]), tuple(row["completion_ids"][:budget]),
                    tuple((row["KL_completion_ids"] if kl else row["completion_ids"])[:budget]), row["label"])
        assert (ours.prompt_ids, ours.chosen_ids, ours.rejected_ids, ours.label) == expected, i
    assert cut > 0  # MAX_LENGTH cuts some completions
    if paired:  # TRL's order: the desirable rows of the chunk, then its undesirable ones, each with its line
        assert [s.source_line for s in store] == [*range(1, 9), *range(1, 9)]
    else:
        notes = data_notes("unpaired.jsonl", store.stats[0], max_length=MAX_LENGTH)
        assert "ignoring unused column(s) 'id' (recognised: prompt, completion, label)" in notes[0], notes


def _argv(models, data_path: Path, out: Path, run: Run) -> list[str]:
    argv = run_argv(model=models[0], data=data_path, out=out, objective="kto", layout=run.layout, steps=STEPS,
                    global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH,
                    adam_eps=LORA_ADAM_EPS if run.lora else ADAM_EPS)
    argv += [*([] if run.lora else ["--ref-model", str(models[1])]), "--max-length", str(MAX_LENGTH),
             "--ref-mode", run.ref_mode, *(PACKED if run.packed else ["--no-packing"]), *(LORA if run.lora else [])]
    for name, value in run.options.items():
        argv += [FLAGS[name], str(value)]
    for name, value in run.engine.items():  # engine flags TRL has no counterpart of
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def _scale(key: str, metrics: dict, *, beta: float) -> float:
    """What a metric's difference is relative to: its own size, but for the rewards, β·(p - p0),
    differences of fp32 log-prob sums ~1e3 times their size: β times the size of those sums; and
    for kl, the mean of p - p0 over the KL completions (sums of the size of logps/*), as small as
    1e-4 of those sums where the policy is near its reference (a fresh LoRA adapter's step 2): at
    least the size of those sums (of the labels the step has: a paired file's steps have one)."""
    if key == "kl":
        return max(abs(metrics.get(k, 0.0)) for k in ("kl", "logps/chosen", "logps/rejected"))
    sides = {"rewards/chosen": ("chosen",), "rewards/rejected": ("rejected",),
             "rewards/margins": ("chosen", "rejected")}.get(key)
    if sides is None:
        return abs(metrics[key])
    return beta * max(abs(metrics[f"logps/{side}"]) for side in sides)


@pytest.mark.parametrize("name", RUNS)
def test_kto_through_the_command_line_matches_trl(name, parity_models, moe_models, files, ray_cluster, tmp_path):
    run = RUNS[name]
    options, paired = run.options, run.paired
    models = {**parity_models, **moe_models}[run.model]
    out = tmp_path / "run"
    result = main_in_process(_argv(models, files[paired][0], out, run), cluster=ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    tp, pp, dp, *ep = run.layout
    assert (resolved["objective"], resolved["ref_mode"], resolved["tp"], resolved["pp"], resolved["dp"],
            resolved["ep"]) == ("kto", run.ref_mode, tp, pp, dp, ep[0] if ep else 1), resolved
    assert resolved["packing"] is run.packed and (resolved["lora_rank"] is not None) is run.lora, resolved
    assert all(resolved[key] == value for key, value in {**options, **run.engine}.items()), resolved
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))

    samples = _trl_samples(parity_models, files, paired=paired, loss_type=options["loss_type"])
    batches = [samples[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(STEPS)]
    ref = kto_reference_run(model_dir=models[0], ref_dir=None if run.lora else models[1], batches=batches,
                            options=options, max_length=MAX_LENGTH, lr=LR, clip_grad=CLIP, weight_decay=WD,
                            adam_eps=LORA_ADAM_EPS if run.lora else ADAM_EPS, pad_token_id=PAD, lora=run.lora)
    worst: dict[str, float] = {}
    for step, (ours, theirs) in enumerate(zip(rows, ref["metrics"]), start=1):
        keys = sorted(set(theirs) - {"entropy", "num_tokens"})
        assert set(keys) - {"grad_norm"} <= set(ours), (keys, sorted(ours))
        for key in keys:
            what = f"{name} step {step} {key}: ours {ours[key]!r}, TRL {theirs[key]!r}"
            scale = _scale(key, theirs, beta=options["beta"])
            assert_close(_scalar(ours[key]), _scalar(theirs[key]), what=what, rtol=RTOL, scale=scale)
            worst[key] = max(worst.get(key, 0.0), abs(ours[key] - theirs[key]) / max(scale, 1e-30))
    # kto's KL estimate is not clamped to 0 at every step; apo_zero_unpaired logs 0, as TRL.
    assert any(row["kl"] > 0 for row in rows) == (options["loss_type"] == "kto"), (
        [row["kl"] for row in rows], [m["kl"] for m in ref["metrics"]])
    worst["weights"] = assert_exported_weights(out / "hf", ref["weights"], initial=models[0], what=name, rtol=RTOL)
    print(f"\n{name}: largest relative differences " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


# --------------------------------------------------------------------------- the door
@pytest.mark.parametrize("row, expected", [
    ({"prompt": "w3", "completion": " w4"}, ":1: missing key 'label'"),
    ({"prompt": "w3", "completion": " w4", "label": "yes"}, ":1: 'label' must be true or false, got str 'yes'"),
    ({"prompt": "w3", "completion": " w4", "label": 1}, ":1: 'label' must be true or false, got int 1"),
    ({"prompt": "w3", "completion": "", "label": True}, ":1: 'completion' is an empty string"),
], ids=["missing-label", "string-label", "int-label", "empty-completion"])
def test_bad_unpaired_rows_are_refused_in_one_line(row, expected, parity_models, capsys, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(row) + "\n")
    err = train_input_error(capsys, ["--model", str(parity_models["llama"][0]), "--data", str(data), "--objective",
                                     "kto", "--no-shuffle", "--output-dir", str(tmp_path / "out"),
                                     "--data-cache", str(tmp_path / "cache")])
    assert f"{data}{expected}" in err, err


@pytest.mark.parametrize("argv, expected", [
    (["--objective", "kto", "--loss-type", "sigmoid_norm"],
     "loss_type: unknown 'sigmoid_norm'; choose from kto, apo_zero_unpaired"),
    (["--objective", "kto"], "no_shuffle: kto's KL sequences pair neighbouring samples"),
    (["--objective", "kto", "--no-shuffle", "--micro-batch-size", "1"], "micro_batch_size: kto's KL sequences"),
    (["--desirable-weight", "2"], "desirable_weight: an option of --objective kto, not of dpo"),
    (["--objective", "kto", "--loss-type", "apo_zero_unpaired", "--desirable-weight", "0", "--undesirable-weight",
      "0"], "desirable_weight: both weights are 0"),
    (["--objective", "kto", "--no-shuffle", "--ref-mode", "none"], "ref_mode"),
], ids=["loss-type", "shuffle", "micro-batch-1", "weight-with-dpo", "zero-weights", "reference-free"])
def test_options_that_do_not_fit_are_refused_in_one_line(argv, expected, capsys, tmp_path):
    err = train_input_error(capsys, [*argv, "--output-dir", str(tmp_path / "out")])
    assert expected in err, err
    assert not (tmp_path / "out").exists()
