"""Conversion of Qwen3-MoE and Mixtral with the experts split over ep ranks: hf-to-mcore --ep,
reshard changing tp, pp and ep together, mcore-to-hf from any ep; every tensor bit for bit
against the source HF checkpoint. In-process conversions only (no rank processes)."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from checkpoint_convert.__main__ import main
from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mcore_dir import open_mcore_dir
from checkpoint_convert.mapping import hf_to_mcore_shard
from tests.helpers.models import assert_export_generates_like, save_hf
from tests.helpers.models import mixtral, qwen3_moe
from tests.helpers.round_trips import assert_same, tensors_of

# Qwen3-MoE with a dense layer among its MoE layers (mlp_only_layers=[1]); Mixtral tied.
FACTORIES = {"qwen3_moe": lambda: qwen3_moe(seed=5, num_layers=4), "mixtral": lambda: mixtral(seed=6)}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each model as transformers 5.24's save_pretrained writes it (the hub's form: one tensor per
    expert and projection), with a tokenizer."""
    from tests.helpers.models import save_tokenizer

    root = tmp_path_factory.mktemp("moe_convert")
    dirs = {}
    for name, make in FACTORIES.items():
        make().save_pretrained(str(root / name))
        save_tokenizer(root / name)
        dirs[name] = root / name
    return dirs


def _layout_flags(tp: int, pp: int, ep: int) -> list[str]:
    return ["--tp", str(tp), "--pp", str(pp), "--ep", str(ep)]


@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_round_trips_with_experts_split_over_ep(hf_dirs, family, tmp_path, capsys):
    """(tp, pp, ep) = (1,2,2) and (2,1,4): one file per (tp, pp, ep) rank, each holding the
    experts of its ep rank as the trainer's key map puts them; back to HF bit for bit."""
    hf_dir = hf_dirs[family]
    source = tensors_of(hf_dir)
    spec = open_hf_dir(hf_dir).spec
    for tp, pp, ep in ((1, 2, 2), (2, 1, 4)):
        out = tmp_path / f"m{tp}{pp}{ep}"
        assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(out), *_layout_flags(tp, pp, ep)]) == 0
        files = sorted(str(p.relative_to(out)) for p in out.glob("*/model.safetensors"))
        assert files == sorted(f"tp{t}_pp{p}_ep{e}/model.safetensors" for t in range(tp) for p in range(pp) for e in range(ep))
        for t in range(tp):
            for p in range(pp):
                for e in range(ep):
                    stored = load_file(str(out / f"tp{t}_pp{p}_ep{e}" / "model.safetensors"))
                    expected = hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep, ep_rank=e,
                                                 get=source.__getitem__)
                    assert set(stored) == set(expected), (tp, pp, ep, t, p, e)
                    assert all(torch.equal(stored[n], v) for n, v in expected.items()), (tp, pp, ep, t, p, e)
        assert main(["mcore-to-hf", "--mcore-dir", str(out), "--out", str(tmp_path / f"hf{tp}{pp}{ep}")]) == 0
        assert_same(tmp_path / f"hf{tp}{pp}{ep}", source, f"{family} round trip at tp{tp} pp{pp} ep{ep}")
    capsys.readouterr()


@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_reshard_changes_ep_and_the_export_generates_the_same(hf_dirs, family, tmp_path, capsys):
    """(2,1,2) -> reshard (1,2,1) -> HF: identical to the source; an ep-split checkpoint reads
    (verify's path) as the ep-1 shards; the exported model loads with no missing or unexpected
    keys and its greedy generation equals the original's."""
    hf_dir = hf_dirs[family]
    source = tensors_of(hf_dir)
    assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "m212"), *_layout_flags(2, 1, 2)]) == 0
    assert main(["reshard", "--mcore-dir", str(tmp_path / "m212"), "--out", str(tmp_path / "m121"),
                 *_layout_flags(1, 2, 1)]) == 0
    assert sorted(p.name for p in (tmp_path / "m121").glob("tp*")) == ["tp0_pp0", "tp0_pp1"]
    assert main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "m121"), "--out", str(tmp_path / "hf")]) == 0
    assert_same(tmp_path / "hf", source, f"{family} (2,1,2) -> (1,2,1) -> HF")
    # And back up: (1,2,1) -> (2,2,2) (ep across stages and tp ranks at once) -> HF.
    assert main(["reshard", "--mcore-dir", str(tmp_path / "m121"), "--out", str(tmp_path / "m222"),
                 *_layout_flags(2, 2, 2)]) == 0
    assert main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "m222"), "--out", str(tmp_path / "hf222")]) == 0
    assert_same(tmp_path / "hf222", source, f"{family} (1,2,1) -> (2,2,2) -> HF")
    spec = open_hf_dir(hf_dir).spec
    checkpoint = open_mcore_dir(tmp_path / "m212")
    assert checkpoint.meta.ep == 2
    for t in range(2):  # what verify loads into its ep-1 model on tp rank t
        expected = hf_to_mcore_shard(spec, tp=2, tp_rank=t, pp=1, pp_rank=0, get=source.__getitem__)
        shard = checkpoint.shard(t, 0)
        assert set(shard) == set(expected) and all(torch.equal(shard[n], v) for n, v in expected.items())
    capsys.readouterr()
    assert_export_generates_like(hf_dir, tmp_path / "hf", prompt=[1, 17, 42, 7, 9, 3], max_new_tokens=8)


@pytest.mark.parametrize("flags,message", [
    (["--tp", "1", "--pp", "1", "--ep", "3"], "the expert count (4) is not divisible by ep=3"),
    (["--tp", "1", "--pp", "1", "--ep", "0"], "tp, pp, ep and vpp must be >= 1"),
], ids=["ep-not-dividing-experts", "ep-zero"])
def test_reshard_bad_ep_is_one_line_and_writes_nothing(hf_dirs, tmp_path, capsys, flags, message):
    assert main(["hf-to-mcore", "--hf-dir", str(hf_dirs["mixtral"]), "--out", str(tmp_path / "m"), "--ep", "2"]) == 0
    capsys.readouterr()
    code = main(["reshard", "--mcore-dir", str(tmp_path / "m"), "--out", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_ep_on_a_dense_model_is_one_line(tmp_path, capsys):
    """Qwen3 dense has no experts: ep > 1 is refused (its round trips at ep 1 are in test_qwen3)."""
    from tests.helpers.models import qwen3

    hf_dir = save_hf(qwen3(tied=False, seed=1), tmp_path / "hf")
    code = main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "m"), "--ep", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "ep=2 asks for expert parallelism" in err, err
    assert not (tmp_path / "m").exists()


def test_missing_ep_rank_file_is_one_line(hf_dirs, tmp_path, capsys):
    import shutil

    assert main(["hf-to-mcore", "--hf-dir", str(hf_dirs["qwen3_moe"]), "--out", str(tmp_path / "m"), "--ep", "2"]) == 0
    shutil.rmtree(tmp_path / "m" / "tp0_pp0_ep1")
    capsys.readouterr()
    code = main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "m"), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "tp0_pp0_ep1/model.safetensors: file is missing" in err, err
