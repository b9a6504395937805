"""`--objective orpo` through the command line against TRL 1.16's ORPOTrainer: the run, the
reference and the comparisons are tests/helpers/trl_parity.py's. Steps 1 and 2 within 1e-5,
relative: loss, rewards/*, logps/*, nll_loss (the token mean over the chosen sequences, prompt
and completion, all but the first token: the engine's whole_sequence log-probs), log_odds_ratio,
log_odds_chosen, grad_norm; logits/* against the exact completion-token mean; every tensor of
OUTPUT/hf within 1e-5 of its largest entry.

Layouts: (1,1,1) at TRL's default beta; tp 2 x pp 2 (the prompt's log-probs summed over tp's
vocabulary shards); pp 2 x dp 2; packed at (1,1,1) (the prompt tokens of each segment of a
packed row); LoRA (a fresh adapter on every target, against PEFT) at pp 2; the Qwen3-MoE parity
model at tp 2 (the experts' tensor-parallel split). tests/test_cpo_parity.py covers, with cpo,
packing over dp ranks, LoRA at tp 2 and MoE at dp 2 x ep 2 (the experts split over the ranks).
"""

from __future__ import annotations

import pytest

from tests.helpers.trl_parity import Run, check_run

RUNS = {
    "tp1pp1dp1": Run((1, 1, 1), {}),
    "tp2pp2dp1": Run((2, 2, 1), {"beta": 0.5}),
    "tp1pp2dp2": Run((1, 2, 2), {"beta": 2.0}),
    "packed-tp1pp1dp1": Run((1, 1, 1), {"beta": 0.3}, packed=True),
    "lora-tp1pp2dp1": Run((1, 2, 1), {"beta": 0.5}, lora=True),
    "moe-tp2pp1dp1": Run((2, 1, 1), {"beta": 0.5}, model="qwen3_moe"),
}


@pytest.mark.parametrize("name", RUNS)
def test_orpo_through_the_command_line_matches_trl(name, trl_parity, tmp_path):
    run = RUNS[name]
    rows = check_run("orpo", name, run, setup=trl_parity, tmp_path=tmp_path)
    # Both terms are in the loss: the NLL and beta times the mean log-sigmoid of the log odds.
    for row in rows:
        assert row["nll_loss"] > 0 and row["log_odds_ratio"] < 0, row
        assert abs(row["loss"] - (row["nll_loss"] - run.options.get("beta", 0.1) * row["log_odds_ratio"])) <= 1e-6, row
