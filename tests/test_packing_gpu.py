"""Packed rows on a GPU with Transformer Engine: the THD layout (megatron-core's PackedSeqParams,
cu_seqlens) gives every sequence the logits it gets alone. Marked `gpu`; on the CPU
(MCORE_DPO_GPU_CHECKS_ON_CPU=1) the same check runs the local spec's block-diagonal mask.
Shared-prompt rows (--prefix-sharing) through Transformer Engine's arbitrary-mask attention
likewise give every position of both completions its logits alone.

World size 1, fp32 with TF32 off: a packed row of sequences of uneven lengths (the last one
followed by padding) against each sequence run alone, unpadded, through the same model.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

from mcore_dpo.parallel.ports import free_port
from tests.helpers.models import make_model, save_hf
from tests.helpers.ranks import spawn_processes

pytestmark = pytest.mark.gpu
RTOL = 1e-4  # fp32 on a GPU: kernels sum in other orders for other shapes


def _rank(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        from checkpoint_convert.mapping import hf_to_mcore_shard
        from mcore_dpo.parallel import mesh as mesh_lib
        from mcore_dpo.parallel import platform as plat
        from mcore_dpo.data.pairs import TokenizedPair
        from mcore_dpo.model.builder import (build_stage_model, causal_mask, load_shard, open_weights, segment_mask,
                                     packed_seq_params, stage_forward)
        from mcore_dpo.data.packing import collate_packed

        platform = plat.detect()
        plat.activate(platform)
        plat.init_process_group(platform, rank=0, world_size=1, master_addr="127.0.0.1", master_port=port,
                                timeout_s=120.0)
        mesh = mesh_lib.initialize(mesh_lib.Layout(tp=1, pp=1, dp=1))
        plat.init_model_rng(platform, 0)
        weights = open_weights(model_dir)
        use_te = plat.transformer_engine_available() and platform.is_cuda
        with plat.building_models(platform):
            model = build_stage_model(weights.spec, mesh=mesh, dtype=torch.float32, on_gpu=platform.is_cuda,
                                      use_te=use_te).to(platform.device)
        load_shard(model, hf_to_mcore_shard(weights.spec, tp=1, tp_rank=0, pp=1, pp_rank=0, get=weights.get,
                                            layer_spec="te" if use_te else "local"))
        model.eval()
        gen = torch.Generator().manual_seed(0)
        ids = lambda n: tuple(int(x) for x in torch.randint(3, 100, (n,), generator=gen))  # noqa: E731
        pairs = [TokenizedPair(prompt_ids=ids(lp), chosen_ids=ids(lc), rejected_ids=ids(lr), source_line=i)
                 for i, (lp, lc, lr) in enumerate(((5, 9, 3), (17, 2, 11), (3, 4, 6)))]
        micro = collate_packed(pairs, pad_token_id=0, multiple=16)
        device = platform.device
        tokens, positions = micro.tokens.to(device), micro.position_ids.to(device)
        with torch.no_grad():
            if use_te:
                packed = stage_forward(model, tokens=tokens, input_tensor=None, mask=None, position_ids=positions,
                                       packed_params=packed_seq_params(micro.seq_lens, device=device))
            else:
                packed = stage_forward(model, tokens=tokens, input_tensor=None,
                                       mask=segment_mask(micro.segment_ids.to(device)), position_ids=positions,
                                       num_positions=max(micro.seq_lens))
            alone = []
            at = 0
            for n in micro.seq_lens[: micro.num_sequences]:
                seq = tokens[:, at : at + n]
                alone.append(stage_forward(model, tokens=seq, input_tensor=None, mask=causal_mask(n, device=device)))
                at += n
        real = sum(micro.seq_lens[: micro.num_sequences])
        # --prefix-sharing: shared rows (each pair one row, padded) through the attention that
        # takes any mask (Transformer Engine's arbitrary mask on the TE spec), at each sequence's
        # own positions: every position's logits against the same token's alone.
        from mcore_dpo.data.prefix_sharing import collate_shared, shared_seq_len

        with plat.building_models(platform):
            masked = build_stage_model(weights.spec, mesh=mesh, dtype=torch.float32, on_gpu=platform.is_cuda,
                                       use_te=use_te, arbitrary_masks=True).to(platform.device)
        load_shard(masked, hf_to_mcore_shard(weights.spec, tp=1, tp_rank=0, pp=1, pp_rank=0, get=weights.get,
                                             layer_spec="te" if use_te else "local"))
        masked.eval()
        rows = collate_shared(pairs, pad_token_id=0, seq_len=shared_seq_len(pairs, multiple=16))
        shared_got, shared_want = [], []
        with torch.no_grad():
            logits = stage_forward(masked, tokens=rows.tokens.to(device), input_tensor=None,
                                   mask=segment_mask(rows.segment_ids.to(device), shared_prompt=rows.shared_prompt.to(device),
                                                     num_sequences=rows.num_sequences),
                                   position_ids=rows.position_ids.to(device), num_positions=rows.num_positions)
            for j, pair in enumerate(pairs):
                for seq, completion in ((j, pair.chosen_ids), (len(pairs) + j, pair.rejected_ids)):
                    ids = torch.tensor([pair.prompt_ids + completion], device=device)
                    whole = stage_forward(model, tokens=ids, input_tensor=None,
                                          mask=causal_mask(ids.shape[1], device=device))[0]
                    # the shared row holds the body (its chosen sequence's) and then each branch
                    mine = (rows.segment_ids[j] == seq) | (rows.shared_prompt[j] if seq >= len(pairs) else False)
                    shared_got.append(logits[j, mine.to(device)])
                    shared_want.append(whole)
        torch.save({"packed": packed[0, :real].float().cpu(), "alone": torch.cat([a[0] for a in alone]).float().cpu(),
                    "shared": torch.cat(shared_got).float().cpu(), "shared_alone": torch.cat(shared_want).float().cpu(),
                    "use_te": use_te}, Path(out_dir, "packed.pt"))
        mesh_lib.destroy()
    except BaseException:
        Path(out_dir, "error.txt").write_text(traceback.format_exc())
        raise


def test_packed_row_gives_each_sequence_its_own_logits(tmp_path):
    model_dir = save_hf(make_model("llama", seed=1), tmp_path / "llama")
    spawn_processes(_rank, nprocs=1, args=(free_port(), str(model_dir), str(tmp_path)),
                    start_method="spawn")
    result = torch.load(tmp_path / "packed.pt", weights_only=True)
    scale = result["alone"].abs().max().item()
    err = (result["packed"] - result["alone"]).abs().max().item()
    assert err <= RTOL * scale, f"packed ({'THD' if result['use_te'] else 'mask'}) vs alone: {err:.3e} (scale {scale:.3e})"
    err = (result["shared"] - result["shared_alone"]).abs().max().item()
    assert result["shared"].shape == result["shared_alone"].shape
    assert err <= RTOL * scale, (f"shared-prompt rows ({'TE arbitrary mask' if result['use_te'] else 'mask'}) vs alone: "
                                 f"{err:.3e} (scale {scale:.3e})")
