"""Tiny DeepSeek-V3 models (transformers' own DeepseekV3Config / DeepseekV3ForCausalLM, fp32),
saved as HF directories, and the parity checks of their DPO runs.

`deepseek_v3(seed=...)`: 3 layers (layer 0 dense, layers 1-2 MoE), hidden 32, 4 heads,
multi-latent attention with q and kv latents, YaRN RoPE with mscale and mscale_all_dim both set
(so the cos/sin factor and the softmax scale are not 1), 4 routed experts in 2 groups (top 2
from the best group), one shared expert, a routed scale of 2.5, and a random router bias (so the
choice differs from the unbiased one)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mapping import hf_to_mcore_shard
from tests.helpers import parity
from tests.helpers.models import PAD, VOCAB_SIZE, small_init
from tests.helpers.moe_parity import with_hub_names
from tests.helpers.ranks import load_rank_tensors
from tests.helpers.reference import RTOL, assert_close

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7}
CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
    n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
    max_position_embeddings=128, rms_norm_eps=1e-6, rope_parameters=YARN, num_nextn_predict_layers=0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
)


# The family's model at transformers' own initialisation, for the key-map tests of every family.
TINY = {"deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG))}


def deepseek_v3(*, seed: int, **overrides) -> DeepseekV3ForCausalLM:
    """The tiny model at `small_init` weights (norms near 1, matrices 0.25 N(0, 1)), its router
    biases 0.1 N(0, 1)."""
    model = small_init(DeepseekV3ForCausalLM(DeepseekV3Config(**{**CONFIG, **overrides})), seed).float().eval()
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    return model


def buffers_of(model_dir: Path) -> dict[str, torch.Tensor]:
    """The router biases of an HF directory's model (buffers: not among its parameters)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def check_deepseek_job(out_dir: Path, j: int, job: dict, layout: tuple[int, int, int, int]) -> None:
    """Step-1 metrics, step-1 gradients of every rank and dp rank 0's weights after the step
    against HF + TRL's formulas (`parity.cached_reference`, one step). The router biases are
    not trained: the weights after the step hold them as loaded."""
    from mcore_dpo.parallel.mesh import Layout

    tp, pp, dp, ep = layout
    config = job["config"]
    ref = with_hub_names(parity.cached_reference(config["model"], config["ref_model"], "sigmoid", "interleaved", 1),
                         Path(config["model"]))
    biases = buffers_of(Path(config["model"]))
    spec = open_hf_dir(config["model"]).spec
    ep_rank_of = Layout(tp=tp, pp=pp, dp=dp, ep=ep).ep_rank_of
    what = f"deepseek_v3 at tp{tp} pp{pp} dp{dp} ep{ep}"

    def expected(tensors: dict, t: int, p: int, d: int) -> dict:
        return hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep, ep_rank=ep_rank_of(tp_rank=t, dp_rank=d),
                                 get=tensors.__getitem__)

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
