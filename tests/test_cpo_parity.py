"""`--objective cpo` through the command line against TRL 1.16's CPOTrainer (tests/helpers/trl_cpo.py).

Each run is the real command line in this process on the session's Ray cluster
(`main_in_process`): the Llama parity policy, a JSONL of text pairs written here, file order
(--no-shuffle), 2 steps of 8 pairs in microbatches of 2 (or packed), fp32, the parity tests'
learning rate, Adam epsilon, clipping and weight decay, the export to OUTPUT/hf. The reference
tokenizes the same file with the engine's loader (`load_pairs`, the token store's
single-process reference), builds TRL's decoder-only batches from those ids and trains the HF
model with TRL's own `get_batch_loss_metrics`, torch's clip_grad_norm_ and AdamW, one global
batch per step.

Compared at steps 1 and 2 within RTOL (relative): loss, rewards/*, logps/*, nll_loss and
grad_norm; logits/* against the exact mean over the completion tokens of the vocabulary-mean
logit of the reference's logits (TRL averages the whole padded tensor instead); then every
tensor of OUTPUT/hf against the reference's weights after step 2, within RTOL of the tensor's
largest entry.

Layouts x loss types: sigmoid with label smoothing at (1,1,1); simpo at tp 2 x pp 2; ipo with
cpo_alpha 0.5 at pp 2 x dp 2; hinge with a negative AlphaPO shape, packed, at (1,1,1); alphapo,
packed, at pp 2 x dp 2 (the pairs split over dp ranks by tokens). Then the refusals of the
options that do not fit the objective, in one line each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoTokenizer

from mcore_dpo.data.pairs import load_pairs
from tests.helpers.cli import train_input_error
from tests.helpers.models import PAD
from tests.helpers.preference_runs import text_pairs
from tests.helpers.ray_runs import main_in_process
from tests.helpers.reference import assert_close
from tests.helpers.trl_cpo import cpo_reference_run

# tests/test_parity_losses.py's optimizer settings
LR, CLIP, WD, ADAM_EPS = 1e-3, 1.0, 0.1, 1e-4
RTOL = 1e-5
STEPS, GLOBAL_BATCH, MICRO_BATCH = 2, 8, 2
MAX_LENGTH = 20  # the rows have at most 1 + 8 + 8 + 1 tokens
# Packed microbatches of at most 40 tokens: a step's 8 pairs take several.
PACKED = ["--packing", "--max-length", str(MAX_LENGTH), "--max-tokens-per-microbatch", "40"]
# TRL's metric names; logits/* are compared to the exact token means instead of TRL's values.
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "nll_loss", "grad_norm")
FLAGS = {"loss_type": "--loss-type", "beta": "--beta", "label_smoothing": "--label-smoothing",
         "cpo_alpha": "--cpo-alpha", "simpo_gamma": "--simpo-gamma", "alpha": "--alpha"}

# name -> ((tp, pp, dp), CPOConfig loss options (the rest at TRL's defaults), packed)
RUNS = {
    "sigmoid-smoothed-tp1pp1dp1": ((1, 1, 1), {"loss_type": "sigmoid", "label_smoothing": 0.1}, False),
    "simpo-tp2pp2dp1": ((2, 2, 1), {"loss_type": "simpo", "simpo_gamma": 0.7, "beta": 2.0}, False),
    "ipo-tp1pp2dp2": ((1, 2, 2), {"loss_type": "ipo", "beta": 0.3, "cpo_alpha": 0.5}, False),
    "hinge-alpha-packed-tp1pp1dp1": ((1, 1, 1), {"loss_type": "hinge", "beta": 0.2, "alpha": -0.3}, True),
    "alphapo-packed-tp1pp2dp2": ((1, 2, 2), {"loss_type": "alphapo", "beta": 2.0, "alpha": 0.25}, True),
}


@pytest.fixture(scope="module")
def data(parity_models, tmp_path_factory) -> dict:
    """The JSONL of STEPS global batches and its pairs as the engine tokenizes them, one list per step."""
    path = tmp_path_factory.mktemp("cpo_data") / "prefs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in text_pairs(STEPS * GLOBAL_BATCH, seed=3)))
    tokenizer = AutoTokenizer.from_pretrained(str(parity_models["llama"][0]))
    pairs, stats = load_pairs(str(path), tokenizer=tokenizer, max_length=MAX_LENGTH)
    assert len(pairs) == STEPS * GLOBAL_BATCH and stats.num_truncated_pairs == 0
    assert [p.source_line for p in pairs] == list(range(1, len(pairs) + 1))
    # Both completions end in the EOS; the prompt is not empty.
    assert all(p.prompt_ids and p.chosen_ids[-1] == p.rejected_ids[-1] == tokenizer.eos_token_id for p in pairs)
    return {"path": path, "batches": [pairs[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(STEPS)]}


def _argv(model: Path, data_path: Path, out: Path, layout, options: dict, packed: bool) -> list[str]:
    tp, pp, dp = layout
    argv = ["--model", str(model), "--data", str(data_path), "--output-dir", str(out), "--objective", "cpo",
            "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--no-shuffle", "--max-steps", str(STEPS),
            "--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", str(MICRO_BATCH), "--dtype", "float32",
            "--lr", str(LR), "--adam-eps", str(ADAM_EPS), "--clip-grad", str(CLIP), "--weight-decay", str(WD),
            "--eval-interval", "0", "--save-interval", "0", "--save-interval-min", "0", "--export-hf",
            *(PACKED if packed else ["--max-length", str(MAX_LENGTH), "--no-packing"])]
    for name, value in options.items():
        argv += [FLAGS[name], str(value)]
    return argv


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def _relative(ours: float, ref: float) -> float:
    return abs(ours - ref) / max(abs(ref), 1e-300) if ours != ref else 0.0


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.parametrize("name", RUNS)
def test_cpo_through_the_command_line_matches_trl(name, parity_models, data, ray_cluster, tmp_path):
    layout, options, packed = RUNS[name]
    model = parity_models["llama"][0]
    out = tmp_path / "run"
    result = main_in_process(_argv(model, data["path"], out, layout, options, packed), cluster=ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert (resolved["objective"], resolved["ref_mode"], resolved["tp"], resolved["pp"], resolved["dp"]) == (
        "cpo", "none", *layout)
    assert resolved["packing"] is packed and all(resolved[key] == value for key, value in options.items()), resolved
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))

    ref = cpo_reference_run(model_dir=model, batches=data["batches"], options=options, lr=LR, clip_grad=CLIP,
                            weight_decay=WD, adam_eps=ADAM_EPS, pad_token_id=PAD)
    worst: dict[str, float] = {}
    for step, (ours, theirs, pairs) in enumerate(zip(rows, ref["metrics"], data["batches"]), start=1):
        # The engine read the same tokens: no reference model, every real token of the batch.
        assert ours["memory/reference_params_peak_bytes"] == 0, ours
        assert ours["tokens/real"] == sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids)
                                          for p in pairs), ours
        for key in METRICS:
            what = f"{name} step {step} {key}: ours {ours[key]!r}, TRL {theirs[key]!r}"
            assert_close(_scalar(ours[key]), _scalar(theirs[key]), what=what, rtol=RTOL)
            worst[key] = max(worst.get(key, 0.0), _relative(ours[key], theirs[key]))
        # A mean of near-cancelling vocabulary means (|value| ~ 1e-2 of the logits' size): the two fp32
        # forwards put it ~5e-6 apart, relative (tests/helpers/trl_cpo.exact_logit_means).
        for side in ("chosen", "rejected"):
            key, exact = f"logits/{side}", theirs[f"logits_exact/{side}"]
            assert_close(_scalar(ours[key]), _scalar(exact), what=f"{name} step {step} {key}: ours "
                         f"{ours[key]!r}, exact token mean {exact!r} (TRL's padded mean {theirs[key]!r})", rtol=RTOL)
            worst[key] = max(worst.get(key, 0.0), _relative(ours[key], exact))
    # Not degenerate: both preference outcomes occur, and the NLL is there unless alphapo drops it.
    assert 0 < rows[0]["rewards/accuracies"] < 1, rows[0]
    assert (rows[0]["nll_loss"] == 0.0) == (options["loss_type"] == "alphapo"), rows[0]

    trained = _weights(out / "hf")
    assert set(trained) == set(ref["weights"])
    initial = _weights(model)
    moved = 0.0
    for key, expected in ref["weights"].items():
        scale = expected.abs().max().item()
        assert_close(trained[key], expected, what=f"{name} weights {key}", rtol=RTOL)
        worst["weights"] = max(worst.get("weights", 0.0),
                               (trained[key].double() - expected.double()).abs().max().item() / scale)
        moved = max(moved, (expected - initial[key]).abs().max().item() / scale)
    assert moved > 100 * RTOL, moved  # the two steps moved the weights far beyond the tolerance
    print(f"\n{name}: largest relative differences " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


# --------------------------------------------------------------------------- the door
@pytest.mark.parametrize("argv, expected", [
    (["--objective", "cpo", "--ref-mode", "precomputed"],
     "ref_mode: cpo is reference-free (no reference model runs); --ref-mode precomputed does not apply"),
    (["--objective", "cpo", "--loss-type", "aot"],
     "loss_type: unknown 'aot'; choose from sigmoid, hinge, ipo, simpo, alphapo"),
    (["--cpo-alpha", "0.5"], "cpo_alpha: an option of --objective cpo, not of dpo"),
    (["--simpo-gamma", "0.7", "--loss-type", "sigmoid"], "simpo_gamma: an option of --objective cpo, not of dpo"),
    (["--objective", "cpo", "--loss-type", "hinge", "--label-smoothing", "0.1"], "label_smoothing: hinge does not read it"),
], ids=["ref-mode", "dpo-loss-type", "cpo-alpha-with-dpo", "simpo-gamma-with-dpo", "smoothing-with-hinge"])
def test_options_that_do_not_fit_are_refused_in_one_line(argv, expected, capsys, tmp_path):
    err = train_input_error(capsys, [*argv, "--output-dir", str(tmp_path / "out")])
    assert expected in err, err
    assert not (tmp_path / "out").exists()
