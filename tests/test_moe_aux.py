"""--moe-aux-loss-coef: the routers' load-balancing loss (mcore_dpo/moe_aux.py) against
transformers' own `load_balancing_loss_func`, and on real ranks against HF
AutoModelForCausalLM(output_router_logits=True) + TRL's sum `loss + coef * aux_loss`, one
microbatch at a time; the load metrics against the HF routers' top-k counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import test_parity as tp_
from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mapping import hf_to_mcore_shard
from convert_helpers import save_hf
from mcore_dpo import moe_aux
from mcore_dpo.data import collate
from parity import PAD, _loss_and_metrics, _sequences, assert_close, load_rank_tensors, make_pairs, run_ranks
from test_moe import _with_hub_names, qwen3_moe
from test_qwen3 import parity_job

COEF = 0.5  # large enough that the aux term moves the router gradients well past the tolerance


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
    from mcore_dpo.moe_step import _AuxGradient, router_token_mask

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
    _, attention, _ = _sequences(pairs)
    mask = moe_aux.real_token_mask(micro.loss_mask)
    assert torch.equal(mask[:, :attention.shape[1]], attention.float()) and not mask[:, attention.shape[1]:].any()


# --------------------------------------------------------------------------- parity on real ranks
def _reference(policy_dir: str, ref_dir: str, batches, *, groups: list[list[int]], steps: int) -> dict:
    """HF forward + TRL's sigmoid loss over the global batch, plus COEF x the mean over the
    engine's microbatches (`groups`: pair positions) of the HF model's own aux_loss."""
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    params = list(policy.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": tp_.WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=tp_.LR, betas=(0.9, 0.999), eps=tp_.ADAM_EPS)
    kw = tp_._loss_kwargs("sigmoid")
    metrics, grads = [], []
    for pairs in batches[:steps]:
        opt.zero_grad()
        loss, m = _loss_and_metrics(policy, reference, pairs, loss_type="sigmoid", beta=kw["beta"],
                                    eps=kw["label_smoothing"], reference_free=False)
        aux, router = _router_metrics(policy, pairs, groups=groups)
        (loss + COEF * aux).backward()
        grads.append({n: p.grad.detach().clone() for n, p in policy.named_parameters()})
        m["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), tp_.CLIP))
        metrics.append({**m, "router": router})
        opt.step()
    return {"metrics": metrics, "grads": grads, "weights": {n: p.detach().clone() for n, p in policy.named_parameters()}}


def router_metrics(policy_dir: str, pairs, *, groups: list[list[int]]) -> dict:
    """aux_loss and the load shares of one step at the weights in `policy_dir` (HF routers)."""
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    with torch.no_grad():
        return _router_metrics(model, pairs, groups=groups)[1]


def _router_metrics(model, pairs, *, groups: list[list[int]]) -> tuple[torch.Tensor, dict]:
    """The mean over `groups` (microbatches) of the HF model's aux_loss, and the metrics."""
    topk = model.config.num_experts_per_tok
    auxes, counts = [], 0
    for group in groups:
        ids, attention, _ = _sequences([pairs[i] for i in group])
        out = model(input_ids=ids, attention_mask=attention, output_router_logits=True)
        auxes.append(out.aux_loss)
        flat = attention.reshape(-1).float()
        counts = counts + torch.stack([
            torch.zeros(logits.shape[-1]).scatter_add_(0, torch.topk(logits.detach(), topk, dim=-1).indices.reshape(-1),
                                                       flat.repeat_interleave(topk))
            for logits in out.router_logits])
    aux = torch.stack(auxes).mean()
    shares = counts / counts.sum(-1, keepdim=True)
    low, high = shares.min(-1).values.tolist(), shares.max(-1).values.tolist()
    metrics = {"aux_loss": float(aux.detach()), "moe/load_min": min(low), "moe/load_max": max(high)}
    metrics.update({f"moe/load_min/layer{i}": v for i, v in enumerate(low)})
    metrics.update({f"moe/load_max/layer{i}": v for i, v in enumerate(high)})
    return aux, metrics


def check_router_metrics(ours: dict, ref: dict, *, what: str) -> None:
    assert {k for k in ours if k.startswith(("aux_loss", "moe/"))} == set(ref), what
    for name, value in ref.items():
        assert_close(torch.tensor(ours[name]), torch.tensor(value), what=f"{what} {name}")


def engine_groups(*, dp: int) -> list[list[int]]:
    """The pair positions of each microbatch of a test_parity global batch, over all dp ranks."""
    b, per_rank = tp_.MICRO_BATCH, tp_.GLOBAL_BATCH // dp
    return [list(range(d * per_rank + k, d * per_rank + k + b)) for d in range(dp) for k in range(0, per_rank, b)]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_aux")
    return save_hf(qwen3_moe(seed=1), root / "policy"), save_hf(qwen3_moe(seed=2), root / "ref")


@pytest.mark.parametrize("layout", [(1, 1, 1, 1), (1, 1, 2, 2)], ids=["single-rank", "dp2-ep2"])
def test_parity_with_aux_loss(moe_models, tmp_path, layout):
    """Every metric (aux_loss and the load shares too) and every gradient, 2 steps, 1e-5. At tp 2
    (sequence parallel) and at pp 2 it runs in tests/test_moe.py, in those layouts' launches."""
    tp, pp, dp, ep = layout
    job = aux_job(layout, *moe_models)
    run_ranks(world_size=tp * pp * dp, jobs=[job], out_dir=tmp_path)
    check_aux_parity(tmp_path, 0, job, layout, router_effect=True)


def aux_job(layout: tuple[int, int, int, int], policy_dir: Path, ref_dir: Path) -> dict:
    job = parity_job(layout, policy_dir, ref_dir, name="qwen3_moe", ep=layout[3], moe_aux_loss_coef=COEF,
                     export_hf=False, distributed_optimizer=False)
    job["eval_pairs"] = []
    return job


def check_aux_parity(out_dir: Path, j: int, job: dict, layout: tuple[int, int, int, int], *,
                     router_effect: bool = False) -> None:
    """Job j's gradients, metrics and router metrics against HF + TRL's sum with COEF x aux."""
    from mcore_dpo.mesh import Layout

    tp, pp, dp, ep = layout
    groups = engine_groups(dp=dp)
    config = job["config"]
    ref = _with_hub_names(_reference(config["model"], config["ref_model"], job["batches"], groups=groups, steps=2),
                          Path(config["model"]))
    spec = open_hf_dir(config["model"]).spec
    what = f"aux {COEF} at tp{tp} pp{pp} dp{dp} ep{ep}"
    mesh_layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep)
    for step, ref_grads in enumerate(ref["grads"], start=1):
        for (t, p, d), shard in load_rank_tensors(out_dir, j, f"grads{step}", layout=(tp, pp, dp)).items():
            expected = hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep,
                                         ep_rank=mesh_layout.ep_rank_of(tp_rank=t, dp_rank=d), get=ref_grads.__getitem__)
            assert set(expected) == set(shard), what
            for name, value in expected.items():
                assert_close(shard[name], value, what=f"{what} step {step} grad {name} (tp{t} pp{p} dp{d})")
    ours = json.loads((out_dir / f"job{j}_metrics.json").read_text())
    assert len(ours) == 2, what
    for step, (m_ours, m_ref) in enumerate(zip(ours, ref["metrics"]), start=1):
        tp_._check_metrics(m_ours, m_ref, names=tp_.METRICS, prefix="", what=f"{what} step {step}", rtol=tp_.RTOL)
        check_router_metrics(m_ours, m_ref["router"], what=f"{what} step {step}")
    if router_effect:  # the aux term is not lost in the tolerance: it changes the router's gradient by far more
        plain = tp_._reference(config["model"], config["ref_model"], "sigmoid", "interleaved", 1)["grads"][0]
        router = "model.layers.0.mlp.gate.weight"
        assert (plain[router] - ref["grads"][0][router]).abs().max() > 100 * tp_.RTOL * ref["grads"][0][router].abs().max()


# --------------------------------------------------------------------------- the flag, from the command line
def test_flag_parses_and_defaults_from_the_model_config():
    from mcore_dpo.config import TrainConfig, build_parser

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
    code = main(["--model", str(moe_models[0]), "--data", str(data), "--output-dir", str(tmp_path / "out"),
                 "--no-export-hf", "--save-interval", "0", "--save-interval-min", "0", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert message in err, err
    assert not ray.is_initialized(), "a worker group was started before the input was checked"


def test_train_cli_default_coef_from_the_model_config_and_metrics_jsonl(tmp_path):
    """Through `python -m mcore_dpo.train` (Ray, one rank): with no flag the coefficient is the
    model config's router_aux_loss_coef (output_router_logits is true), written to the resolved
    config.yaml; metrics.jsonl holds aux_loss and the load shares of every MoE layer. Packing,
    left unset, falls back to padded microbatches for the aux loss: one line at startup,
    `packing: false` in config.yaml, 2 microbatches of 2 pairs per step. --moe-grouped-gemm on ranks
    without Transformer Engine: one line, and the run goes on with sequential experts."""
    import os
    import subprocess
    import sys

    import yaml

    model = save_hf(qwen3_moe(seed=5, output_router_logits=True, router_aux_loss_coef=0.03), tmp_path / "model")
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i} w4 w{i + 7}", "chosen": f" w5 w{i}", "rejected": " w6"}) + "\n"
                            for i in range(3, 20)))
    out = tmp_path / "out"
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "mcore_dpo.train", "--model", str(model), "--data", str(data), "--output-dir", str(out),
         "--max-steps", "2", "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-interval", "0",
         "--no-export-hf", "--save-interval", "0", "--save-interval-min", "0", "--no-distributed-optimizer",
         "--moe-grouped-gemm"],
        cwd=repo, env=dict(os.environ, OMP_NUM_THREADS="1", MCORE_DPO_CACHE=str(tmp_path / "cache")),
        capture_output=True, text=True, timeout=900)
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
