"""Qwen3 dense: per-head q/k RMSNorm, a head_dim of its own (16 here, hidden/heads = 8), no qkv
bias, tied and untied embeddings. Conversion round trips bit-exact, `verify` against the HF
logits, greedy generation of the exported model, and parity with HF + TRL's formulas on real
gloo ranks (tests/parity.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from checkpoint_convert.__main__ import main
from checkpoint_convert.io import open_hf_dir
from convert_helpers import assert_export_generates_like, save_hf
from parity import PACKED, VOCAB, PAD, _small_init, check_ran_packed, run_ranks
import test_parity as tp_

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1,
               eos_token_id=2, pad_token_id=PAD)


def qwen3(*, tied: bool, seed: int) -> Qwen3ForCausalLM:
    return _small_init(Qwen3ForCausalLM(Qwen3Config(**_COMMON, tie_word_embeddings=tied)), seed).float().eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    return {
        tied: (save_hf(qwen3(tied=tied, seed=1), root / f"policy_{tied}"), save_hf(qwen3(tied=tied, seed=2), root / f"ref_{tied}"))
        for tied in (True, False)
    }


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_spec_reads_head_dim_and_qk_norms(models):
    spec = open_hf_dir(models[True][0]).spec
    assert (spec.family, spec.head_dim, spec.qk_layernorm, spec.qkv_bias, spec.tie_word_embeddings) == ("qwen3", 16, True, False, True)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_round_trip_bit_exact_and_generation(models, tied, tmp_path, capsys):
    """HF -> (1,1) and (2,2) -> reshard (2,2)->(1,2) -> HF: every tensor identical; the export loads
    in transformers with no missing/unexpected keys and generates what the original does."""
    hf_dir = models[tied][0]
    source = _tensors(hf_dir)
    for tp, pp in ((1, 1), (2, 2)):
        assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / f"m{tp}{pp}"),
                     "--tp", str(tp), "--pp", str(pp)]) == 0
        assert main(["mcore-to-hf", "--mcore-dir", str(tmp_path / f"m{tp}{pp}"), "--out", str(tmp_path / f"hf{tp}{pp}")]) == 0
        exported = _tensors(tmp_path / f"hf{tp}{pp}")
        assert set(exported) == set(source)
        assert all(torch.equal(exported[n], t) for n, t in source.items()), (tp, pp)
    assert main(["reshard", "--mcore-dir", str(tmp_path / "m22"), "--out", str(tmp_path / "m12"), "--tp", "1", "--pp", "2"]) == 0
    assert main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "m12"), "--out", str(tmp_path / "hf12")]) == 0
    assert all(torch.equal(_tensors(tmp_path / "hf12")[n], t) for n, t in source.items())
    capsys.readouterr()
    assert_export_generates_like(hf_dir, tmp_path / "hf22", prompt=[1, 17, 42, 7, 99, 3], max_new_tokens=10)


def test_verify_tp2_pp2(models, tmp_path, capsys):
    hf_dir = models[True][0]
    assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "m"), "--tp", "2", "--pp", "2"]) == 0
    capsys.readouterr()
    code = main(["verify", "--hf-dir", str(hf_dir), "--mcore-dir", str(tmp_path / "m"), "--atol", "1e-4", "--seq-len", "48"])
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(line for line in out.splitlines() if line.startswith("verify tp=2 pp=2"))
    assert float(line.split("max |dlogit| ")[1].split(",")[0]) <= 1e-4
    assert "argmax agreement 100.00%" in line


@pytest.mark.parametrize("layout,tied", [((2, 2, 1), True), ((1, 1, 1), False)], ids=["tp2-pp2-tied", "tp1-pp1-untied"])
def test_parity(models, layout, tied, tmp_path):
    """Two steps, uneven lengths, policy != reference: every metric, every gradient, the weights;
    padded, and packed in the same launch (`packed_parity_job`)."""
    jobs = [parity_job(layout, *models[tied], name="qwen3"), packed_parity_job(layout, *models[tied], name="qwen3")]
    run_ranks(world_size=layout[0] * layout[1] * layout[2], jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        tp_._check_job(tmp_path, j, job, layout)
    check_ran_packed(tmp_path, padded=0, packed=1)


def parity_job(layout: tuple[int, ...], policy_dir: Path, ref_dir: Path, *, name: str, steps: int = 2, **config) -> dict:
    """One interleaved sigmoid job of test_parity's shape (its batches, learning rate, clipping)."""
    tp, pp, dp = layout[:3]
    train, held_out = tp_._data(steps=steps, mode="interleaved")
    batch = tp_.GLOBAL_BATCH
    return {
        "key": (name, "interleaved", "sigmoid"),
        "config": dict(model=str(policy_dir), ref_model=str(ref_dir), tp=tp, pp=pp, dp=dp,
                       micro_batch_size=tp_.MICRO_BATCH, global_batch_size=batch, max_steps=steps,
                       ref_mode="interleaved", lr=tp_.LR, adam_eps=tp_.ADAM_EPS, timeout_s=60.0, clip_grad=tp_.CLIP,
                       weight_decay=tp_.WD, **tp_._loss_kwargs("sigmoid"), **config),
        "batches": [train[k * batch:(k + 1) * batch] for k in range(steps)],
        "batch_ids": [list(range(k * batch, (k + 1) * batch)) for k in range(steps)],
        "all_pairs": train, "eval_pairs": held_out,
    }



def packed_parity_job(layout: tuple[int, ...], policy_dir: Path, ref_dir: Path, *, name: str, **config) -> dict:
    """parity_job with packed microbatches (parity.PACKED): the same data, reference and checks
    (the HF reference runs whole global batches, so the microbatch split does not enter it)."""
    return parity_job(layout, policy_dir, ref_dir, name=name, **PACKED, **config)
