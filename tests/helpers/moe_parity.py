"""Parity checks of the mixture-of-experts jobs: the experts of each rank's expert-parallel
share, and the routers' load-balancing loss (--moe-aux-loss-coef) against HF
AutoModelForCausalLM(output_router_logits=True) + TRL's sum `loss + coef * aux_loss`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from checkpoint_convert.gather import fused_hf_sources
from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mapping import hf_to_mcore_shard
from tests.helpers import parity
from tests.helpers.ranks import load_rank_tensors
from tests.helpers.reference import RTOL, assert_close, loss_and_metrics, sequences

COEF = 0.5  # large enough that the aux term moves the router gradients well past the tolerance


def with_hub_names(ref: dict, policy_dir: Path) -> dict:
    """The HF reference's grads and weights under the hub names too (transformers 5 holds the
    experts fused; the engine's shards are compared through the hub names)."""
    spec = open_hf_dir(policy_dir).spec
    for tensors in [*ref["grads"], ref["weights"]]:
        tensors.update(hub_experts(tensors, spec))
    return ref


def hub_experts(tensors: dict, spec) -> dict:
    """The expert tensors of `tensors` (transformers 5's in-memory form: fused, or renamed) under
    their hub names, one per expert and part."""
    out = {}
    for name, (stored, expert, part, parts) in fused_hf_sources(spec, stored=set(tensors)).items():
        tensor = tensors[stored] if expert is None else tensors[stored][expert]
        out[name] = tensor.chunk(parts, dim=0)[part]
    return out


def rank_shard(spec, layout: tuple[int, int, int, int]):
    """(tensors, t, p, d) -> the key map's shard of `tensors` (HF names) that the rank at tp rank t,
    pp rank p and dp rank d holds: experts whole on their rank (expert tp 1), its expert-parallel
    rank (t + tp d) % ep (megatron-core's tp-ep-dp order; `Layout.ep_rank_of`)."""
    from mcore_dpo.parallel.mesh import Layout

    tp, pp, dp, ep = layout
    ep_rank_of = Layout(tp=tp, pp=pp, dp=dp, ep=ep).ep_rank_of

    def shard(tensors: dict, t: int, p: int, d: int) -> dict:
        return hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep, ep_rank=ep_rank_of(tp_rank=t, dp_rank=d),
                                 get=tensors.__getitem__)

    return shard


def check_moe_job(out_dir: Path, job: dict, layout: tuple[int, ...], j: int = 0) -> None:
    """parity.check_job for an interleaved sigmoid MoE job at ep 1."""
    config = job["config"]
    with_hub_names(parity.cached_reference(config["model"], config["ref_model"], "sigmoid", "interleaved", 2),
                   Path(config["model"]))
    parity.check_job(out_dir, j, job, layout[:3])


def check_expert_parallel(out_dir: Path, j: int, job: dict, layout: tuple[int, int, int, int]) -> None:
    """parity.check_job's checks with the experts of each rank's ep share: experts whole on their
    rank (expert tp 1), the expert-parallel rank of the rank at (tp rank t, dp rank d) of a stage
    is (t + tp d) % ep (megatron-core's tp-ep-dp order; `rank_shard`); no evaluation."""
    tp, pp, dp, ep = layout
    config = job["config"]
    ref = with_hub_names(parity.cached_reference(config["model"], config["ref_model"], "sigmoid", "interleaved", 2),
                         Path(config["model"]))
    spec = open_hf_dir(config["model"]).spec
    expected_shard = rank_shard(spec, layout)
    what = f"{job['key'][0]} at tp{tp} pp{pp} dp{dp} ep{ep}"
    for step, ref_grads in enumerate(ref["grads"], start=1):
        for (t, p, d), shard in load_rank_tensors(out_dir, j, f"grads{step}", layout=(tp, pp, dp)).items():
            expected = expected_shard(ref_grads, t, p, d)
            assert set(expected) == set(shard), what
            for name, value in expected.items():
                assert_close(shard[name], value, what=f"{what} step {step} grad {name} (rank tp{t} pp{p} dp{d})")
    for (t, p, d), shard in load_rank_tensors(out_dir, j, "weights", layout=(tp, pp, dp)).items():
        if d == 0:
            expected = expected_shard(ref["weights"], t, p, d)
            assert set(expected) == set(shard), what
            for name, value in expected.items():
                assert_close(shard[name], value, what=f"{what} weight {name} after 2 steps")
    ours = json.loads((out_dir / f"job{j}_metrics.json").read_text())
    for step, (m_ours, m_ref) in enumerate(zip(ours[:2], ref["metrics"]), start=1):
        parity.check_metrics(m_ours, m_ref, names=parity.METRICS, prefix="", what=f"{what} step {step}", rtol=RTOL)
    assert len(ours) == 2, what  # no evaluation: it is refused with ep > 1
    # The router metrics (the aux loss at 0): step 1 runs at the starting weights; at pp 2 each
    # stage's layers meet over the pp group.
    check_router_metrics(ours[0], router_metrics(config["model"], job["batches"][0], groups=engine_groups(dp=dp)),
                         what=f"{what} step 1")


# --------------------------------------------------------------------------- the aux loss
def aux_reference(policy_dir: str, ref_dir: str, batches, *, groups: list[list[int]], steps: int) -> dict:
    """HF forward + TRL's sigmoid loss over the global batch, plus COEF x the mean over the
    engine's microbatches (`groups`: pair positions) of the HF model's own aux_loss."""
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    params = list(policy.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": parity.WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=parity.LR, betas=(0.9, 0.999), eps=parity.ADAM_EPS)
    kw = parity.loss_kwargs("sigmoid")
    metrics, grads = [], []
    for pairs in batches[:steps]:
        opt.zero_grad()
        loss, m = loss_and_metrics(policy, reference, pairs, loss_type="sigmoid", beta=kw["beta"],
                                   eps=kw["label_smoothing"], reference_free=False)
        aux, router = _router_metrics(policy, pairs, groups=groups)
        (loss + COEF * aux).backward()
        grads.append({n: p.grad.detach().clone() for n, p in policy.named_parameters()})
        m["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), parity.CLIP))
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
        ids, attention, _ = sequences([pairs[i] for i in group])
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
    """The pair positions of each microbatch of a parity global batch, over all dp ranks."""
    b, per_rank = parity.MICRO_BATCH, parity.GLOBAL_BATCH // dp
    return [list(range(d * per_rank + k, d * per_rank + k + b)) for d in range(dp) for k in range(0, per_rank, b)]


def aux_job(layout: tuple[int, int, int, int], policy_dir: Path, ref_dir: Path) -> dict:
    """A Qwen3-MoE parity job with the load-balancing loss at COEF, no evaluation."""
    job = parity.parity_job(layout, policy_dir, ref_dir, name="qwen3_moe", ep=layout[3], moe_aux_loss_coef=COEF,
                            export_hf=False, distributed_optimizer=False)
    job["eval_pairs"] = []
    return job


def check_aux_parity(out_dir: Path, j: int, job: dict, layout: tuple[int, int, int, int], *,
                     router_effect: bool = False) -> None:
    """Job j's gradients, metrics and router metrics against HF + TRL's sum with COEF x aux."""
    from mcore_dpo.parallel.mesh import Layout

    tp, pp, dp, ep = layout
    groups = engine_groups(dp=dp)
    config = job["config"]
    ref = with_hub_names(aux_reference(config["model"], config["ref_model"], job["batches"], groups=groups, steps=2),
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
        parity.check_metrics(m_ours, m_ref, names=parity.METRICS, prefix="", what=f"{what} step {step}", rtol=RTOL)
        check_router_metrics(m_ours, m_ref["router"], what=f"{what} step {step}")
    if router_effect:  # the aux term is not lost in the tolerance: it changes the router's gradient by far more
        plain = parity.cached_reference(config["model"], config["ref_model"], "sigmoid", "interleaved", 1)["grads"][0]
        router = "model.layers.0.mlp.gate.weight"
        assert (plain[router] - ref["grads"][0][router]).abs().max() > 100 * RTOL * ref["grads"][0][router].abs().max()


# --------------------------------------------------------------------------- routers with a loaded bias
def one_step_jobs(policy: Path, reference: Path, *, name: str, layouts) -> list[dict]:
    """One DPO step at each (tp, pp, dp, ep) of `layouts`, for one launch of them all: no export, no
    evaluation, and the plain optimizer (the reference's own AdamW)."""
    jobs = []
    for layout in layouts:
        job = parity.parity_job(layout, policy, reference, name=name, steps=1, ep=layout[3], export_hf=False,
                                distributed_optimizer=False)
        job["eval_pairs"] = []
        jobs.append(job)
    return jobs


def router_biases_of(model_dir: Path) -> dict[str, torch.Tensor]:
    """The router biases of an HF directory's model (buffers: not among its parameters)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def check_expert_bias_job(out_dir: Path, j: int, job: dict, layout: tuple[int, int, int, int]) -> None:
    """Step-1 metrics, step-1 gradients of every rank and dp rank 0's weights after the step
    against HF + TRL's formulas (`parity.cached_reference`, one step). The router biases are
    not trained: the weights after the step hold them as loaded."""
    tp, pp, dp, ep = layout
    config = job["config"]
    ref = with_hub_names(parity.cached_reference(config["model"], config["ref_model"], "sigmoid", "interleaved", 1),
                         Path(config["model"]))
    biases = router_biases_of(Path(config["model"]))
    spec = open_hf_dir(config["model"]).spec
    expected = rank_shard(spec, layout)
    what = f"{spec.family} at tp{tp} pp{pp} dp{dp} ep{ep}"

    grads = {**ref["grads"][0], **{n: torch.zeros_like(b) for n, b in biases.items()}}
    for (t, p, d), shard in load_rank_tensors(out_dir, j, "grads1", layout=(tp, pp, dp)).items():
        want = {n: v for n, v in expected(grads, t, p, d).items() if not n.endswith("expert_bias")}
        assert set(want) == set(shard), what
        for name, value in want.items():
            assert_close(shard[name], value, what=f"{what} step 1 grad {name} (rank tp{t} pp{p} dp{d})")
    weights = {**ref["weights"], **biases}
    checked_bias = False
    for (t, p, d), shard in load_rank_tensors(out_dir, j, "weights", layout=(tp, pp, dp)).items():
        if d != 0:
            continue
        want = expected(weights, t, p, d)
        assert set(want) == set(shard), what
        for name, value in want.items():
            if name.endswith("expert_bias"):
                assert torch.equal(shard[name], value), f"{what}: {name} changed in training"
                checked_bias = True
            else:
                assert_close(shard[name], value, what=f"{what} weight {name} after 1 step")
    assert checked_bias, what
    ours = json.loads((out_dir / f"job{j}_metrics.json").read_text())
    parity.check_metrics(ours[0], ref["metrics"][0], names=parity.METRICS, prefix="", what=f"{what} step 1", rtol=RTOL)
