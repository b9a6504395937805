"""`verify` end to end: HF logits vs Megatron logits at tp 2, pp 2 on real gloo ranks (spawns 4 processes)."""

from __future__ import annotations

import pytest

from checkpoint_convert.__main__ import main
from tests.helpers.models import llama3_rope_scaled, qwen2_bias_tied, save_hf
from tests.helpers.ranks import verify


@pytest.mark.parametrize(
    "factory",
    [
        llama3_rope_scaled,  # llama3 rope scaling with non-default factors: a dropped scaling would show
        qwen2_bias_tied,  # tied embeddings over two stages: the last stage holds its own copy
    ],
    ids=["llama3-rope-scaled", "qwen2-tied"],
)
def test_verify_tp2_pp2_matches_hf_logits(factory, tmp_path, capsys):
    hf_dir = save_hf(factory(), tmp_path / "hf")
    assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "m"), "--tp", "2", "--pp", "2"]) == 0
    capsys.readouterr()
    code = verify(["--hf-dir", str(hf_dir), "--mcore-dir", str(tmp_path / "m"), "--atol", "1e-4", "--seq-len", "48"])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    line = captured.out.strip()  # stdout: the result line alone
    assert line.startswith("verify tp=2 pp=2") and "\n" not in line, captured.out
    # stderr: a line as each phase starts, in order
    lines = captured.err.splitlines()
    phases = ["verify: building the megatron model at tp=2 pp=2 from", "verify: megatron logits done (",
              "verify: HF logits done ("]
    found = [next(i for i, text in enumerate(lines) if text.startswith(phase)) for phase in phases]
    assert found == sorted(found), captured.err
    assert "(4 CPU ranks) and running 2 x 48 random tokens" in lines[found[0]]
    assert f"loading the HF model from {hf_dir}" in lines[found[1]]
    max_diff = float(line.split("max |dlogit| ")[1].split(",")[0])
    assert max_diff <= 1e-4
    assert "argmax agreement 100.00%" in line


def test_verify_fails_on_a_corrupted_checkpoint(tmp_path, capsys):
    """The comparison must be able to fail: perturb one layer norm on the HF side (the Megatron
    side's files are checksummed, and a changed shard is refused before any comparison) and
    expect exit 1."""
    from safetensors.torch import load_file, save_file

    hf_dir = save_hf(llama3_rope_scaled(), tmp_path / "hf")
    assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "m")]) == 0
    for shard in hf_dir.glob("*.safetensors"):
        tensors = load_file(str(shard))
        if "model.layers.2.post_attention_layernorm.weight" in tensors:
            tensors["model.layers.2.post_attention_layernorm.weight"] += 0.5
            save_file(tensors, str(shard), metadata={"format": "pt"})
    capsys.readouterr()
    assert verify(["--hf-dir", str(hf_dir), "--mcore-dir", str(tmp_path / "m")]) == 1
    assert "FAILED" in capsys.readouterr().err
