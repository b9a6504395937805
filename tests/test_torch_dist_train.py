"""`python -m mcore_dpo.train --model DIR --tokenizer DIR` on a torch_dist checkpoint that
carries no HF files (as Megatron-LM, Megatron-Bridge and ms-swift write them): the model
comes from the checkpoint's args, the tokenizer from --tokenizer."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from convert_helpers import llama_gqa_untied, save_hf  # noqa: E402

from checkpoint_convert.convert import hf_to_mcore  # noqa: E402
from checkpoint_convert.safe_pickle import torch_load_file  # noqa: E402
from mcore_dpo.config import TrainConfig  # noqa: E402
from mcore_dpo.model import open_weights  # noqa: E402
from mcore_dpo.run import InputError, prepare  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _foreign_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A torch_dist save directory without hf_files/, whose args lack the unpadded vocabulary."""
    hf_dir = save_hf(llama_gqa_untied(), tmp_path / "hf")
    save = tmp_path / "megatron"
    hf_to_mcore(hf_dir, save, tp=1, pp=1, fmt="torch_dist", log=lambda _m: None)
    shutil.rmtree(save / "release" / "hf_files")
    common = torch_load_file(save / "release" / "common.pt")
    del common["args"].vocab_size
    torch.save(common, save / "release" / "common.pt")
    return hf_dir, save


def _data(path: Path) -> Path:
    rows = [{"prompt": f"w{i} w{i + 1}", "chosen": f"w{i + 2}", "rejected": f"w{i + 3}"} for i in range(3, 40)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_train_accepts_a_megatron_checkpoint_with_tokenizer(tmp_path):
    hf_dir, save = _foreign_checkpoint(tmp_path)
    data = _data(tmp_path / "prefs.jsonl")
    # Before any process: no tokenizer in the checkpoint and none given is one clear error ...
    try:
        prepare(TrainConfig(model=str(save), data=str(data), global_batch_size=8, micro_batch_size=8))
        raise AssertionError("expected an InputError")
    except InputError as error:
        assert "--tokenizer" in str(error)
    # ... and with --tokenizer the weights read through HF names are the source model's
    # (the vocabulary is Megatron's padded one, with zero rows after the real ones).
    weights, source = open_weights(str(save)), open_weights(str(hf_dir))
    assert weights.spec.vocab_size == 128 and weights.spec.architecture == "LlamaForCausalLM"
    for name in source.names:
        got, want = weights.get(name), source.get(name)
        if got.shape != want.shape:
            assert torch.equal(got[: want.shape[0]], want) and torch.count_nonzero(got[want.shape[0]:]) == 0, name
        else:
            assert torch.equal(got, want), name
    out = tmp_path / "run"
    argv = ["--model", str(save), "--tokenizer", str(hf_dir), "--data", str(data), "--max-steps", "1",
            "--global-batch-size", "8", "--micro-batch-size", "8", "--output-dir", str(out)]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "mcore_dpo.train", *argv], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)), timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in steps if r["step"] == 1)
    assert abs(first["loss"] - math.log(2)) < 1e-4  # the reference is the same checkpoint
    assert math.isfinite(first["logps/chosen"]) and first["logps/chosen"] < 0
    exported = json.loads((out / "hf" / "config.json").read_text())
    assert exported["vocab_size"] == 128
    assert (out / "hf" / "tokenizer.json").is_file()  # the --tokenizer files travel with the result
