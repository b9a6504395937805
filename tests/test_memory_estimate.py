"""mcore_dpo.tools.memory_estimate (the config headers' activation arithmetic) against the tensor
bytes a real forward + backward holds at its peak.

Measured on the CPU with megatron-core's local layer spec, where the s x s attention
probabilities count, at tp 2 with and without sequence parallelism, fp32 and bf16: every
storage a tensor op allocates inside the measurement is counted from its allocation until it
is freed (a TorchDispatchMode with storage finalizers; parameters and their views are not
allocations), and the peak of the running total is compared with the formula. Tolerance 20%.
With activation recompute (--recompute selective, full with groups of 1 and 2 layers) the same
measurement against the formula's recompute terms: what a layer keeps and what the backward
holds while it reruns a group.
The experts branch: the expert parameters each rank of a tiny MoE model holds, counted exactly,
and a one-rank MoE forward + backward measured the same way. A shared-prompt row
(--prefix-sharing: its own mask and per-token RoPE) is measured against the formula at its
positions.
Context parallelism (--cp): the arithmetic without processes (cp 2 halves a rank's flash
activations at the same length and adds the ring's buffers once, the local spec's scores stay
W per query, the weights are replicated and the optimizer state sharded over dp x cp), and a cp 2
forward + backward of the local spec (keys and values all-gathered over cp) measured on two ranks.
The local spec's norms (fp32 inside) and Gemma 3's layer: autograd's saved tensors, byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import os
import traceback
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mcore_dpo.parallel.ports import free_port

from checkpoint_convert.families.base import ModelSpec
from checkpoint_convert.mapping import padded_vocab_size
from mcore_dpo.tools.memory_estimate import LayerShape, activation_bytes, layer_activation_bytes
from tests.helpers.ranks import spawn_processes

TOLERANCE = 0.20
TP = 2
SEQ_LEN, ROWS, LAYERS = 128, 2, 4
SPEC = ModelSpec(architecture="LlamaForCausalLM", family="llama", vocab_size=120, hidden_size=64, intermediate_size=160,
                 num_layers=LAYERS, num_heads=4, num_query_groups=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                 rope_scaling=None, tie_word_embeddings=False, qkv_bias=False, max_position_embeddings=512,
                 torch_dtype="float32")
CASES = [("float32", False), ("float32", True), ("bfloat16", True)]
# (dtype, sequence parallel, --recompute, --recompute-num-layers)
RECOMPUTE_CASES = [("float32", False, "selective", None), ("float32", False, "full", None), ("float32", True, "full", 2),
                   ("bfloat16", True, "selective", None)]


def _case_key(dtype_name: str, sequence_parallel: bool, recompute: str = "none", group: int | None = None) -> str:
    key = f"{dtype_name}/sp={sequence_parallel}"
    return key if recompute == "none" else f"{key}/recompute={recompute}/{group or 1}"


class PeakTensorBytes(TorchDispatchMode):
    """Running total and peak of the bytes of storages allocated by tensor ops in the mode."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in seen or key in self._sizes:  # a view, in place, or already counted
                continue
            self._sizes[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)


def _join_mesh(rank: int, port: int, layout):
    """This rank's platform and megatron-core mesh of `layout` (its world: tp x pp x dp x cp), the
    model RNG seeded: what every measuring rank function below starts with."""
    from mcore_dpo.parallel import mesh as mesh_lib
    from mcore_dpo.parallel import platform as plat

    platform = plat.detect()
    plat.activate(platform)
    plat.init_process_group(platform, rank=rank, world_size=layout.tp * layout.pp * layout.dp * layout.cp,
                            master_addr="127.0.0.1", master_port=port, timeout_s=120.0)
    mesh = mesh_lib.initialize(layout)
    plat.init_model_rng(platform, 0)
    return platform, mesh


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ["MCORE_DPO_FORCE_CPU"] = "1"
    try:
        from mcore_dpo.parallel import mesh as mesh_lib
        from mcore_dpo.parallel import platform as plat
        from mcore_dpo.objective.logprobs import sequence_logps
        from mcore_dpo.model.builder import build_stage_model, causal_mask, stage_forward

        platform, mesh = _join_mesh(rank, port, mesh_lib.Layout(tp=TP, pp=1, dp=1))
        tokens = torch.randint(3, SPEC.vocab_size, (ROWS, SEQ_LEN), generator=torch.Generator().manual_seed(0))
        mask = causal_mask(SEQ_LEN, device=torch.device("cpu"))
        loss_mask = torch.ones(ROWS, SEQ_LEN)
        peaks = {}
        for dtype_name, sequence_parallel, recompute, group in [(*c, "none", None) for c in CASES] + RECOMPUTE_CASES:
            with plat.building_models(platform):
                model = build_stage_model(SPEC, mesh=mesh, dtype=getattr(torch, dtype_name), on_gpu=False, use_te=False,
                                          sequence_parallel=sequence_parallel, recompute=recompute,
                                          recompute_num_layers=group)

            def loss() -> torch.Tensor:  # the logits die with this frame, as in the pipeline
                logits = stage_forward(model, tokens=tokens, input_tensor=None, mask=mask)
                logps = sequence_logps(logits, tokens, loss_mask, vocab_size=SPEC.vocab_size, tp_rank=mesh.tp_rank,
                                       tp_group=mesh.tp_group)
                return logps.logp_sum.sum()

            meter = PeakTensorBytes()
            with meter:  # one fresh step: megatron-core's persistent workspace is allocated in it
                loss().backward()
            peaks[_case_key(dtype_name, sequence_parallel, recompute, group)] = meter.peak
            del model
        # --prefix-sharing: one shared row of SEQ_LEN positions (a pair whose prompt, computed
        # once, is half of it), its own mask and per-token RoPE.
        from mcore_dpo.data.pairs import TokenizedPair
        from mcore_dpo.data.prefix_sharing import collate_shared
        from mcore_dpo.model.builder import segment_mask

        ids = tokens[0].tolist()
        pair = TokenizedPair(prompt_ids=tuple(ids[:64]), chosen_ids=tuple(ids[64:95]), rejected_ids=tuple(ids[95:127]),
                             source_line=1)
        row = collate_shared([pair], pad_token_id=0, seq_len=SEQ_LEN)
        assert int((row.segment_ids < 2).sum()) == SEQ_LEN  # no padding
        with plat.building_models(platform):
            model = build_stage_model(SPEC, mesh=mesh, dtype=torch.float32, on_gpu=False, use_te=False,
                                      arbitrary_masks=True)
        meter = PeakTensorBytes()
        with meter:
            logits = stage_forward(model, tokens=row.tokens, input_tensor=None, position_ids=row.position_ids,
                                   num_positions=row.num_positions,
                                   mask=segment_mask(row.segment_ids, shared_prompt=row.shared_prompt, num_sequences=2))
            logps = sequence_logps(logits, row.labels, row.loss_mask, vocab_size=SPEC.vocab_size, tp_rank=mesh.tp_rank,
                                   tp_group=mesh.tp_group, segment_ids=row.segment_ids, num_sequences=2)
            del logits
            logps.logp_sum.sum().backward()
        peaks["float32/sp=False/shared"] = meter.peak
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(peaks))
        mesh_lib.destroy()
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, int]:
    out_dir = tmp_path_factory.mktemp("activation_memory")
    spawn_processes(_rank_main, nprocs=TP, args=(free_port(), str(out_dir)))
    return json.loads((out_dir / "rank0.json").read_text())


def _estimate(dtype_name: str, sequence_parallel: bool, attention: str = "local", recompute: str = "none",
              group: int | None = None, rows: int = ROWS) -> float:
    shape = LayerShape(hidden=SPEC.hidden_size, heads=SPEC.num_heads, kv_heads=SPEC.num_query_groups,
                       head_dim=SPEC.head_dim, ffn=SPEC.intermediate_size,
                       vocab=padded_vocab_size(SPEC.vocab_size, tp=TP))
    return activation_bytes(shape, layers=LAYERS, seq_len=SEQ_LEN, rows=rows, tp=TP, sequence_parallel=sequence_parallel,
                            attention=attention, dtype_bytes=torch.tensor([], dtype=getattr(torch, dtype_name)).element_size(),
                            recompute=recompute, recompute_num_layers=group)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-sp{int(c[1])}")
def test_estimate_matches_measured_peak(measured, case):
    dtype_name, sequence_parallel = case
    peak = measured[f"{dtype_name}/sp={sequence_parallel}"]
    estimate = _estimate(dtype_name, sequence_parallel)
    assert abs(estimate / peak - 1) <= TOLERANCE, f"{case}: estimate {estimate:.0f} B, measured peak {peak} B"


@pytest.mark.parametrize("case", RECOMPUTE_CASES, ids=lambda c: f"{c[0]}-sp{int(c[1])}-{c[2]}{c[3] or ''}")
def test_recompute_estimate_matches_measured_peak(measured, case):
    peak = measured[_case_key(*case)]
    estimate = _estimate(*case[:2], recompute=case[2], group=case[3])
    assert abs(estimate / peak - 1) <= TOLERANCE, f"{case}: estimate {estimate:.0f} B, measured peak {peak} B"


def test_recompute_lowers_the_peak_as_the_estimate_says(measured):
    # Measured and estimated alike: selective below none, full below selective (the s x s
    # probabilities are a fraction of a layer here, all its activations more); the estimate
    # without its recompute terms would miss full recompute's peak.
    none, selective, full = (measured[_case_key("float32", False, rc)] for rc in ("none", "selective", "full"))
    assert full < selective < none
    estimates = [_estimate("float32", False, recompute=rc) for rc in ("none", "selective", "full")]
    assert estimates[2] < estimates[1] < estimates[0]
    assert abs(estimates[0] / full - 1) > TOLERANCE


def test_shared_row_estimate_matches_measured_peak(measured):
    """A shared-prompt row is a row of its positions: one row of SEQ_LEN, half the two rows' peak."""
    peak = measured["float32/sp=False/shared"]
    estimate = _estimate("float32", False, rows=1)
    assert abs(estimate / peak - 1) <= TOLERANCE, f"shared row: estimate {estimate:.0f} B, measured peak {peak} B"
    assert peak < 0.6 * measured["float32/sp=False"]


def test_sequence_parallel_lowers_the_peak(measured):
    assert measured["float32/sp=True"] < measured["float32/sp=False"]
    assert _estimate("float32", True) < _estimate("float32", False)


def test_flash_estimate_would_miss_the_local_scores(measured):
    # The attention implementation matters at this size: the flash arithmetic (no s x s
    # probabilities) falls outside the tolerance of what the local spec holds.
    assert _estimate("float32", True, attention="flash") < (1 - TOLERANCE) * measured["float32/sp=True"]


# ---------------------------------------------------------------------------------------
# The experts branch: parameters per rank, against what each rank of a tiny MoE model holds
# (the key map the trainer loads with: checkpoint_convert.mapping.hf_to_mcore_shard). No processes.
# ---------------------------------------------------------------------------------------


def _tiny_moe_spec(*, mlp_only_layers: list[int]) -> ModelSpec:
    from transformers import Qwen3MoeConfig

    from checkpoint_convert.families import spec_from_hf_config

    config = Qwen3MoeConfig(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=24,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=mlp_only_layers)
    return spec_from_hf_config(config.to_dict())


def _moe_shape(spec: ModelSpec) -> LayerShape:
    return LayerShape(hidden=spec.hidden_size, heads=spec.num_heads, kv_heads=spec.num_query_groups, head_dim=spec.head_dim,
                      ffn=spec.intermediate_size, vocab=padded_vocab_size(spec.vocab_size, tp=1),
                      experts=spec.num_experts, topk=spec.moe_topk, moe_ffn=spec.moe_intermediate_size)


def _held(spec: ModelSpec, *, tp: int, t: int, pp: int, p: int, ep: int, e: int) -> tuple[int, int]:
    """(expert, other) parameter counts rank (t, p, e) holds."""
    from checkpoint_convert.mapping import hf_tensor_shapes, hf_to_mcore_shard, stage_layers

    shapes = hf_tensor_shapes(spec)
    shard = hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep, ep_rank=e,
                              get=lambda name: torch.zeros(shapes[name]))
    assert stage_layers(spec.num_layers, pp=pp, pp_rank=p)  # every stage holds layers
    experts = sum(v.numel() for n, v in shard.items() if ".local_experts." in n)
    return experts, sum(v.numel() for v in shard.values()) - experts


@pytest.mark.parametrize("layout", [(1, 1, 1), (1, 2, 2), (2, 1, 4), (2, 2, 2)], ids=lambda l: "tp{}-pp{}-ep{}".format(*l))
def test_expert_params_per_rank_is_the_exact_count(layout):
    """Every rank holds E/ep experts of each MoE layer of its stage, split over expert tp
    (mapping.expert_tp_size: 1 at ep > 1, whole experts): exactly expert_params_per_rank; over
    all (tp, ep) ranks, each expert parameter once per tp rank that repeats its slice."""
    from checkpoint_convert.mapping import expert_tp_size, stage_layers
    from mcore_dpo.tools.memory_estimate import expert_param_count, expert_params_per_rank

    tp, pp, ep = layout
    etp = expert_tp_size(tp=tp, ep=ep)
    spec = _tiny_moe_spec(mlp_only_layers=[1])  # stages with 1 and 2 MoE layers at pp 2
    shape = _moe_shape(spec)
    total = 0
    for p in range(pp):
        moe_layers = sum(spec.is_moe_layer(layer) for layer in stage_layers(spec.num_layers, pp=pp, pp_rank=p))
        for t in range(tp):
            for e in range(ep):
                experts, _ = _held(spec, tp=tp, t=t, pp=pp, p=p, ep=ep, e=e)
                assert experts == expert_params_per_rank(shape, moe_layers=moe_layers, ep=ep, expert_tp=etp), (layout, p, t, e)
                total += experts
    assert total == expert_param_count(shape, moe_layers=len(spec.moe_layers)) * (tp // etp)
    assert total // (tp // etp) == 3 * spec.num_experts * 3 * spec.hidden_size * spec.moe_intermediate_size  # 3 MoE layers of 4


def test_per_gpu_bytes_expert_term_is_the_held_experts_times_their_bytes():
    """All layers MoE, even stages: per_gpu_bytes with the experts minus without them is the
    exact count on each rank times its bytes per parameter, the optimizer state sharded over
    the ranks holding the same experts (counted here from the layout: the rank at tp rank t, dp
    rank d has ep rank (t + tp·d) mod ep, its experts whole)."""
    from mcore_dpo.tools.memory_estimate import bytes_per_param, expert_data_parallel_size, expert_param_count, per_gpu_bytes

    spec = _tiny_moe_spec(mlp_only_layers=[])
    shape = _moe_shape(spec)
    tp, pp, dp, ep = 2, 2, 4, 2
    groups: dict[int, int] = {}
    for t in range(tp):
        for d in range(dp):
            groups[(t + tp * d) % ep] = groups.get((t + tp * d) % ep, 0) + 1
    edp = expert_data_parallel_size(tp=tp, dp=dp, ep=ep, expert_tp=1)
    assert set(groups.values()) == {edp} == {4}
    held = {_held(spec, tp=tp, t=t, pp=pp, p=p, ep=ep, e=e)[0] for t in range(tp) for p in range(pp) for e in range(ep)}
    assert len(held) == 1  # even: every rank holds the same count
    count = held.pop()
    kw = dict(params=1000, layers=spec.num_layers, tp=tp, pp=pp, dp=dp, micro_batch_size=1, num_microbatches=4,
              seq_len=16, ref_mode="interleaved", sequence_parallel=False, attention="local")
    expert_params = expert_param_count(shape, moe_layers=spec.num_layers)
    for distributed, shards in ((True, edp), (False, 1)):
        with_experts = per_gpu_bytes(shape, **kw, distributed_optimizer=distributed, expert_params=expert_params, ep=ep)
        without = per_gpu_bytes(shape, **kw, distributed_optimizer=distributed, ep=ep)
        expected = count * bytes_per_param(ref_mode="interleaved", optimizer_shards=shards)
        assert with_experts - without == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="does not divide"):
        expert_data_parallel_size(tp=1, dp=3, ep=2, expert_tp=1)


def test_moe_activations_count_the_routed_copies():
    """The MoE layer's MLP term: router 2E fp32 + 2kh routed copies + 5k f_moe / expert tp per
    token; a dense shape keeps 5f / tp."""
    from mcore_dpo.tools.memory_estimate import mlp_activation_bytes_per_token

    shape = _moe_shape(_tiny_moe_spec(mlp_only_layers=[]))
    h, k, f, e = shape.hidden, shape.topk, shape.moe_ffn, shape.experts
    assert mlp_activation_bytes_per_token(shape, tp=2, dtype_bytes=2) == 2 * e * 4 + 2 * k * h * 2 + 5 * k * f * 2 / 2
    assert mlp_activation_bytes_per_token(shape, tp=2, dtype_bytes=2, expert_tp=1) == 2 * e * 4 + 2 * k * h * 2 + 5 * k * f * 2
    dense = LayerShape(hidden=h, heads=4, kv_heads=2, head_dim=16, ffn=64, vocab=128)
    assert mlp_activation_bytes_per_token(dense, tp=2, dtype_bytes=2) == 5 * 64 * 2 / 2


# The MoE layer's activations, measured: one rank (ep 1, so every routed copy stays on it), a
# Mixtral-shaped model whose MLP term (router, routed copies, expert MLPs) is most of a layer's.
MOE_SEQ_LEN, MOE_ROWS = 64, 2


def _moe_measure_spec() -> ModelSpec:
    from transformers import MixtralConfig

    from checkpoint_convert.families import spec_from_hf_config

    config = MixtralConfig(vocab_size=120, hidden_size=64, intermediate_size=192, num_hidden_layers=LAYERS,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=512, tie_word_embeddings=False)
    return spec_from_hf_config(config.to_dict())


def _moe_rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ["MCORE_DPO_FORCE_CPU"] = "1"
    try:
        from mcore_dpo.parallel import mesh as mesh_lib
        from mcore_dpo.parallel import platform as plat
        from mcore_dpo.objective.logprobs import sequence_logps
        from mcore_dpo.model.builder import build_stage_model, causal_mask, stage_forward

        spec = _moe_measure_spec()
        platform, mesh = _join_mesh(rank, port, mesh_lib.Layout(tp=1, pp=1, dp=1))
        with plat.building_models(platform):
            model = build_stage_model(spec, mesh=mesh, dtype=torch.float32, on_gpu=False, use_te=False)
        tokens = torch.randint(3, spec.vocab_size, (MOE_ROWS, MOE_SEQ_LEN), generator=torch.Generator().manual_seed(0))
        mask = causal_mask(MOE_SEQ_LEN, device=torch.device("cpu"))

        def loss() -> torch.Tensor:
            logits = stage_forward(model, tokens=tokens, input_tensor=None, mask=mask)
            logps = sequence_logps(logits, tokens, torch.ones(MOE_ROWS, MOE_SEQ_LEN), vocab_size=spec.vocab_size,
                                   tp_rank=0, tp_group=mesh.tp_group)
            return logps.logp_sum.sum()

        meter = PeakTensorBytes()
        with meter:
            loss().backward()
        Path(out_dir, "moe.json").write_text(json.dumps({"peak": meter.peak}))
        mesh_lib.destroy()
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def test_moe_estimate_matches_measured_peak(tmp_path):
    spawn_processes(_moe_rank_main, nprocs=1, args=(free_port(), str(tmp_path)))
    peak = json.loads((tmp_path / "moe.json").read_text())["peak"]
    spec = _moe_measure_spec()
    shape = _moe_shape(spec)
    assert shape.moe_ffn == 192 and shape.experts == 4
    kw = dict(layers=LAYERS, seq_len=MOE_SEQ_LEN, rows=MOE_ROWS, tp=1, sequence_parallel=False, attention="local",
              dtype_bytes=4)
    estimate = activation_bytes(shape, **kw)
    assert abs(estimate / peak - 1) <= TOLERANCE, f"MoE: estimate {estimate:.0f} B, measured peak {peak} B"
    # The routed term matters at this size: counting one copy per token instead of k misses it.
    one_copy = activation_bytes(dataclasses.replace(shape, topk=1), **kw)
    assert abs(one_copy / peak - 1) > TOLERANCE, f"MoE: one-copy estimate {one_copy:.0f} B, measured peak {peak} B"


# ---------------------------------------------------------------------------------------
# Context parallelism (--cp): the arithmetic without processes, and one cp 2 forward + backward
# of the local spec (keys and values all-gathered over cp: model/cp_attention.py) measured.
# ---------------------------------------------------------------------------------------


def _dense_shape(tp: int = TP) -> LayerShape:
    return LayerShape(hidden=SPEC.hidden_size, heads=SPEC.num_heads, kv_heads=SPEC.num_query_groups,
                      head_dim=SPEC.head_dim, ffn=SPEC.intermediate_size,
                      vocab=padded_vocab_size(SPEC.vocab_size, tp=tp))


def _cp_rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ["MCORE_DPO_FORCE_CPU"] = "1"
    try:
        from mcore_dpo.parallel import mesh as mesh_lib
        from mcore_dpo.parallel import platform as plat
        from mcore_dpo.parallel.context_parallel import local_part, local_positions
        from mcore_dpo.objective.logprobs import sequence_logps
        from mcore_dpo.model.builder import build_stage_model, causal_mask, stage_forward

        platform, mesh = _join_mesh(rank, port, mesh_lib.Layout(tp=1, pp=1, dp=1, cp=2))
        with plat.building_models(platform):
            model = build_stage_model(SPEC, mesh=mesh, dtype=torch.float32, on_gpu=False, use_te=False)
        tokens = torch.randint(3, SPEC.vocab_size, (ROWS, SEQ_LEN), generator=torch.Generator().manual_seed(0))
        positions = local_positions(SEQ_LEN, cp=2, cp_rank=rank)
        mine = local_part(tokens, dim=1, cp=2, cp_rank=rank)
        # This rank's queries against the whole row's keys, in position order (cp_attention.py).
        mask = causal_mask(SEQ_LEN, device=torch.device("cpu")).index_select(2, positions)
        position_ids = positions.unsqueeze(0).expand(ROWS, -1)

        def loss() -> torch.Tensor:
            logits = stage_forward(model, tokens=mine, input_tensor=None, mask=mask, position_ids=position_ids,
                                   num_positions=SEQ_LEN)
            logps = sequence_logps(logits, mine, torch.ones(ROWS, mine.shape[1]), vocab_size=SPEC.vocab_size,
                                   tp_rank=0, tp_group=mesh.tp_group)
            return logps.logp_sum.sum()

        meter = PeakTensorBytes()
        with meter:
            loss().backward()
        Path(out_dir, f"cp_rank{rank}.json").write_text(json.dumps({"peak": meter.peak}))
        mesh_lib.destroy()
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def test_cp_estimate_matches_measured_peak(tmp_path):
    """cp 2 (tp 1, fp32, the local spec): each rank's peak against the estimate at cp 2 (W/2
    positions per row, the whole row's repeated keys and values and W/2 x W scores). Both
    simpler readings miss it: the whole row on each rank (cp ignored), and a row of W/2 (the
    keys and scores of the rank's positions only)."""
    spawn_processes(_cp_rank_main, nprocs=2, args=(free_port(), str(tmp_path)))
    peaks = [json.loads((tmp_path / f"cp_rank{r}.json").read_text())["peak"] for r in range(2)]
    kw = dict(layers=LAYERS, rows=ROWS, tp=1, sequence_parallel=False, attention="local", dtype_bytes=4)
    shape = _dense_shape(tp=1)
    estimate = activation_bytes(shape, seq_len=SEQ_LEN, cp=2, **kw)
    ignored = activation_bytes(shape, seq_len=SEQ_LEN, **kw)
    halved = activation_bytes(shape, seq_len=SEQ_LEN // 2, **kw)
    for rank, peak in enumerate(peaks):
        assert abs(estimate / peak - 1) <= TOLERANCE, f"cp rank {rank}: estimate {estimate:.0f} B, measured {peak} B"
        assert abs(ignored / peak - 1) > TOLERANCE and abs(halved / peak - 1) > TOLERANCE, (rank, peak, ignored, halved)


def test_cp_halves_a_ranks_flash_activations_at_the_same_length():
    """Flash attention: every per-token term counts a rank's W/cp positions, so at cp 2 a layer
    (under each --recompute), the head, the sequence-parallel workspace and a stage-boundary
    activation are half of cp 1's at the same length; the ring attention's buffers are added
    once, only at cp > 1."""
    from mcore_dpo.tools.memory_estimate import (boundary_bytes, head_bytes, layer_activation_bytes,
                                                 ring_attention_bytes, workspace_bytes)

    shape = _dense_shape()
    kw = dict(seq_len=1024, rows=2, tp=TP, sequence_parallel=True, attention="flash", dtype_bytes=2)
    for recompute in ("none", "selective", "full"):
        one = layer_activation_bytes(shape, **kw, recompute=recompute)
        assert layer_activation_bytes(shape, **kw, recompute=recompute, cp=2) == one / 2, recompute
        assert layer_activation_bytes(shape, **kw, recompute=recompute, cp=4) == one / 4, recompute
    for term in (head_bytes, workspace_bytes):
        assert term(shape, **kw, cp=2) == term(shape, **kw) / 2, term.__name__
    no_attention = {k: v for k, v in kw.items() if k != "attention"}
    assert boundary_bytes(shape, **no_attention, cp=2) == boundary_bytes(shape, **no_attention) / 2
    ring = ring_attention_bytes(shape, seq_len=1024, rows=2, tp=TP, cp=2, attention="flash", dtype_bytes=2)
    assert ring > 0
    assert ring_attention_bytes(shape, seq_len=1024, rows=2, tp=TP, cp=1, attention="flash", dtype_bytes=2) == 0
    assert ring_attention_bytes(shape, seq_len=1024, rows=2, tp=TP, cp=2, attention="local", dtype_bytes=2) == 0
    halves = (LAYERS * layer_activation_bytes(shape, **kw) + head_bytes(shape, **kw) + workspace_bytes(shape, **kw)) / 2
    assert activation_bytes(shape, layers=LAYERS, **kw, cp=2) == pytest.approx(halves + ring, rel=1e-12)
    assert activation_bytes(shape, layers=LAYERS, **kw) == pytest.approx(2 * halves, rel=1e-12)


def test_ring_attention_bytes_are_the_stated_buffers():
    """Transformer Engine's p2p ring, per local token / tp: forward, cp k+v chunks, cp per-step
    outputs and fp32 log-sum-exps, the fp32 corrected output; backward, two [KV, dKV] buffers,
    the dq accumulator, one step's dq, dk, dv; the larger of the two (the forward at cp 2 for this
    shape, the backward at bigger kv / q ratios and small cp)."""
    from mcore_dpo.tools.memory_estimate import ring_attention_bytes

    shape = LayerShape(hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128512)
    q, kv = 32 * 128, 2 * 8 * 128
    tokens = 16384 * 2  # 32768 positions over cp 2, two rows
    forward = 2 * (kv + q) * 2 + 2 * 32 * 4 + q * 4
    backward = (4 * kv + q + q + kv) * 2
    assert (forward, backward) == (41216, 36864)
    got = ring_attention_bytes(shape, seq_len=32768, rows=2, tp=4, cp=2, attention="flash", dtype_bytes=2)
    assert got == tokens * forward / 4
    mha = LayerShape(hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=14336, vocab=128512)  # kv = 2q: the backward
    q, kv = 32 * 128, 2 * 32 * 128
    backward = (4 * kv + q + q + kv) * 2
    assert backward > 2 * (kv + q) * 2 + 2 * 32 * 4 + q * 4
    assert ring_attention_bytes(mha, seq_len=32768, rows=2, tp=4, cp=2, attention="flash", dtype_bytes=2) == tokens * backward / 4


def test_cp_local_attention_sees_the_whole_row():
    """The local spec at cp 2: the rank's queries attend over the whole row's keys, so its
    scores stay W per query (the W/2 x W workspace is half of W x W, not a quarter) and the
    layer keeps more than half of cp 1's."""
    from mcore_dpo.tools.memory_estimate import layer_activation_bytes, workspace_bytes

    shape = _dense_shape()
    kw = dict(seq_len=1024, rows=2, tp=TP, sequence_parallel=False, attention="local", dtype_bytes=4)
    assert workspace_bytes(shape, **kw, cp=2) == 2 * (shape.heads // TP) * 512 * 1024 * 4
    assert workspace_bytes(shape, **kw, cp=2) == workspace_bytes(shape, **kw) / 2
    one, two = layer_activation_bytes(shape, **kw), layer_activation_bytes(shape, **kw, cp=2)
    assert one / 2 < two < one
    # selective keeps only the rank's own q, k, v and context: exactly half
    assert layer_activation_bytes(shape, **kw, recompute="selective", cp=2) == \
        layer_activation_bytes(shape, **kw, recompute="selective") / 2


def test_per_gpu_bytes_cp_replicates_the_weights_and_shards_the_optimizer_over_dp_cp():
    """The per-parameter term at cp 2: the same weights and grads per rank as cp 1 (each cp rank
    holds the whole stage), the distributed optimizer's 12 B over dp x cp; without the
    distributed optimizer, cp changes nothing per parameter."""
    from mcore_dpo.tools.memory_estimate import OPTIMIZER_BYTES_PER_PARAM, bytes_per_param, per_gpu_bytes

    shape = _dense_shape(tp=2)
    params = 10**9
    kw = dict(layers=LAYERS, tp=2, pp=2, dp=3, micro_batch_size=1, num_microbatches=6, seq_len=256,
              ref_mode="interleaved", sequence_parallel=True, attention="flash")

    def param_term(*, cp: int, distributed: bool) -> float:
        return (per_gpu_bytes(shape, params=params, **kw, cp=cp, distributed_optimizer=distributed)
                - per_gpu_bytes(shape, params=0, **kw, cp=cp, distributed_optimizer=distributed))

    for cp in (1, 2, 4):
        expected = params * bytes_per_param(ref_mode="interleaved", optimizer_shards=3 * cp) / 4
        assert param_term(cp=cp, distributed=True) == pytest.approx(expected, rel=1e-9), cp
        assert param_term(cp=cp, distributed=False) == pytest.approx(param_term(cp=1, distributed=False), rel=1e-9)
    saved = param_term(cp=1, distributed=True) - param_term(cp=2, distributed=True)
    assert saved == pytest.approx(params * OPTIMIZER_BYTES_PER_PARAM * (1 / 3 - 1 / 6) / 4, rel=1e-9)


def test_cp_bad_values_and_padding():
    """A rank's share of a row: the row padded to a multiple of 2 x cp, then split; cp 1 leaves
    it as it is. cp < 1 and cp with routed experts are refused with one line."""
    from mcore_dpo.tools.memory_estimate import local_seq_len, per_gpu_bytes

    assert local_seq_len(1000, 1) == 1000 and local_seq_len(1001, 1) == 1001
    assert local_seq_len(1000, 2) == 500 and local_seq_len(1001, 2) == 502 and local_seq_len(10, 4) == 4
    with pytest.raises(ValueError, match="cp: must be a positive integer, got 0"):
        local_seq_len(1000, 0)
    spec = _tiny_moe_spec(mlp_only_layers=[])
    kw = dict(params=1000, layers=spec.num_layers, tp=1, pp=1, dp=2, distributed_optimizer=True, micro_batch_size=1,
              num_microbatches=2, seq_len=16, ref_mode="interleaved", sequence_parallel=False, attention="local")
    with pytest.raises(ValueError, match="cp: context parallelism is for dense models"):
        per_gpu_bytes(_moe_shape(spec), **kw, cp=2)
    with pytest.raises(ValueError, match="cp: must be a positive integer"):
        per_gpu_bytes(_dense_shape(tp=1), **kw, cp=0)


def test_local_norms_are_what_autograd_saves(tmp_path):
    """The local spec's norms (torch's RMSNorm: built without a dtype, its weight is fp32 whatever
    the parameter dtype, and it normalises in fp32) against what a tiny Llama stage saves for its
    backward on two gloo ranks (tests/helpers/norm_memory.py), at tp 1 and at tp 2 with sequence
    parallelism, in bf16 and in fp32, byte for byte: each norm keeps its input cast to fp32 (in
    fp32, the input itself), the normalised fp32 tensor and the fp32 1/rms, 8h + 4 B per token of
    the rank (`_fp32_norm_bytes`), and the linear after it keeps its output (h in the parameter
    dtype). With them the whole layer (`layer_activation_bytes`, beside its RoPE cos/sin and the
    mask, which are per layer) and the final norm (`head_bytes` without the fp32 logits, which the
    log-prob kernel keeps) are exact; so is a Qwen3 layer (bf16, tp 1 and tp 2 with sequence
    parallelism), whose per-head q/k norms keep the same fp32 tensors per head of the rank. The former count, 3h in the parameter dtype per norm,
    was 4h + 4 B per token short in bf16 and 4 B in fp32."""
    from mcore_dpo.tools.memory_estimate import FP32_BYTES, _fp32_norm_bytes, head_bytes
    from tests.helpers import norm_memory

    spawn_processes(norm_memory.rank_main, nprocs=2, args=((free_port(), free_port()), str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    s, rows = norm_memory.SEQ_LEN, norm_memory.ROWS
    for name, spec, tp, dtype_name in norm_memory.CASES:
        h, dtype_bytes = spec.hidden_size, torch.tensor([], dtype=getattr(torch, dtype_name)).element_size()
        shape = LayerShape(hidden=h, heads=spec.num_heads, kv_heads=spec.num_query_groups, head_dim=spec.head_dim,
                           ffn=spec.intermediate_size, vocab=padded_vocab_size(spec.vocab_size, tp=tp),
                           qk_norm=spec.qk_layernorm)
        kw = dict(seq_len=s, rows=rows, tp=tp, sequence_parallel=tp > 1, attention="local", dtype_bytes=dtype_bytes)
        tokens = s * rows // tp  # the rank's tokens, on which the norms run (sequence parallel at tp 2)
        heads, kv_heads = spec.num_heads // tp, spec.num_query_groups // tp
        # The q/k norms run on the rank's heads over the whole sequence (after the sequence-parallel gather).
        qk_norms = (s * rows * (_fp32_norm_bytes(heads * spec.head_dim, heads)
                                + _fp32_norm_bytes(kv_heads * spec.head_dim, kv_heads)) if spec.qk_layernorm else 0)
        per_layer = 4 * s * spec.head_dim * dtype_bytes + s * s  # RoPE cos/sin of q and k, the causal mask
        layer = layer_activation_bytes(shape, **kw) + per_layer
        final = head_bytes(shape, **kw) - s * rows * 2 * FP32_BYTES * shape.vocab / tp
        for rank in ranks:
            measured = rank[name]
            for index in ("0", "1"):
                assert measured[index] == {"layer": layer, "norms": 2 * tokens * (8 * h + 4), "qk_norms": qk_norms,
                                           "norm_outputs": 2 * tokens * h * dtype_bytes}, (name, index, measured)
            assert measured["final"] == {"layer": final, "norms": tokens * (8 * h + 4), "qk_norms": 0,
                                         "norm_outputs": tokens * h * dtype_bytes}, (name, measured)
        # Beyond the former 3h per norm: the fp32 copy of the input (bf16) and the 1/rms.
        norm = (ranks[0][name]["final"]["norms"] + ranks[0][name]["final"]["norm_outputs"]) / tokens
        assert norm - 3 * h * dtype_bytes == (4 * h + 4 if dtype_bytes == 2 else 4), name


GEMMA_SEQ_LEN, GEMMA_ROWS = 64, 2


def _gemma_measure_spec() -> ModelSpec:
    from transformers import Gemma3TextConfig

    from checkpoint_convert.families import spec_from_hf_config
    from tests.helpers.gemma import CONFIG

    config = Gemma3TextConfig(**{**CONFIG, "hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "head_dim": 20, "intermediate_size": 80, "sliding_window": 16})
    return spec_from_hf_config(config.to_dict())


def _gemma_rank_main(rank: int, port: int, out_dir: str) -> None:
    """What each layer of a bf16 Gemma 3 stage saves for its backward: autograd's saved-tensor
    hooks, storages deduplicated within the layer, parameters left out."""
    os.environ["MCORE_DPO_FORCE_CPU"] = "1"
    try:
        from mcore_dpo.parallel import mesh as mesh_lib
        from mcore_dpo.parallel import platform as plat
        from mcore_dpo.model.builder import build_stage_model, causal_mask, stage_forward

        spec = _gemma_measure_spec()
        platform, mesh = _join_mesh(rank, port, mesh_lib.Layout(tp=1, pp=1, dp=1))
        with plat.building_models(platform):
            model = build_stage_model(spec, mesh=mesh, dtype=torch.bfloat16, on_gpu=False, use_te=False)
        tokens = torch.randint(3, spec.vocab_size, (GEMMA_ROWS, GEMMA_SEQ_LEN), generator=torch.Generator().manual_seed(0))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        current: list[int | None] = [None]
        saved: dict[int, dict[int, int]] = {}
        for index, layer in enumerate(model.decoder.layers):
            layer.register_forward_pre_hook(lambda *_, index=index: current.__setitem__(0, index))
            layer.register_forward_hook(lambda *_: current.__setitem__(0, None))

        def pack(t):
            storage = t.untyped_storage()
            if current[0] is not None and storage.data_ptr() not in params:
                saved.setdefault(current[0], {})[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stage_forward(model, tokens=tokens, input_tensor=None, mask=causal_mask(GEMMA_SEQ_LEN, device=torch.device("cpu")))
        Path(out_dir, "gemma.json").write_text(json.dumps({i: sum(s.values()) for i, s in saved.items()}))
        mesh_lib.destroy()
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def test_gemma_layer_estimate_is_what_autograd_saves(tmp_path):
    """configs/gemma3_27b.yaml's per-layer activation count (four fp32 norms, q/k norms, local
    attention with its s x s probabilities, the GeGLU MLP) against a bf16 Gemma 3 layer, exactly:
    beyond the per-token formula each layer saves only its RoPE cos/sin for q and k (4 x s x
    head_dim, bf16), the mask (the causal one, shared by every layer, or a local layer's own
    windowed one, [1, 1, s, s] bool for rows sharing their positions) and each norm's fp32 (1 + w)."""
    spawn_processes(_gemma_rank_main, nprocs=1, args=(free_port(), str(tmp_path)))
    measured = json.loads((tmp_path / "gemma.json").read_text())
    spec = _gemma_measure_spec()
    h, heads, kv_heads, d, s = 96, 4, 2, 20, GEMMA_SEQ_LEN
    shape = LayerShape(hidden=h, heads=heads, kv_heads=kv_heads, head_dim=d, ffn=80, vocab=spec.vocab_size, norms=4,
                       fp32_norms=True, qk_norm=True)
    per_token = layer_activation_bytes(shape, seq_len=s, rows=GEMMA_ROWS, tp=1, sequence_parallel=False,
                                       attention="local", dtype_bytes=2)
    per_layer = 4 * s * d * 2 + s * s + 4 * (4 * h + 2 * d)  # cos/sin, the mask, six (1 + w) in fp32
    assert len(measured) == 6
    assert set(measured.values()) == {per_token + per_layer}, measured
