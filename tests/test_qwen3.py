"""Qwen3 dense: per-head q/k RMSNorm, a head_dim of its own (16 here, hidden/heads = 8), no qkv
bias, tied and untied embeddings. Conversion round trips bit-exact, `verify` against the HF
logits, greedy generation of the exported model, and parity with HF + TRL's formulas on real
gloo ranks (tests/helpers/parity.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint_convert.__main__ import main
from checkpoint_convert.io import open_hf_dir
from tests.helpers.models import assert_export_generates_like
from tests.helpers.parity import check_job, packed_parity_job, parity_job
from tests.helpers.ranks import check_ran_packed, run_ranks, verify


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_spec_reads_head_dim_and_qk_norms(qwen3_models):
    spec = open_hf_dir(qwen3_models[True][0]).spec
    assert (spec.family, spec.head_dim, spec.qk_layernorm, spec.qkv_bias, spec.tie_word_embeddings) == ("qwen3", 16, True, False, True)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_round_trip_bit_exact_and_generation(qwen3_models, tied, tmp_path, capsys):
    """HF -> (1,1) and (2,2) -> reshard (2,2)->(1,2) -> HF: every tensor identical; the export loads
    in transformers with no missing/unexpected keys and generates what the original does."""
    hf_dir = qwen3_models[tied][0]
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


def test_verify_tp2_pp2(qwen3_models, tmp_path, capsys):
    hf_dir = qwen3_models[True][0]
    assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "m"), "--tp", "2", "--pp", "2"]) == 0
    capsys.readouterr()
    code = verify(["--hf-dir", str(hf_dir), "--mcore-dir", str(tmp_path / "m"), "--atol", "1e-4", "--seq-len", "48"])
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(line for line in out.splitlines() if line.startswith("verify tp=2 pp=2"))
    assert float(line.split("max |dlogit| ")[1].split(",")[0]) <= 1e-4
    assert "argmax agreement 100.00%" in line


@pytest.mark.parametrize("layout,tied", [((2, 2, 1), True), ((1, 1, 1), False)], ids=["tp2-pp2-tied", "tp1-pp1-untied"])
def test_parity(qwen3_models, layout, tied, tmp_path):
    """Two steps, uneven lengths, policy != reference: every metric, every gradient, the weights;
    padded, and packed in the same launch (`packed_parity_job`); at tp 2 also padded with sequence
    parallelism (the q/k norms then sequence-parallel norms of ours, their gradients summed over tp)."""
    jobs = [parity_job(layout, *qwen3_models[tied], name="qwen3"), packed_parity_job(layout, *qwen3_models[tied], name="qwen3")]
    if layout[0] > 1:
        jobs.append(parity_job(layout, *qwen3_models[tied], name="qwen3", sequence_parallel=True))
    run_ranks(world_size=layout[0] * layout[1] * layout[2], jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        check_job(tmp_path, j, job, layout)
    check_ran_packed(tmp_path, padded=0, packed=1)
