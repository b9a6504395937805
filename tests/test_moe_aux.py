"""--moe-aux-loss-coef: the routers' load-balancing loss (mcore_dpo/model/moe_aux.py) against
transformers' own `load_balancing_loss_func`, and on real ranks against HF
AutoModelForCausalLM(output_router_logits=True) + TRL's sum `loss + coef * aux_loss`, one
microbatch at a time; the load metrics against the HF routers' top-k counts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from mcore_dpo.model import moe_aux
from mcore_dpo.data.pairs import collate
from tests.helpers.data import make_pairs, write_prefs
from tests.helpers.models import PAD, qwen3_moe, save_hf
from tests.helpers.moe_parity import aux_job, check_aux_parity
from tests.helpers.ranks import run_ranks
from tests.helpers.ray_runs import main_in_process
from tests.helpers.reference import sequences


def test_formula_matches_transformers_value_and_gradient():
    torch.manual_seed(0)
    layers, rows, seq, experts, topk = 3, 4, 7, 6, 2
    logits = torch.randn(layers, rows * seq, experts, dtype=torch.float64, requires_grad=True)
    attention = torch.ones(rows, seq)
    attention[1, 4:] = 0
    attention[3, 2:] = 0
    expected = load_balancing_loss_func(tuple(logits.float().unbind(0)), experts, topk, attention)
    (g_expected,) = torch.autograd.grad(expected, logits)
    # The engine's token order is [s, b] (megatron-core's hidden states): permute, then flatten.
    order = torch.arange(rows * seq).reshape(rows, seq).t().reshape(-1)
    counts = prob_sums = 0
    for layer in range(layers):
        c, s = moe_aux.layer_sums(logits[layer][order], attention.t().reshape(-1), topk=topk)
        counts, prob_sums = counts + c, prob_sums + s
    ours = moe_aux.load_balancing_loss(counts, prob_sums, num_layers=layers, num_tokens=attention.sum())
    (g_ours,) = torch.autograd.grad(ours, logits)
    assert torch.allclose(ours.float(), expected, rtol=1e-6)
    assert torch.allclose(g_ours, g_expected.double(), rtol=1e-5, atol=1e-9)
    low, high = moe_aux.load_shares(torch.tensor([[2.0, 2.0, 4.0], [0.0, 1.0, 3.0]]))
    assert low.tolist() == [0.25, 0.0] and high.tolist() == [0.5, 0.75]


def test_parts_over_stages_and_tp_slices_add_up_to_the_aux_gradient():
    """moe_step's decomposition: layers split over 2 stages, the sequence over 2 tp ranks
    (router_token_mask's order); each part E/(L R)^2 sum_e C[e] S_part[e], with the total C,
    has gradients that add up to aux's; and the _AuxGradient hook hands S_part exactly that."""
    from mcore_dpo.rank.moe_step import _AuxGradient, router_token_mask

    torch.manual_seed(1)
    layers, rows, seq, experts, topk, tp = 4, 3, 8, 4, 2, 2
    logits = torch.randn(layers, seq * rows, experts, dtype=torch.float64, requires_grad=True)  # [s, b] order
    mask = torch.ones(rows, seq)
    mask[0, 5:] = 0
    mask[2, 3:] = 0
    sums = [moe_aux.layer_sums(logits[layer], mask.t().reshape(-1), topk=topk) for layer in range(layers)]
    full = moe_aux.load_balancing_loss(sum(c for c, _ in sums), sum(s for _, s in sums), num_layers=layers,
                                       num_tokens=mask.sum())
    (expected,) = torch.autograd.grad(full, logits)
    parts, total_counts = [], 0
    for stage_layers in ((0, 1), (2, 3)):
        for rank in range(tp):
            flat = router_token_mask(mask, tp=tp, tp_rank=rank)
            sliced = [logits[layer].reshape(seq, rows, experts).chunk(tp, dim=0)[rank].reshape(-1, experts)
                      for layer in stage_layers]
            c_s = [moe_aux.layer_sums(z, flat, topk=topk) for z in sliced]
            total_counts = total_counts + sum(c for c, _ in c_s)
            parts.append(sum(s for _, s in c_s))
    scale = experts / (layers * mask.sum()) ** 2
    output = torch.zeros(3, requires_grad=True)
    outs = [_AuxGradient.apply(output, part, lambda: scale * total_counts) for part in parts]
    torch.autograd.backward(outs, grad_tensors=[torch.ones(3)] * len(outs))
    assert torch.allclose(logits.grad, expected, rtol=1e-12, atol=1e-15)
    assert torch.equal(output.grad, torch.full((3,), float(len(outs))))  # the output's own gradient passes through


def test_real_token_mask_is_the_attention_mask_of_the_collated_rows():
    pairs = make_pairs(6, seed=3)
    micro = collate(pairs, pad_token_id=PAD, seq_len=max(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))
                                                          for p in pairs) + 3)
    _, attention, _ = sequences(pairs)
    mask = moe_aux.real_token_mask(micro.loss_mask)
    assert torch.equal(mask[:, :attention.shape[1]], attention.float()) and not mask[:, attention.shape[1]:].any()


# --------------------------------------------------------------------------- parity on real ranks
@pytest.mark.parametrize("layout", [(1, 1, 1, 1), (1, 1, 2, 2)], ids=["single-rank", "dp2-ep2"])
def test_parity_with_aux_loss(moe_models, tmp_path, layout):
    """Every metric (aux_loss and the load shares too) and every gradient, 2 steps, 1e-5. At tp 2
    (sequence parallel) and at pp 2 it runs in tests/test_moe.py, in those layouts' launches."""
    tp, pp, dp, ep = layout
    job = aux_job(layout, *moe_models["qwen3_moe"])
    run_ranks(world_size=tp * pp * dp, jobs=[job], out_dir=tmp_path)
    check_aux_parity(tmp_path, 0, job, layout, router_effect=True)


# --------------------------------------------------------------------------- the flag, from the command line
def test_flag_parses_and_defaults_from_the_model_config():
    from mcore_dpo.command_line import build_parser
    from mcore_dpo.config import TrainConfig

    assert build_parser().parse_args(["--moe-aux-loss-coef", "0.02"]).moe_aux_loss_coef == 0.02
    assert build_parser().parse_args([]).moe_aux_loss_coef is None
    config = TrainConfig()
    assert config.moe_aux_loss_coef is None
    assert config.resolve_moe_aux_loss_coef(num_experts=4, default=0.001, source="c") == 0.001  # the HF config's
    assert TrainConfig(moe_aux_loss_coef=0.0).resolve_moe_aux_loss_coef(num_experts=4, default=0.001, source="c") == 0


@pytest.mark.parametrize("flags,message", [
    (["--moe-aux-loss-coef", "0.01", "--packing"], "packing: cannot serve the MoE load-balancing loss"),
    (["--moe-aux-loss-coef", "-1"], "moe_aux_loss_coef: must be >= 0, got -1.0"),
    (["--tp", "2", "--no-sequence-parallel"], "describes a mixture-of-experts model, which needs sequence "
                                              "parallelism at tp 2 > 1 (drop --no-sequence-parallel)"),
    (["--lora-rank", "4", "--moe-grouped-gemm"], "moe_grouped_gemm: not with LoRA (the adapters hook each expert's "
                                                 "own linear; LoRA runs sequential experts, drop --moe-grouped-gemm)"),
], ids=["packing", "negative", "tp2-without-sequence-parallel", "lora-with-grouped-gemm"])
def test_train_cli_refuses_in_one_line(moe_models, tmp_path, capsys, flags, message):
    import ray

    from mcore_dpo.train import main

    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i} w4", "chosen": " w5", "rejected": " w6"}) + "\n"
                            for i in range(3, 30)))
    code = main(["--model", str(moe_models["qwen3_moe"][0]), "--data", str(data), "--output-dir", str(tmp_path / "out"),
                 "--no-export-hf", "--save-interval", "0", "--save-interval-min", "0", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert message in err, err
    assert not ray.is_initialized(), "a worker group was started before the input was checked"


def test_train_cli_default_coef_from_the_model_config_and_metrics_jsonl(tmp_path, ray_cluster):
    """Through the command line (in this process; Ray, one rank): with no flag the coefficient is the
    model config's router_aux_loss_coef (output_router_logits is true), written to the resolved
    config.yaml; metrics.jsonl holds aux_loss and the load shares of every MoE layer. Packing,
    left unset, falls back to padded microbatches for the aux loss: one line at startup,
    `packing: false` in config.yaml, 2 microbatches of 2 pairs per step. --moe-grouped-gemm on ranks
    without Transformer Engine: one line, and the run goes on with sequential experts."""
    import yaml

    model = save_hf(qwen3_moe(seed=5, output_router_logits=True, router_aux_loss_coef=0.03), tmp_path / "model")
    data = write_prefs(tmp_path / "prefs.jsonl", [{"prompt": f"w{i} w4 w{i + 7}", "chosen": f" w5 w{i}", "rejected": " w6"}
                                                  for i in range(3, 20)])
    out = tmp_path / "out"
    result = main_in_process(["--model", str(model), "--data", str(data), "--output-dir", str(out), "--max-steps", "2",
                              "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-interval", "0",
                              "--no-export-hf", "--save-interval", "0", "--save-interval-min", "0",
                              "--no-distributed-optimizer", "--moe-grouped-gemm"], cluster=ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["moe_aux_loss_coef"] == 0.03 and resolved["packing"] is False
    # config.yaml says what ran (sequential experts); the note says why the request was not met.
    assert resolved["moe_grouped_gemm"] is False
    grouped = [line for line in result.stdout.splitlines() if line.startswith("moe_grouped_gemm: ")]
    assert grouped == ["moe_grouped_gemm: Transformer Engine is not importable on the ranks (grouped GEMM needs it "
                       "and a GPU); running sequential experts"], result.stdout
    notes = [line for line in result.stdout.splitlines() if line.startswith("packing: ")]
    assert notes == ["packing: off for the MoE load-balancing loss (a mean over microbatches, which packing composes "
                     "differently than --micro-batch-size does); running padded microbatches of 2 pairs (--no-packing "
                     "asks for them explicitly)"], result.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["microbatches"] == 2
        assert 0 < row["aux_loss"] <= 4  # E * sum_e f_e P_e <= E * max_e f_e, f_e <= 1; 2 (= k) when balanced
        assert 0 <= row["moe/load_min"] <= 0.25 <= row["moe/load_max"] <= 1
        assert {f"moe/load_min/layer{i}" for i in (0, 1)} <= set(row)
