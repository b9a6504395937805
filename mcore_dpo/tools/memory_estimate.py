"""Memory per device of a training rank, as arithmetic: what the config headers state and
what `tests/test_memory_estimate.py` checks against tensors measured on the CPU.

Activations are the tensors one microbatch keeps for its backward, counted per token (one
token = one position of one row; a DPO microbatch of b pairs has 2b rows) and per layer,
for the Llama/Qwen2 layer this project builds (RMSNorm, GQA attention with RoPE, SwiGLU MLP).
Two attention implementations:

- `local`: megatron-core's local layer spec (what runs on the CPU, and on GPUs without
  Transformer Engine). Its norms are torch's RMSNorm (megatron-core's WrappedTorchNorm, our
  SequenceParallelRMSNorm), built without a dtype: their weight is fp32 whatever the parameter
  dtype, and torch normalises in fp32. Each keeps its input cast to fp32, the normalised fp32
  tensor and the fp32 1/rms of each vector (`_fp32_norm_bytes`: 8h + 4 B per token; in fp32 the
  cast is the input itself), and the two pre-norms' outputs are the linears' inputs (h in the
  parameter dtype): 10h + 4 B per norm in bf16, 12h + 4 in fp32 (exact against autograd's saved
  tensors at tp 1 and 2, tests/test_memory_estimate.py, test_local_norms_are_what_autograd_saves).
  Attention keeps q, k and v repeated to every head, the context, and the full s x s softmax
  probabilities (fp32, plus a copy in the parameter dtype when that is narrower); the scores
  are formed in one persistent s x s workspace.
- `flash`: Transformer Engine with flash/fused attention (GPU): each norm keeps its input
  and output (2h, in the parameter dtype: TE builds its norm weights in it; assumed, not
  measured: no Transformer Engine on the CPU); attention keeps q, k, v (grouped heads, not
  repeated), the output and the fp32 log-sum-exp per head; no s x s tensor.

Both: the MLP keeps fc1's output (2f), silu(gate) (f), the linear half (f) and their product
(f), all divided by tp. With sequence parallelism the norm-side tensors ([s, b, h] outside the
tensor-parallel linears) are divided by tp too, and the linears gather their input into one
persistent [s, b, h] workspace. The last stage adds the final norm and the vocab-parallel
logits, which the log-prob kernel keeps in fp32 together with their gradient during the
backward (2 fp32 copies of tokens x vocab/tp).

Mixture-of-experts layers (a shape with `experts` > 0; every layer is then a MoE layer, as in
Qwen3-30B-A3B and Mixtral): the MLP term becomes the routed one. Each token goes to its top k
experts, so with balanced routing a rank's experts see k copies of each of its tokens (the
all-to-all brings as many in as it sends out; routing skewed towards one ep rank's experts
raises that rank's share, up to ep x k copies with a dropless dispatcher). Per token: the router's
fp32 logits and probabilities (2E), the k dispatched copies the experts' fc1 keeps (kh) and the
k expert outputs the weighted combine keeps (kh), and each copy's expert MLP, 5 f_moe, divided
by the expert tensor-parallel size.

With sequence parallelism (tp > 1) each tp rank routes only its own s/tp tokens, so the routed
terms are divided by tp (measured: tests/test_configs.py, test_mla_layer_bytes_are_what_autograd_saves).

Multi-latent attention (DeepSeek-V3: a shape with `kv_lora_rank` > 0; the local spec only) keeps,
in place of GQA's q, k, v: its latent norms and up-projection inputs on the rank's tokens, and q,
k (q/k head size), v and the context (v_head_dim) with the s x s probabilities on the rank's
heads (`mla_attention_bytes_per_token`, exact against autograd's saved tensors at tp 1 and 2).

Shared experts (`shared_ffn`, DeepSeek-V3 / GLM-4.5's MoE block) add one SwiGLU MLP of every
token, 5 shared_ffn / tp; `dense_layers` first layers of a MoE model have the dense MLP of `ffn`,
and `plan_activation_bytes` counts each stage's own mix of them. Gemma 3's norm (`fp32_norms`:
x / rms(x) * (1 + w) in fp32, `norms` of them per layer) keeps what the local spec's norms keep
(exact against autograd's saved tensors of a tiny bf16 Gemma 3 layer, tests/test_memory_estimate.py).
Per-head q/k norms (`qk_norm`: Gemma 3's, Qwen3's) keep the same fp32 tensors per head on the
rank's heads wherever the norms compute in fp32 (exact in bf16; in fp32 the k norm's saved input
is a view of the whole qkv output, which this count does not follow).

Activation recompute (--recompute, megatron-core's own) changes what a layer keeps:

- `full` (recompute_method "uniform", groups of N = --recompute-num-layers layers): each group
  keeps only its input, one stage-boundary activation ([s, b, h], [s/tp, b, h] with sequence
  parallelism): 1/N of one per layer. The backward reruns one group's forward at a time, so it
  holds one group's activations as without recompute on top of the stash (`recompute_bytes`).
- `selective` (megatron-core's "core_attn"): the core attention keeps only its inputs. `local`:
  no s x s probabilities; q, k (after RoPE), the qkv projection's output (v is a view of it) and
  the context; `flash`: no log-sum-exp. The backward reruns one layer's core attention at a time.

Context parallelism (--cp N, dense models): a row of W positions is split into 2N chunks, cp
rank i holding chunks i and 2N-1-i, so a rank keeps W/N positions of each row (the row padded to
a multiple of 2N first): every per-token term above counts W/N tokens per row, the head and the
stage-boundary activations too. What sees the whole row:

- `local` (model/cp_attention.py: keys and values all-gathered over cp): the repeated k and v
  cover all W positions (N times a rank's share) and the scores are W/N x W per head, fp32 + the
  parameter dtype as above, in a W/N x W workspace.
- `flash` (Transformer Engine's attention, cp_comm_type "p2p": a ring of key/value exchanges;
  transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py,
  AttnFuncWithCPAndKVP2P): what it saves for the backward is what flash attention saves without
  cp, at the local length: q, the last received key/value chunk (k + v of the local size, in
  place of the local k, v), the output and the fp32 log-sum-exp. What the ring adds lives only
  inside one layer's attention forward or backward (`ring_attention_bytes`, counted once per
  rank like what a backward recomputes): forward, the N key/value chunks it receives (2 kv
  each), the N per-step outputs and the N per-step fp32 log-sum-exps, and the fp32 corrected
  output; backward, two send/receive buffers of [KV, dKV] (each 2 x (k + v)), the dq accumulator
  and one step's dq, dk, dv. The larger of the two, per local token, divided by tp (bf16/fp16;
  the fp8 paths keep other buffers and are not modelled).

The parameters are replicated over cp (not split: each cp rank holds the whole stage), and the
distributed optimizer shards its state over dp x cp: megatron-core builds its optimizer on the
data-parallel group with context parallel (`parallel_state.get_data_parallel_group(
with_context_parallel=True)`: process_groups_config.setup_process_groups_for_optimizer's
`dp_cp_group`, which get_megatron_optimizer hands the DistributedOptimizer as its
data_parallel_group), and this project's ShardedOptimizer is built on the same group
(`mesh.dp_cp_group`, dp_size = dp x cp: rank/worker.py).

1F1B keeps up to pp microbatches in flight on the first stage, each through layers/pp
layers: one microbatch's worth of all layers, which is what `activation_bytes` counts when
given the whole model's layer count. `plan_activation_bytes` takes the counts from the plan
memory model instead (`pipeline/memory.py`: per stage, the policy stash in microbatches and the
reference activations in flight and carried), and `per_gpu_bytes` adds the per-parameter
bytes: the configs' headers are computed with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mcore_dpo.optim.adamw import NORM_CHUNK

ATTENTION_IMPLS = ("flash", "local")
RECOMPUTE_MODES = ("none", "selective", "full")
FP32_BYTES = 4


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int = 0  # routed experts per layer; 0: a dense model
    topk: int = 0  # experts each token is routed to
    moe_ffn: int = 0  # one expert's FFN size
    shared_ffn: int = 0  # the shared experts' FFN size, all together (DeepSeek-V3 / GLM-4.5 MoE block); 0: none
    dense_layers: int = 0  # a MoE model's first layers with a dense MLP of `ffn` (first_k_dense_replace)
    norms: int = 2  # hidden-size norms per layer (Gemma 3's sandwich norms: 4)
    fp32_norms: bool = False  # the family's norm computes in fp32 on any layer spec (Gemma 3's, model/gemma3.py)
    qk_norm: bool = False  # per-head q/k norms; their activations are counted where norms compute in fp32
    # Multi-latent attention (DeepSeek-V3; kv_lora_rank 0: not MLA). head_dim is then the q/k head
    # (qk_nope_head_dim + qk_rope_head_dim) and kv_heads = heads; q_lora_rank 0: q_proj from h.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


def expert_param_count(shape: LayerShape, *, moe_layers: int) -> int:
    """Parameters of the routed experts (SwiGLU: gate, up, down) of `moe_layers` MoE layers;
    the routers ([E, h] each) are replicated like the dense parameters."""
    return moe_layers * shape.experts * 3 * shape.hidden * shape.moe_ffn


def expert_params_per_rank(shape: LayerShape, *, moe_layers: int, ep: int, expert_tp: int) -> float:
    """Expert parameters one rank of a stage holding `moe_layers` MoE layers keeps: E/ep experts
    of each layer, each split over the expert tensor-parallel ranks."""
    if shape.experts % ep:
        raise ValueError(f"ep {ep} does not divide the expert count {shape.experts}")
    return expert_param_count(shape, moe_layers=moe_layers) / (ep * expert_tp)


def expert_data_parallel_size(*, tp: int, dp: int, ep: int, expert_tp: int) -> int:
    """Ranks holding the same experts (megatron-core's expert-data-parallel group of one stage)."""
    ranks, rest = divmod(tp * dp, ep * expert_tp)
    if rest or not ranks:
        raise ValueError(f"ep {ep} x expert tp {expert_tp} does not divide tp {tp} x dp {dp}")
    return ranks


def local_seq_len(seq_len: int, cp: int) -> int:
    """Positions of a row one cp rank holds: the row padded to a multiple of 2 x cp, split over
    cp (cp 1: the row)."""
    if cp < 1:
        raise ValueError(f"cp: must be a positive integer, got {cp}")
    if cp == 1:
        return seq_len
    return -(-seq_len // (2 * cp)) * 2


def _fp32_norms(shape: LayerShape, attention: str) -> bool:
    """Whether the norms compute in fp32: every norm of the local spec (torch's RMSNorm, its weight
    fp32) and a family's own fp32 norm (Gemma 3's); Transformer Engine's keep the parameter dtype."""
    return attention == "local" or shape.fp32_norms


def _fp32_norm_bytes(width: int, groups: int = 1) -> int:
    """Bytes per token a norm computing in fp32 (torch's RMSNorm on the local spec, Gemma 3's)
    keeps over `groups` vectors of `width` elements: its input cast to fp32 and the normalised
    fp32 tensor (2 x 4 B per element) and the fp32 reciprocal rms of each vector (4 B); not its
    input in the parameter dtype (measured with autograd's saved-tensor hooks: tokens x (8h + 4),
    and Gemma's fp32 (1 + w), which is per layer, not per token). Its output, where a linear
    takes it, is that linear's saved input, counted beside this."""
    return 2 * FP32_BYTES * width + FP32_BYTES * groups


def mlp_activation_bytes_per_token(shape: LayerShape, *, tp: int, dtype_bytes: int, expert_tp: int | None = None,
                                   sequence_parallel: bool = False) -> float:
    """Bytes per token the MLP block keeps: dense SwiGLU 5f / tp; MoE: router 2E fp32, the k
    routed copies in and out (2kh) and k expert MLPs 5 f_moe / expert tp (balanced routing).
    With sequence parallelism each tp rank routes only its own s/tp tokens (the router's and the
    dispatcher's input is the layer's [s/tp, b, h]; measured at tp 2 in tests/test_configs.py,
    test_mla_layer_bytes_are_what_autograd_saves), so the routed part is divided by tp."""
    if not shape.experts:
        return 5 * shape.ffn * dtype_bytes / tp
    expert_tp = tp if expert_tp is None else expert_tp
    router = 2 * shape.experts * FP32_BYTES
    routed = 2 * shape.topk * shape.hidden * dtype_bytes
    experts = 5 * shape.topk * shape.moe_ffn * dtype_bytes / expert_tp
    moe = (router + routed + experts) / (tp if sequence_parallel else 1)
    if shape.shared_ffn:  # the shared experts: one SwiGLU MLP of every token, split over tp
        return moe + 5 * shape.shared_ffn * dtype_bytes / tp
    return moe


def mla_attention_bytes_per_token(shape: LayerShape, *, seq_len: int, tp: int, sequence_parallel: bool,
                                  dtype_bytes: int) -> float:
    """Bytes per token multi-latent attention keeps (megatron-core's MLASelfAttention on the local
    spec, mcore_dpo/model/mla.py), beside its input (the input norm's output, counted with the
    norms). On the rank's tokens (s/tp with sequence parallelism: the down projections are
    replicated): each latent norm (q_lora_rank, kv_lora_rank wide; torch's RMSNorm, whose fp32
    weight sends bf16 inputs down torch's composite path) its fp32 input and normalised tensor and
    fp32 1/rms (`_fp32_norm_bytes`), and its output, the up projection's input; without a q
    latent, q_proj keeps only the layer input. On the rank's heads (heads/tp): q and k of the q/k
    head size (the rotary part expanded to every head), v and the context of v_head_dim, and the
    s x s probabilities (fp32, plus a copy in the parameter dtype when narrower). Exact against
    autograd's saved tensors of a tiny bf16 layer at tp 1 and at tp 2 with sequence parallelism
    (tests/test_configs.py, test_mla_layer_bytes_are_what_autograd_saves), beside what is per
    layer, not per token: the RoPE cos/sin of q and k (4 x s x qk_rope_head_dim in the parameter
    dtype) and the mask."""
    sp = tp if sequence_parallel else 1
    latents = _fp32_norm_bytes(shape.kv_lora_rank) + shape.kv_lora_rank * dtype_bytes
    if shape.q_lora_rank:
        latents += _fp32_norm_bytes(shape.q_lora_rank) + shape.q_lora_rank * dtype_bytes
    scores_bytes = FP32_BYTES + (dtype_bytes if dtype_bytes < FP32_BYTES else 0)
    per_head = 2 * (shape.head_dim + shape.v_head_dim) * dtype_bytes + seq_len * scores_bytes
    return latents / sp + shape.heads * per_head / tp


def layer_activation_bytes(
    shape: LayerShape, *, seq_len: int, rows: int, tp: int, sequence_parallel: bool, attention: str, dtype_bytes: int,
    expert_tp: int | None = None, recompute: str = "none", recompute_num_layers: int | None = None, cp: int = 1,
) -> float:
    """Bytes one transformer layer keeps for the backward of one microbatch ([rows, seq_len]);
    under `recompute` (module docstring): full, its share of its group's input. `cp`: a rank keeps
    its seq_len / cp positions of each row (module docstring, context parallelism)."""
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"attention: {attention!r} is not one of {', '.join(ATTENTION_IMPLS)}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute: {recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if recompute == "full":
        return boundary_bytes(shape, seq_len=seq_len, rows=rows, tp=tp, sequence_parallel=sequence_parallel,
                              dtype_bytes=dtype_bytes, cp=cp) / (recompute_num_layers or 1)
    selective = recompute == "selective"
    local = local_seq_len(seq_len, cp)
    tokens = local * rows
    sp = tp if sequence_parallel else 1
    q_width = shape.heads * shape.head_dim
    kv_width = shape.kv_heads * shape.head_dim
    fp32_norms = _fp32_norms(shape, attention)
    if fp32_norms:  # each norm's fp32 tensors; the two pre-norms' outputs are the linears' inputs
        norms = (shape.norms * _fp32_norm_bytes(shape.hidden) + 2 * shape.hidden * dtype_bytes) / sp
    else:  # Transformer Engine's: each norm's input and output
        norms = shape.norms * 2 * shape.hidden * dtype_bytes / sp
    if fp32_norms and shape.qk_norm:  # per head, on this rank's heads
        norms += (_fp32_norm_bytes(q_width, shape.heads) + _fp32_norm_bytes(kv_width, shape.kv_heads)) / tp
    if shape.kv_lora_rank:
        if attention != "local" or selective or cp != 1:
            raise ValueError(f"multi-latent attention: modelled for the local layer spec at cp 1 without selective "
                             f"recompute (got attention {attention!r}, recompute {recompute!r}, cp {cp})")
        attn = mla_attention_bytes_per_token(shape, seq_len=local, tp=tp, sequence_parallel=sequence_parallel,
                                             dtype_bytes=dtype_bytes)
    elif attention == "local" and selective:  # q, k, the qkv output (v's storage), the context
        attn = (3 * q_width + 3 * kv_width) * dtype_bytes / tp
    elif attention == "local":
        scores_bytes = FP32_BYTES + (dtype_bytes if dtype_bytes < FP32_BYTES else 0)
        # q and the context are local; k and v, repeated to every head, cover the whole row (cp x)
        attn = ((2 + 2 * cp) * q_width * dtype_bytes + shape.heads * (local * cp) * scores_bytes) / tp
    else:
        lse = 0 if selective else shape.heads * FP32_BYTES
        attn = ((2 * q_width + 2 * kv_width) * dtype_bytes + lse) / tp
    mlp = mlp_activation_bytes_per_token(shape, tp=tp, dtype_bytes=dtype_bytes, expert_tp=expert_tp,
                                         sequence_parallel=sequence_parallel)
    return tokens * (norms + attn + mlp)


def recompute_bytes(
    shape: LayerShape, *, seq_len: int, rows: int, tp: int, sequence_parallel: bool, attention: str, dtype_bytes: int,
    expert_tp: int | None = None, recompute: str = "none", recompute_num_layers: int | None = None, cp: int = 1,
) -> float:
    """What a backward holds beyond the stash while it recomputes: full, one group's
    activations (recompute_num_layers layers, kept as without recompute); selective, one layer's
    core attention (what selective does not keep); none, nothing."""
    kw = dict(seq_len=seq_len, rows=rows, tp=tp, sequence_parallel=sequence_parallel, attention=attention,
              dtype_bytes=dtype_bytes, expert_tp=expert_tp, cp=cp)
    if recompute == "full":
        return (recompute_num_layers or 1) * layer_activation_bytes(shape, **kw)
    if recompute == "selective":
        return layer_activation_bytes(shape, **kw) - layer_activation_bytes(shape, **kw, recompute="selective")
    return 0.0


def workspace_bytes(
    shape: LayerShape, *, seq_len: int, rows: int, tp: int, sequence_parallel: bool, attention: str, dtype_bytes: int,
    cp: int = 1,
) -> float:
    """megatron-core's persistent buffer (one per dtype, shared by its users): the local
    spec's s x s score matrix (s/cp x s with cp) and the sequence-parallel gather of [s/cp, b, h]."""
    local = local_seq_len(seq_len, cp)
    scores = rows * (shape.heads // tp) * local * (local * cp) if attention == "local" else 0  # keys: the padded row
    gather = local * rows * shape.hidden if sequence_parallel else 0
    return max(scores, gather) * dtype_bytes


def head_bytes(
    shape: LayerShape, *, seq_len: int, rows: int, tp: int, sequence_parallel: bool, attention: str, dtype_bytes: int,
    cp: int = 1,
) -> float:
    """Last stage: the final norm and the fp32 vocab-parallel logits with their gradient (of
    the rank's seq_len / cp positions per row)."""
    tokens = local_seq_len(seq_len, cp) * rows
    sp = tp if sequence_parallel else 1
    if _fp32_norms(shape, attention):  # its fp32 tensors, and its output (the output layer's input)
        final_norm = (_fp32_norm_bytes(shape.hidden) + shape.hidden * dtype_bytes) / sp
    else:  # Transformer Engine's: its input and output
        final_norm = 2 * shape.hidden * dtype_bytes / sp
    logits = 2 * FP32_BYTES * shape.vocab / tp
    return tokens * (final_norm + logits)


def ring_attention_bytes(
    shape: LayerShape, *, seq_len: int, rows: int, tp: int, cp: int, attention: str, dtype_bytes: int
) -> float:
    """What Transformer Engine's ring attention (cp > 1, `flash`) holds beyond a layer's stash
    inside one layer's attention, forward or backward, whichever is larger (module docstring):
    forward, cp received key/value chunks, cp per-step outputs and fp32 log-sum-exps and the fp32
    corrected output; backward, two [KV, dKV] send/receive buffers, the dq accumulator and one
    step's dq, dk, dv. 0 at cp 1 and for the local spec (its all-gathered keys and values are in
    `layer_activation_bytes`)."""
    if cp == 1 or attention != "flash":
        return 0.0
    tokens = local_seq_len(seq_len, cp) * rows
    q_width = shape.heads * shape.head_dim
    kv = 2 * shape.kv_heads * shape.head_dim  # k + v of one position
    forward = cp * (kv + q_width) * dtype_bytes + cp * shape.heads * FP32_BYTES + q_width * FP32_BYTES
    backward = (2 * 2 * kv + q_width + (q_width + kv)) * dtype_bytes
    return tokens * max(forward, backward) / tp


def activation_bytes(
    shape: LayerShape, *, layers: int, seq_len: int, rows: int, tp: int, sequence_parallel: bool, attention: str,
    dtype_bytes: int, expert_tp: int | None = None, recompute: str = "none", recompute_num_layers: int | None = None,
    cp: int = 1,
) -> float:
    """Peak activation bytes of one microbatch's forward + backward through `layers` layers
    and the last stage's head (the peak is where the backward starts), with what the backward
    recomputes under `recompute` and, at cp > 1, what the ring attention holds."""
    kw = dict(seq_len=seq_len, rows=rows, tp=tp, sequence_parallel=sequence_parallel, attention=attention,
              dtype_bytes=dtype_bytes, cp=cp)
    rc = dict(expert_tp=expert_tp, recompute=recompute, recompute_num_layers=recompute_num_layers)
    ring = ring_attention_bytes(shape, seq_len=seq_len, rows=rows, tp=tp, cp=cp, attention=attention,
                                dtype_bytes=dtype_bytes)
    return (layers * layer_activation_bytes(shape, **kw, **rc) + recompute_bytes(shape, **kw, **rc)
            + workspace_bytes(shape, **kw) + head_bytes(shape, **kw) + ring)


def boundary_bytes(shape: LayerShape, *, seq_len: int, rows: int, tp: int, sequence_parallel: bool,
                   dtype_bytes: int, cp: int = 1) -> float:
    """One stage-boundary activation ([s, b, h], or [s/tp, b, h] with sequence parallelism; s/cp
    for s): the unit of the reference activations in flight and carried (`plan_memory`)."""
    return local_seq_len(seq_len, cp) * rows * shape.hidden * dtype_bytes / (tp if sequence_parallel else 1)


def plan_activation_bytes(
    shape: LayerShape, *, layers: int, pp: int, num_microbatches: int, ref_mode: str, seq_len: int, rows: int,
    tp: int, sequence_parallel: bool, attention: str, dtype_bytes: int, expert_tp: int | None = None,
    recompute: str = "none", recompute_num_layers: int | None = None, cp: int = 1, vpp: int = 1,
) -> float:
    """Peak activation bytes of the worst pipeline stage: the plan memory model's peaks
    (`plan_memory.plan_memory`, in units) times each unit's bytes. A stage's policy stash unit
    is one microbatch through its layers/pp layers (under `recompute`, what they keep); the
    last stage adds the head; every stage the workspace and what a backward recomputes
    (`recompute_bytes`) and, at cp > 1, what the ring attention holds (`ring_attention_bytes`),
    all at the rank's seq_len / cp positions per row. Interleaved: the larger of the first step's plan and the carrying one.
    `vpp` > 1 (model chunks): the plan is the interleaved 1F1B one, whose unit is one chunk's
    forward, layers/(pp x vpp) layers (chunk c of stage s: virtual stage c x pp + s; a MoE model's
    first dense layers make chunks unequal, and a stage's unit is then its largest chunk's), and
    which carries as well (the first step's plan and a
    steady one); its first stage holds the most units in flight."""
    from mcore_dpo.pipeline.memory import plan_memory
    from mcore_dpo.pipeline.schedule import build_plan

    kw = dict(seq_len=seq_len, rows=rows, tp=tp, sequence_parallel=sequence_parallel, attention=attention,
              dtype_bytes=dtype_bytes, cp=cp)
    rc = dict(expert_tp=expert_tp, recompute=recompute, recompute_num_layers=recompute_num_layers)
    stash_unit = layers / (pp * vpp) * layer_activation_bytes(shape, **kw, **rc)
    stash_units = [stash_unit] * pp
    if shape.dense_layers:  # a chunk's dense-MLP layers (the first ones of the model) and its MoE layers
        dense = dataclasses.replace(shape, experts=0, topk=0, moe_ffn=0, shared_ffn=0, dense_layers=0)
        per_chunk = layers // (pp * vpp)

        def chunk_bytes(virtual_stage: int) -> float:
            first = virtual_stage * per_chunk
            n_dense = max(0, min(shape.dense_layers, first + per_chunk) - first)
            return (n_dense * layer_activation_bytes(dense, **kw, **rc)
                    + (per_chunk - n_dense) * layer_activation_bytes(shape, **kw, **rc))

        # with chunks, a stage's unit is its largest chunk's (an upper bound: the units in flight
        # at its peak are of several chunks)
        stash_units = [max(chunk_bytes(chunk * pp + stage) for chunk in range(vpp)) for stage in range(pp)]
    recomputing = recompute_bytes(shape, **kw, **rc)
    boundary = boundary_bytes(shape, seq_len=seq_len, rows=rows, tp=tp, sequence_parallel=sequence_parallel,
                              dtype_bytes=dtype_bytes, cp=cp)
    ring = ring_attention_bytes(shape, seq_len=seq_len, rows=rows, tp=tp, cp=cp, attention=attention,
                                dtype_bytes=dtype_bytes)
    plan_mode = ref_mode if ref_mode in ("interleaved", "sequential") else "none"  # others: no reference forward
    variants = [dict()]
    if plan_mode == "interleaved":
        variants = [dict(ref_current=True, carry_out=True), dict(carry_in=True, carry_out=True)]
    peak = 0.0
    for extra in variants:
        plan = build_plan(num_stages=pp, num_microbatches=num_microbatches, ref_mode=plan_mode, num_chunks=vpp,
                          **extra)
        for stage, units in enumerate(plan_memory(plan)):
            stage_bytes = (units.policy_stash * stash_units[stage] + (units.reference_in_flight + units.carried) * boundary
                           + recomputing + workspace_bytes(shape, **kw)
                           + (head_bytes(shape, **kw) if stage == pp - 1 else 0.0) + ring)
            peak = max(peak, stage_bytes)
    return peak


# Bytes per parameter a training rank holds (megatron-core mixed precision, bf16 weights):
# policy weights, fp32 main grads, frozen reference (colocated modes) ...
POLICY_BYTES_PER_PARAM = 2 + 4
REFERENCE_BYTES_PER_PARAM = 2
OPTIMIZER_BYTES_PER_PARAM = 12  # ... and fp32 masters + AdamW m, v, sharded over dp x cp by the distributed optimizer


def bytes_per_param(*, ref_mode: str, optimizer_shards: int) -> float:
    """Bytes a rank keeps per parameter it holds: weights and main grads, the frozen reference
    when colocated, the optimizer state over its `optimizer_shards` ranks."""
    colocated = ref_mode in ("interleaved", "sequential")
    return (POLICY_BYTES_PER_PARAM + (REFERENCE_BYTES_PER_PARAM if colocated else 0)
            + OPTIMIZER_BYTES_PER_PARAM / optimizer_shards)


def optimizer_step_bytes() -> float:
    """What the optimizer step allocates beyond the state counted per parameter. It runs after
    the last backward, when the activations are gone, so a rank's peak is the larger of the
    two. Clipping scales the gradients in place and a GPU's fused AdamW keeps no per-tensor
    temporaries (`optim.clip_in_place`, `platform.fused_adamw`); what is left is the gradient
    norm's fp64 copy of one chunk and its square (`optim.squared_sum`)."""
    return 2 * 8 * NORM_CHUNK


def per_gpu_bytes(
    shape: LayerShape, *, params: int, layers: int, tp: int, pp: int, dp: int, distributed_optimizer: bool,
    micro_batch_size: int, num_microbatches: int, seq_len: int, ref_mode: str, sequence_parallel: bool,
    attention: str, dtype_bytes: int = 2, expert_params: int = 0, ep: int = 1, expert_tp: int | None = None,
    recompute: str = "none", recompute_num_layers: int | None = None, prefix_sharing: bool = False, cp: int = 1,
    vpp: int = 1,
) -> float:
    """Memory of one training rank: parameters, grads and optimizer state per parameter
    (averaged over the tp x pp shards), plus the worst stage's activations under the plan or
    the optimizer step's temporaries, whichever is larger (`optimizer_step_bytes`).

    MoE: `params` counts the parameters outside the routed experts (split over tp x pp, the
    optimizer state over dp), `expert_params` those of the experts (split over ep x expert tp x
    pp, the optimizer state over the expert-data-parallel group); expert tp defaults to the
    trainer's rule (checkpoint_convert.mapping.expert_tp_size): 1 at ep > 1, else tp.
    `recompute`, `recompute_num_layers`: --recompute and --recompute-num-layers (module docstring).
    `prefix_sharing` (padded rows): a microbatch is one row per pair, as wide as its widest
    shared pair, P + C + R + 1 <= 2 x seq_len positions (a one-token prompt whose completions
    both fill seq_len): the same positions as two unshared rows at worst, and a prompt of P
    tokens saves P - 1 of them (data/prefix_sharing.py).
    `cp` (--cp, dense models): the parameters are replicated over cp, the distributed optimizer
    shards its state over dp x cp, and a rank's activations are those of its seq_len / cp
    positions per row plus the ring attention's buffers (module docstring).
    `vpp` (--vpp): model chunks per pipeline rank (`plan_activation_bytes`)."""
    if expert_tp is None:
        expert_tp = 1 if ep > 1 else tp
    if cp < 1:
        raise ValueError(f"cp: must be a positive integer, got {cp}")
    if cp > 1 and (expert_params or shape.experts):
        raise ValueError("cp: context parallelism is for dense models (no routed experts)")
    shards = dp * cp if distributed_optimizer else 1
    dense = params * bytes_per_param(ref_mode=ref_mode, optimizer_shards=shards) / (tp * pp)
    experts = 0.0
    if expert_params:
        edp = expert_data_parallel_size(tp=tp, dp=dp, ep=ep, expert_tp=expert_tp)
        per_param = bytes_per_param(ref_mode=ref_mode, optimizer_shards=edp if distributed_optimizer else 1)
        experts = expert_params * per_param / (ep * expert_tp * pp)
    rows, width = (micro_batch_size, 2 * seq_len) if prefix_sharing else (2 * micro_batch_size, seq_len)
    activations = plan_activation_bytes(
        shape, layers=layers, pp=pp, num_microbatches=num_microbatches, ref_mode=ref_mode, seq_len=width,
        rows=rows, tp=tp, sequence_parallel=sequence_parallel, attention=attention,
        dtype_bytes=dtype_bytes, expert_tp=expert_tp, recompute=recompute, recompute_num_layers=recompute_num_layers,
        cp=cp, vpp=vpp,
    )  # fmt: skip
    return dense + experts + max(activations, optimizer_step_bytes())
