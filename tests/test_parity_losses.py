"""Parity of the TRL 1.16 loss types and options on the parallel engine against a
single-process Hugging Face run written here from TRL 1.16's `DPOTrainer._compute_loss`
(and `SyncRefModelCallback` for TR-DPO): aot, aot_unpaired, f-divergences, LD-DPO, WPO,
TR-DPO, and sft's reward metrics with a reference.

Each job trains on global batches with uneven lengths and padding at (1,1,1) and (2,2,1);
compared: every metric of every step, the gradient of every policy parameter at every step,
and the weights at the end. TR-DPO runs three steps with a sync every two, with the reference
interleaved and sequential: both must match the reference run (which syncs after step 2),
so a step-3 reference computed during step 2, before the sync, would show at step 3.
Packed (`--packing`) variants of the aot, aot_unpaired, LD-DPO, sft and WPO jobs run in the
same launches against the same reference, their pairs in token-balanced packed rows (several
per step at dp 1 and at dp 2, where aot's sort gathers the pairs of both replicas' plans).
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mapping import hf_to_mcore_shard
from mcore_dpo.model.chunks import rank_shard
from mcore_dpo.parallel.mesh import Layout
from mcore_dpo.data.pairs import collate, padded_seq_len
from tests.helpers.data import PACKED, make_pairs
from tests.helpers.models import PAD
from tests.helpers.ranks import check_ran_packed, load_rank_tensors, run_ranks
from tests.helpers.reference import RTOL, assert_close

GLOBAL_BATCH = 8
MICRO_BATCH = 2
LR, CLIP, WD, ADAM_EPS, BETA = 1e-3, 1.0, 0.1, 1e-4, 0.5
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "grad_norm")
TRDPO = {"sync_ref_model": True, "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 0.5}

# name -> (ref_mode, config fields, steps)
JOBS = {
    "aot_ld_sft": ("interleaved", {"loss_type": "aot,sft", "label_smoothing": 0.1, "ld_alpha": 0.4}, 2),
    "aot_unpaired": ("sequential", {"loss_type": "aot_unpaired"}, 2),
    "js_wpo": ("interleaved", {"loss_type": "sigmoid", "f_divergence_type": "js_divergence", "use_weighting": True}, 2),
    "alpha_ipo": ("precomputed", {"loss_type": "ipo", "f_divergence_type": "alpha_divergence",
                                  "f_alpha_divergence_coef": 0.8}, 2),
    "sft": ("interleaved", {"loss_type": "sft"}, 1),
    "trdpo_interleaved": ("interleaved", {"loss_type": "sigmoid", **TRDPO}, 3),
    "trdpo_sequential": ("sequential", {"loss_type": "sigmoid", **TRDPO}, 3),
}
# "<name>/packed": job <name> with packed microbatches (tests/helpers/data.py's PACKED): the first two steps take
# 6 and 7 rows at dp 1, 3 + 3 and 3 + 4 at dp 2.
# (layout, jobs, vpp): every job at (1,1,1) and (2,2,1); aot's sort across dp ranks at (1,1,2); every
# padded job with two model chunks per pipeline rank (--vpp 2) at (1,2,1).
LAYOUTS = [pytest.param(layout, names, vpp, id="tp{}-pp{}-dp{}".format(*layout) + (f"-vpp{vpp}" if vpp > 1 else ""))
           for layout, names, vpp in
           (((1, 1, 1), tuple(JOBS) + ("aot_ld_sft/packed", "aot_unpaired/packed", "js_wpo/packed"), 1),
            ((2, 2, 1), tuple(JOBS) + ("aot_ld_sft/packed",), 1),
            ((1, 1, 2), ("aot_ld_sft", "aot_unpaired", "aot_ld_sft/packed", "aot_unpaired/packed"), 1),
            ((1, 2, 1), tuple(JOBS), 2))]


def _rtol(step: int) -> float:
    """RTOL for the two steps every parity test compares; float32 rounding grows with each
    Adam step (eps 1e-4 amplifies it), so the third TR-DPO step gets 5x. A reference that
    missed the step-2 sync would be off by O(1) there, far outside either."""
    return RTOL if step <= 2 else 5 * RTOL


def _batches(steps: int):
    pairs = make_pairs(4 * GLOBAL_BATCH, seed=7)
    return pairs, [pairs[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(steps)]


# --------------------------------------------------------------------------- reference (TRL 1.16 formulas)
def _token_logps(model, pairs):
    mb = collate(pairs, pad_token_id=PAD, seq_len=padded_seq_len(pairs))
    logits = model(input_ids=mb.tokens).logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1) * mb.loss_mask
    return logits, logp, mb.loss_mask


def _ld_sum(logp, mask, ld_alpha):
    if ld_alpha is None:
        return logp.sum(1)
    pos = mask.cumsum(1)
    lens = mask.sum(1)
    half = lens.shape[0] // 2
    shared = torch.minimum(lens[:half], lens[half:]).repeat(2).unsqueeze(1)
    return (logp * ((pos > 0) & (pos <= shared))).sum(1) + ld_alpha * (logp * (pos > shared)).sum(1)


def _score(u, kind, alpha):
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(u)
    if kind == "alpha_divergence":
        return (torch.exp(torch.clamp((alpha - 1) * u, max=80.0)) - 1) / (alpha - 1)
    return u


def _trl_loss(name, cfg, *, c, r, c0, r0, logp, mask, logits):
    b = c.shape[0]
    eps = cfg.get("label_smoothing", 0.0)
    kind, alpha = cfg.get("f_divergence_type", "reverse_kl"), cfg.get("f_alpha_divergence_coef", 0.5)
    sc, sr = _score(c - c0, kind, alpha), _score(r - r0, kind, alpha)
    total = 0.0
    for loss_type in cfg["loss_type"].split(","):
        if loss_type == "sigmoid":
            per = -F.logsigmoid(BETA * (sc - sr))
        elif loss_type == "ipo":
            lc, lr = mask[:b].sum(1).clamp(min=1), mask[b:].sum(1).clamp(min=1)
            per = (sc / lc - sr / lr - 1 / (2 * BETA)) ** 2
        elif loss_type in ("aot", "aot_unpaired"):
            if loss_type == "aot":
                delta = torch.sort(c - r, dim=0)[0] - torch.sort(c0 - r0, dim=0)[0]
            else:
                delta = torch.sort(c - c0, dim=0)[0] - torch.sort(r - r0, dim=0)[0]
            per = -F.logsigmoid(BETA * delta) * (1 - eps) - F.logsigmoid(-BETA * delta) * eps
        elif loss_type == "sft":
            per = (-logp[:b][mask[:b].bool()].mean()).expand(b)
        else:
            raise AssertionError(loss_type)
        if cfg.get("use_weighting"):
            with torch.no_grad():
                sq = torch.logsumexp(2 * torch.log_softmax(logits, -1), -1)  # log Σ p², per token
                w = torch.exp(((logp - sq) * mask).sum(1) / mask.sum(1).clamp(min=1))
            per = per * (w[:b] * w[b:])
        total = total + per.mean()
    return total


@lru_cache(maxsize=None)
def _reference(policy_dir: str, ref_dir: str, name: str) -> dict:
    mode, cfg, steps = JOBS[name]
    _, batches = _batches(steps)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    params = list(policy.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=ADAM_EPS)
    ld_alpha = cfg.get("ld_alpha")
    metrics, grads = [], []
    for step, pairs in enumerate(batches, start=1):
        b = len(pairs)
        opt.zero_grad()
        logits, logp, mask = _token_logps(policy, pairs)
        with torch.no_grad():
            _, ref_logp, _ = _token_logps(reference, pairs)
        seq, ref_seq = _ld_sum(logp, mask, ld_alpha), _ld_sum(ref_logp, mask, ld_alpha)
        c, r, c0, r0 = seq[:b], seq[b:], ref_seq[:b], ref_seq[b:]
        loss = _trl_loss(name, cfg, c=c, r=r, c0=c0, r0=r0, logp=logp, mask=mask, logits=logits)
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in policy.named_parameters()})
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), CLIP)
        with torch.no_grad():
            uc, ur = (c - c0).detach(), (r - r0).detach()
            mean_logits = logits.mean(-1) * mask
            m = {"loss": float(loss), "grad_norm": float(norm),
                 "rewards/chosen": float(BETA * uc.mean()), "rewards/rejected": float(BETA * ur.mean()),
                 "rewards/accuracies": float((uc > ur).double().mean()), "rewards/margins": float(BETA * (uc - ur).mean()),
                 "logps/chosen": float(c.mean()), "logps/rejected": float(r.mean()),
                 "logits/chosen": float(mean_logits[:b].sum() / mask[:b].sum()),
                 "logits/rejected": float(mean_logits[b:].sum() / mask[b:].sum())}
            if "sft" in cfg["loss_type"].split(","):
                m["nll_loss"] = float(-logp[:b].sum() / mask[:b].sum())
        metrics.append(m)
        opt.step()
        if cfg.get("sync_ref_model") and step % cfg["ref_model_sync_steps"] == 0:
            alpha = cfg["ref_model_mixup_alpha"]
            with torch.no_grad():  # TRL 1.16 SyncRefModelCallback._sync_target_model
                for target, source in zip(reference.parameters(), policy.parameters(), strict=True):
                    target.mul_(1.0 - alpha).add_(source, alpha=alpha)
    weights = {n: p.detach().clone() for n, p in policy.named_parameters()}
    return {"metrics": metrics, "grads": grads, "weights": weights}


# --------------------------------------------------------------------------- engine
def _jobs(layout, names, models, *, vpp: int = 1) -> list[dict]:
    tp, pp, dp = layout
    policy_dir, ref_dir = models
    jobs = []
    for name in names:
        base, packed = name.removesuffix("/packed"), name.endswith("/packed")
        mode, cfg, steps = JOBS[base]
        pairs, batches = _batches(steps)
        jobs.append({
            "key": name,
            "config": dict(model=str(policy_dir), ref_model=str(ref_dir), tp=tp, pp=pp, dp=dp,
                           micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, max_steps=steps,
                           ref_mode=mode, lr=LR, adam_eps=ADAM_EPS, timeout_s=60.0, clip_grad=CLIP, weight_decay=WD,
                           beta=BETA, vpp=vpp, **cfg, **(PACKED if packed else {})),
            "batches": batches,
            "batch_ids": [list(range(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH)) for k in range(steps)],
            "all_pairs": pairs,
        })
    return jobs


@pytest.mark.parametrize("layout, names, vpp", LAYOUTS)
def test_parity_losses(layout, names, vpp, parity_models, tmp_path):
    models = parity_models["llama"]
    jobs = _jobs(layout, names, models, vpp=vpp)
    run_ranks(world_size=layout[0] * layout[1] * layout[2], jobs=jobs, out_dir=tmp_path)
    tp, pp, _ = layout
    spec = open_hf_dir(str(models[0])).spec
    chunked = Layout(tp=tp, pp=pp, dp=layout[2], vpp=vpp)

    def expected_shard(tensors: dict, *, tp_rank: int, pp_rank: int) -> dict:
        """What rank (tp_rank, pp_rank) holds of HF-named tensors (with chunks, each chunk's: model/chunks.py)."""
        return rank_shard(lambda pp_, stage: hf_to_mcore_shard(spec, tp=tp, tp_rank=tp_rank, pp=pp_, pp_rank=stage,
                                                               get=tensors.__getitem__), layout=chunked, pp_rank=pp_rank)
    ours = {}
    for j, job in enumerate(jobs):
        name = job["key"]
        what = f"{name} at tp{tp} pp{pp} dp{layout[2]}" + (f" vpp{vpp}" if vpp > 1 else "")
        base = name.removesuffix("/packed")
        ref = _reference(str(models[0]), str(models[1]), base)
        metrics = [m for m in json.loads((tmp_path / f"job{j}_metrics.json").read_text()) if m is not None]
        ours[name] = metrics
        assert len(metrics) == len(ref["metrics"]), what
        if base != name:
            check_ran_packed(tmp_path, padded=names.index(base), packed=j)
        for step, (m_ours, m_ref) in enumerate(zip(metrics, ref["metrics"]), start=1):
            logp_scale = BETA * max(abs(m_ref["logps/chosen"]), abs(m_ref["logps/rejected"]))
            for key in METRICS + (("nll_loss",) if "nll_loss" in m_ref else ()):
                scale = max(abs(m_ref[key]), logp_scale) if key.startswith("rewards/") and key != "rewards/accuracies" else None
                assert_close(torch.tensor(m_ours[key]), torch.tensor(m_ref[key]), what=f"{what} step {step} {key}",
                             scale=scale, rtol=_rtol(step))
        for step, ref_grads in enumerate(ref["grads"], start=1):
            for (t, p, d), shard in load_rank_tensors(tmp_path, j, f"grads{step}", layout=layout).items():
                expected = expected_shard(ref_grads, tp_rank=t, pp_rank=p)
                for key, value in expected.items():
                    assert_close(shard[key], value, what=f"{what} step {step} grad {key} (tp{t} pp{p})",
                                 rtol=_rtol(step))
        for (t, p, d), shard in load_rank_tensors(tmp_path, j, "weights", layout=layout).items():
            if d != 0:  # only dp rank 0 writes weights
                continue
            expected = expected_shard(ref["weights"], tp_rank=t, pp_rank=p)
            for key, value in expected.items():
                assert_close(shard[key], value, what=f"{what} weight {key} after training", rtol=_rtol(len(ref["grads"])))
    if "sft" not in ours:
        return
    # sft with a reference logs the same rewards as sigmoid on the same data at step 1.
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert ours["sft"][0][key] == pytest.approx(ours["trdpo_interleaved"][0][key], rel=1e-9, abs=1e-12), key
    # TR-DPO: the interleaved reference gives the sequential run's numbers, step for step.
    timing = ("tokens/s", "step_time_s", "bubble_fraction", "memory/peak_gib")
    for m_int, m_seq in zip(ours["trdpo_interleaved"], ours["trdpo_sequential"]):
        for key in m_seq:
            if key not in timing and not key.startswith("memory/"):
                assert m_int[key] == pytest.approx(m_seq[key], rel=1e-9, abs=1e-12), key
