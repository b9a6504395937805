"""Conversion round trips checked tensor for tensor: the tensors of an HF directory, an export
equal to its source, and HF -> Megatron -> HF at several (tp, pp, ep) layouts with every rank
file holding what the trainer's key map puts there; and a quantised copy of a checkpoint refused
by the converter and the trainer alike (`assert_quantised_copy_refused`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file

from checkpoint_convert.__main__ import main
from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mapping import hf_to_mcore_shard


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of `directory`."""
    out = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def assert_same(exported: Path, source: dict[str, torch.Tensor], what: str) -> None:
    """`exported` holds exactly `source`'s tensors, names, dtypes and bits."""
    tensors = tensors_of(exported)
    assert set(tensors) == set(source), what
    for name, tensor in source.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), f"{what}: {name}"


def assert_round_trips(hf_dir: Path, work: Path, layouts: Iterable[tuple[int, int, int]], *,
                       what: str = "round trip") -> dict[str, torch.Tensor]:
    """hf-to-mcore at each (tp, pp, ep): every rank file equals the key map's shard of the source;
    mcore-to-hf gives the source back bit for bit (in work/hf{tp}{pp}{ep}). Returns the source."""
    source = tensors_of(hf_dir)
    spec = open_hf_dir(hf_dir).spec
    for tp, pp, ep in layouts:
        out = work / f"m{tp}{pp}{ep}"
        assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(out),
                     "--tp", str(tp), "--pp", str(pp), "--ep", str(ep)]) == 0
        for t in range(tp):
            for p in range(pp):
                for e in range(ep):
                    name = f"tp{t}_pp{p}_ep{e}" if ep > 1 else f"tp{t}_pp{p}"
                    stored = load_file(str(out / name / "model.safetensors"))
                    expected = hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep, ep_rank=e,
                                                 get=source.__getitem__)
                    assert set(stored) == set(expected), (what, tp, pp, ep, t, p, e)
                    assert all(torch.equal(stored[n], v) for n, v in expected.items()), (what, tp, pp, ep, t, p, e)
        assert main(["mcore-to-hf", "--mcore-dir", str(out), "--out", str(work / f"hf{tp}{pp}{ep}")]) == 0
        assert_same(work / f"hf{tp}{pp}{ep}", source, f"{what} at tp{tp} pp{pp} ep{ep}")
    return source


def assert_torch_dist_round_trips(hf_dir: Path, work: Path, source: dict[str, torch.Tensor], *,
                                  write_flags: list[str], reshard_flags: list[str]) -> None:
    """HF -> torch_dist (written with `write_flags`) -> HF, and torch_dist -> reshard
    (`reshard_flags`) -> HF: each export equals `source` bit for bit."""
    assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(work / "td"), *write_flags,
                 "--format", "torch_dist"]) == 0
    assert main(["mcore-to-hf", "--mcore-dir", str(work / "td"), "--out", str(work / "hf_td")]) == 0
    assert_same(work / "hf_td", source, "HF -> torch_dist -> HF")
    assert main(["reshard", "--mcore-dir", str(work / "td"), "--out", str(work / "from_td"), *reshard_flags]) == 0
    assert main(["mcore-to-hf", "--mcore-dir", str(work / "from_td"), "--out", str(work / "hf_from_td")]) == 0
    assert_same(work / "hf_from_td", source, f"torch_dist -> reshard {' '.join(reshard_flags)} -> HF")


def assert_moe_conversions(hf_dir: Path, work: Path, *, reshard_flags: list[str], export: str) -> dict[str, torch.Tensor]:
    """A MoE family's conversions: the round trips at (tp, pp, ep) = (1,1,1), (2,2,1), (1,2,2);
    torch_dist written at tp 2 pp 2 ep 2 and back, directly and resharded (`reshard_flags`); and
    the export of work/hf{export} loading with AutoModelForCausalLM and generating the source's
    greedy tokens. Returns the source."""
    from tests.helpers.models import assert_export_generates_like

    source = assert_round_trips(hf_dir, work, ((1, 1, 1), (2, 2, 1), (1, 2, 2)))
    assert_torch_dist_round_trips(hf_dir, work, source, write_flags=["--tp", "2", "--pp", "2", "--ep", "2"],
                                  reshard_flags=reshard_flags)
    assert_export_generates_like(hf_dir, work / f"hf{export}", prompt=[1, 17, 42, 7, 9, 3], max_new_tokens=8)
    return source


def assert_quantised_copy_refused(hf_dir: Path, work: Path, capsys, *, quantization: dict,
                                  scales: dict[str, torch.Tensor]) -> None:
    """A copy of `hf_dir` whose config.json has `quantization` and whose weights file holds the
    `scales` tensors beside the weights (as a released quantised checkpoint does) is refused by
    `checkpoint_convert hf-to-mcore` (the function its command line runs) and by the trainer's
    start-up (`mcore_dpo.train.main`, before Ray starts): exit code 2, one `error:` line naming
    config.json's field, no traceback, nothing written."""
    import json
    import shutil

    import ray
    from safetensors.torch import save_file

    from mcore_dpo.train import main as train

    quantised = work / "quantised"
    shutil.copytree(hf_dir, quantised)
    config = json.loads((quantised / "config.json").read_text())
    (quantised / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    weights = quantised / "model.safetensors"
    save_file({**load_file(str(weights)), **scales}, str(weights), metadata={"format": "pt"})
    expected = (f"error: {quantised / 'config.json'}: field 'quantization_config.quant_method' is "
                f"{quantization['quant_method']!r}; quantised weights are not read")
    data = Path(__file__).resolve().parents[1] / "bad_inputs" / "valid_prefs.jsonl"
    for what, run, out in (
        ("hf-to-mcore", lambda out: main(["hf-to-mcore", "--hf-dir", str(quantised), "--out", str(out)]), work / "m"),
        ("train", lambda out: train(["--model", str(quantised), "--data", str(data), "--output-dir", str(out)]),
         work / "run"),
    ):
        capsys.readouterr()
        code = run(out)
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith(expected), f"{what}: exit {code}; {err}"
        assert "Traceback" not in captured.out + captured.err, what
        assert not out.exists(), f"{what}: wrote {out}"
    assert not ray.is_initialized(), "Ray was started before the model was checked"
