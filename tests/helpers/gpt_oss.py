"""Tiny GPT-OSS models (transformers' own GptOssConfig / GptOssForCausalLM, fp32), and their experts
written in the released checkpoints' MXFP4 layout.

`gpt_oss(seed=...)`: 4 layers alternating sliding (window 4, shorter than the test sequences) and
full attention (layers 0 and 2 slide, so each stage of a pp-2 split has both kinds), hidden 32,
4 heads in 2 query groups of head_dim 16, YaRN RoPE (factor 4 over 32 positions, truncate false),
4 experts of intermediate size 32, top 2, a SwiGLU clamp of 1.5 (the test activations reach it).
Norm weights 1 + 0.1 N(0, 1), biases and sinks 0.1 N(0, 1), matrices 0.25 N(0, 1); then MEAN_SHIFT
added to hidden dimension MEAN_DIM of every embedding and lm_head row (a mean logit far from 0).

`mxfp4_experts(model, seed=...)`: the model with expert weights drawn as MXFP4 values (random e2m1
codes, scales 2^-3..2^-1) and the blocks and scales that hold them: the dequantised weights are
exactly those values.

`float64_reference(policy_dir, ref_dir, steps=...)`: the parity tests' HF + TRL reference of a DPO
run (sigmoid, interleaved) computed in float64 with transformers' float32 islands removed
(`without_float32_islands`), its gradients and weights returned in fp32."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import GptOssConfig, GptOssForCausalLM

from tests.helpers.models import PAD, VOCAB_SIZE

ROPE = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32, "rope_theta": 150000.0}
CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
    swiglu_limit=1.5, rope_parameters=ROPE, max_position_embeddings=128, rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
)

# The family's model at transformers' own initialisation, for the key-map tests of every family.
TINY = {"gpt_oss": lambda: GptOssForCausalLM(GptOssConfig(**CONFIG))}


# The hidden dimension and the constant of `gpt_oss`'s mean-logit shift.
MEAN_DIM, MEAN_SHIFT = 0, 1.0


def gpt_oss(*, seed: int, **overrides) -> GptOssForCausalLM:
    model = GptOssForCausalLM(GptOssConfig(**{**CONFIG, **overrides}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1 or name.endswith("_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
        # A clear mean logit. With the draws above the mean of the logits over the vocabulary is
        # ~3e-4, a cancellation: the parity tests' `logits/chosen` then measured fp32 rounding
        # (3e-5 relative; HF fp32 itself is 1e-4 away from float64), not the engine. A constant
        # in one hidden dimension of every token's embedding (kept through the residual stream,
        # so the final norm's output is positive there) and the same constant added to that
        # column of every lm_head row shift every logit of a token by the same positive amount:
        # log-softmax (log-probs, losses, rewards) is unchanged by the lm_head part; the mean
        # logit becomes O(1).
        model.model.embed_tokens.weight[:, MEAN_DIM] += MEAN_SHIFT
        model.lm_head.weight[:, MEAN_DIM] += MEAN_SHIFT
    return model.float().eval()


def random_mxfp4(shape: tuple[int, ...], *, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [..., rows, cols / 32, 16] and scales [..., rows, cols / 32] (uint8) of
    a [..., rows, cols] tensor: any e2m1 code, scales 2^-3..2^-1 (biased by 127)."""
    *lead, rows, cols = shape
    blocks = torch.randint(0, 256, (*lead, rows, cols // 32, 16), generator=gen).to(torch.uint8)
    scales = torch.randint(124, 127, (*lead, rows, cols // 32), generator=gen).to(torch.uint8)
    return blocks, scales


def mxfp4_experts(model: GptOssForCausalLM, *, seed: int) -> dict[str, torch.Tensor]:
    """Sets the model's expert weights to random MXFP4 values (transformers' own dequantiser,
    `convert_moe_packed_tensors`, decodes them) and returns the blocks and scales by name, as
    the released checkpoints store them (`...experts.gate_up_proj_blocks` [E, 2I, h / 32, 16], ...)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(seed)
    stored = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = random_mxfp4((p.shape[0], p.shape[2], p.shape[1]), gen=gen)  # rows: the output dim
                p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
    return stored


@contextmanager
def without_float32_islands():
    """transformers' GPT-OSS computing in its parameters' dtype throughout, for a float64 run:
    GptOssRMSNorm (which casts to float32 and back) and GptOssRotaryEmbedding (angles, cos and sin
    in float32) replaced by dtype-preserving versions of the same formulas, and the experts'
    eager loop (the default grouped_mm takes no float64). Restored on exit."""
    from transformers.models.gpt_oss import modeling_gpt_oss as hf

    saved = hf.GptOssRMSNorm.forward, hf.GptOssRotaryEmbedding.forward, hf.GptOssExperts.forward

    def rms_norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def rotary(self, x, position_ids):
        # The inverse frequencies are the fp32 model's buffer (the engine's, rope_inv_freq), upcast.
        freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(device=x.device, dtype=x.dtype)
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

    hf.GptOssRMSNorm.forward, hf.GptOssRotaryEmbedding.forward = rms_norm, rotary
    hf.GptOssExperts.forward = saved[2].__wrapped__  # under use_experts_implementation's dispatch
    try:
        yield
    finally:
        hf.GptOssRMSNorm.forward, hf.GptOssRotaryEmbedding.forward, hf.GptOssExperts.forward = saved


def float64_reference(policy_dir: str, ref_dir: str, *, steps: int) -> dict:
    """parity.cached_reference (sigmoid, interleaved) in float64 without transformers' float32
    islands: an exact reference for the engine's fp32 run.

    Why not fp32 as the other families: the attention-sink gradient sums over every query, row and
    microbatch with heavy cancellation, so an fp32 run of it carries rounding near 1e-5 of its
    magnitude. Against this float64 reference, HF's fp32 sink gradient (layer 0) is off by about
    7e-6 (relative to max|grad|), the engine's by 7e-6 in one process and up to 9.7e-6 in the
    parity jobs; compared with each other the two fp32 values differ by up to 1.7e-5, over RTOL
    (1e-5), though both are right. Against the exact value the engine's own error fits RTOL."""
    from tests.helpers import parity

    with without_float32_islands():
        return parity.cached_reference(policy_dir, ref_dir, "sigmoid", "interleaved", steps, torch.float64)
