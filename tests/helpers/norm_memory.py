"""What the norms of a tiny Llama stage on the local layer spec save for their backward, on two gloo
ranks: at tp 1 (dp 2) and at tp 2 with sequence parallelism, in bf16 and in fp32; and a Qwen3 stage
(its per-head q/k norms) at tp 1 in bf16. Autograd's saved-tensor hooks, the storages still held
when the forward is done, parameters and buffers left out, each storage counted once per layer (the
final norm: once). Per layer: the whole layer (`layer`), what the norms themselves saved (`norms`:
input_layernorm and pre_mlp_layernorm; `qk_norms`: q_layernorm and k_layernorm) and the bytes of
the two norms' outputs that something in the layer saved (`norm_outputs`: the linears' inputs);
the final norm's own saves and its output's, saved by the output layer. tests/test_memory_estimate.py
checks the numbers against mcore_dpo/tools/memory_estimate.py (the config headers' arithmetic)."""

from __future__ import annotations

import dataclasses

import torch

from checkpoint_convert.families.base import ModelSpec
from tests.helpers.saved_tensors import saved_storages, write_stage_saves

SEQ_LEN, ROWS = 16, 2
# Every width distinct, so that no term of the arithmetic can stand in for another.
LLAMA = ModelSpec(architecture="LlamaForCausalLM", family="llama", vocab_size=120, hidden_size=40, intermediate_size=56,
                  num_layers=2, num_heads=4, num_query_groups=2, head_dim=12, rms_norm_eps=1e-6, rope_theta=10000.0,
                  rope_scaling=None, tie_word_embeddings=False, qkv_bias=False, max_position_embeddings=64,
                  torch_dtype="float32")
QWEN3 = dataclasses.replace(LLAMA, architecture="Qwen3ForCausalLM", family="qwen3", qk_layernorm=True)
# (name, spec, tp, dtype); dp = 2 / tp.
CASES = (("tp1_bf16", LLAMA, 1, "bfloat16"), ("tp1_fp32", LLAMA, 1, "float32"), ("tp2_sp_bf16", LLAMA, 2, "bfloat16"),
         ("tp2_sp_fp32", LLAMA, 2, "float32"), ("qwen3_tp1_bf16", QWEN3, 1, "bfloat16"),
         ("qwen3_tp2_sp_bf16", QWEN3, 2, "bfloat16"))
NORMS = ("input_layernorm", "pre_mlp_layernorm")
QK_NORMS = ("q_layernorm", "k_layernorm")
_NORM_ENDS = tuple(f".{n}" for n in (*NORMS, "final_layernorm"))
_QK_ENDS = tuple(f".{n}" for n in QK_NORMS)


def _saves(model, tokens: torch.Tensor) -> dict[str, dict[str, int]]:
    """Per layer (and "final" for the final norm), the bytes in each group (module docstring)."""
    outputs: dict[str, list[int]] = {}  # layer -> the storages of its norms' outputs

    def layer_of(name: str) -> str | None:
        if name.startswith("decoder.layers."):
            return name.split(".")[2]
        return "final" if name.startswith(("decoder.final_layernorm", "output_layer")) else None

    handles = [module.register_forward_hook(
        lambda _m, _a, out, name=name: outputs.setdefault(layer_of(name), []).append(out.untyped_storage().data_ptr()))
        for name, module in model.named_modules() if name.endswith(_NORM_ENDS)]
    saved: dict[str, dict[str, int]] = {}
    for layer, inner, storage in saved_storages(model, tokens, layer_of=layer_of):
        counts = saved.setdefault(layer, dict.fromkeys(("layer", "norms", "qk_norms", "norm_outputs"), 0))
        counts["layer"] += storage.nbytes()
        if inner.endswith(_NORM_ENDS):
            counts["norms"] += storage.nbytes()
        if inner.endswith(_QK_ENDS):
            counts["qk_norms"] += storage.nbytes()
        if storage.data_ptr() in outputs.get(layer, ()):
            counts["norm_outputs"] += storage.nbytes()
    for handle in handles:
        handle.remove()
    return saved


def rank_main(rank: int, ports: tuple[int, int], out_dir: str) -> None:
    tokens = torch.randint(3, LLAMA.vocab_size, (ROWS, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    write_stage_saves(rank, ports, out_dir, tokens=tokens, measure=_saves,
                      cases=lambda: [(name, tp, spec, getattr(torch, dtype)) for name, spec, tp, dtype in CASES])
