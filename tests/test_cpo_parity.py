"""`--objective cpo` through the command line against TRL 1.16's CPOTrainer: the run, the
reference and the comparisons are tests/helpers/trl_parity.py's (steps 1 and 2 within 1e-5,
relative: loss, rewards/*, logps/*, nll_loss, grad_norm; logits/* against the exact completion-token
mean; every tensor of OUTPUT/hf within 1e-5 of its largest entry).

Layouts x loss types: sigmoid with label smoothing at (1,1,1); simpo at tp 2 x pp 2; ipo with
cpo_alpha 0.5 at pp 2 x dp 2; hinge with a negative AlphaPO shape, packed, at (1,1,1); alphapo,
packed, at pp 2 x dp 2 (the pairs split over dp ranks by tokens); LoRA (a fresh adapter on every
target, against PEFT) at tp 2; the Qwen3-MoE parity model at dp 2 x ep 2 (the experts split over
the ranks). Then the refusals of the options that do not fit the objective, in one line each.
"""

from __future__ import annotations

import pytest

from tests.helpers.cli import train_input_error
from tests.helpers.trl_parity import Run, check_run

RUNS = {
    "sigmoid-smoothed-tp1pp1dp1": Run((1, 1, 1), {"loss_type": "sigmoid", "label_smoothing": 0.1}),
    "simpo-tp2pp2dp1": Run((2, 2, 1), {"loss_type": "simpo", "simpo_gamma": 0.7, "beta": 2.0}),
    "ipo-tp1pp2dp2": Run((1, 2, 2), {"loss_type": "ipo", "beta": 0.3, "cpo_alpha": 0.5}),
    "hinge-alpha-packed-tp1pp1dp1": Run((1, 1, 1), {"loss_type": "hinge", "beta": 0.2, "alpha": -0.3}, packed=True),
    "alphapo-packed-tp1pp2dp2": Run((1, 2, 2), {"loss_type": "alphapo", "beta": 2.0, "alpha": 0.25}, packed=True),
    "sigmoid-lora-tp2pp1dp1": Run((2, 1, 1), {"loss_type": "sigmoid", "beta": 0.5}, lora=True),
    "simpo-moe-tp1pp1dp2ep2": Run((1, 1, 2, 2), {"loss_type": "simpo", "beta": 2.0}, model="qwen3_moe"),
}


@pytest.mark.parametrize("name", RUNS)
def test_cpo_through_the_command_line_matches_trl(name, trl_parity, tmp_path):
    run = RUNS[name]
    rows = check_run("cpo", name, run, setup=trl_parity, tmp_path=tmp_path)
    # The NLL is there unless alphapo drops it.
    assert (rows[0]["nll_loss"] == 0.0) == (run.options["loss_type"] == "alphapo"), rows[0]


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
