"""Bad LoRA input: a rank <= 0, an unknown target, an --init-adapter whose rank or base does not
match or that saves modules (a reward run's, its score head in it). Each ends `python -m mcore_dpo.train` (run in-process through `main`) with exit code 2 and
one `error:` line naming the field or file, before Ray starts and before any output is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.peft_adapter import TARGETS, LoraShape, adapter_config, initial_adapter, write_adapter_dir
from mcore_dpo.train import main
from tests.helpers.models import llama_gqa_untied, mistral_mha, save_hf

VALID = Path(__file__).resolve().parent / "bad_inputs" / "valid_prefs.jsonl"


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_bad")
    model = save_hf(llama_gqa_untied(), root / "model")
    other = save_hf(mistral_mha(), root / "other_base")  # same hidden size and layers, other head layout
    found = {"model": model, "valid": VALID}
    for name, base, rank in (("rank8", model, 8), ("other_base_adapter", other, 4)):
        shape = LoraShape(rank=rank, alpha=16.0, targets=TARGETS)
        found[name] = root / name
        write_adapter_dir(found[name], initial_adapter(open_hf_dir(base).spec, shape, seed=0),
                          adapter_config(shape, spec=open_hf_dir(base).spec, dropout=0.0, base_model=str(base)))
    deeper = LoraShape(rank=4, alpha=4.0, targets=("qkv",))
    spec = open_hf_dir(model).spec
    from dataclasses import replace

    found["deeper_adapter"] = root / "deeper_adapter"  # made for a base with two more layers
    write_adapter_dir(found["deeper_adapter"], initial_adapter(replace(spec, num_layers=spec.num_layers + 2), deeper, seed=0),
                      adapter_config(deeper, spec=spec, dropout=0.0, base_model=None))
    found["dora"] = root / "dora"
    write_adapter_dir(found["dora"], initial_adapter(spec, deeper, seed=0), {**adapter_config(deeper, spec=spec, dropout=0.0, base_model=None),
                                                                               "use_dora": True})
    found["seq_cls"] = root / "seq_cls"  # a reward run's OUTPUT/adapter: its score head saved whole
    reward = replace(spec, architecture="LlamaForSequenceClassification", num_labels=1)
    write_adapter_dir(found["seq_cls"], initial_adapter(spec, deeper, seed=0),
                      adapter_config(deeper, spec=reward, dropout=0.0, base_model=None))
    found["no_config"] = root / "no_config"
    found["no_config"].mkdir()
    return {k: str(v) for k, v in found.items()}


CASES = [
    ("rank_zero", ["--lora-rank", "0"], None, "lora_rank: must be a positive integer, got 0"),
    ("rank_negative", ["--lora-rank", "-4"], None, "lora_rank: must be a positive integer, got -4"),
    ("rank_not_int", ["--lora-rank", "four"], None, "argument --lora-rank: invalid int value: 'four'"),
    ("unknown_target", ["--lora-rank", "4", "--lora-targets", "qkv,attn"], None,
     "lora_targets: unknown target 'attn'; choose from qkv, proj, fc1, fc2, expert_fc1, expert_fc2, experts"),
    ("expert_target_on_dense", ["--lora-rank", "4", "--lora-targets", "qkv,experts"], "{model}/config.json",
     "LoRA target 'expert_fc1' needs a mixture-of-experts model"),
    ("alpha_without_lora", ["--lora-alpha", "16"], None, "lora_alpha: needs --lora-rank or --init-adapter"),
    ("dropout_out_of_range", ["--lora-rank", "4", "--lora-dropout", "1.5"], None, "lora_dropout: must be in [0, 1)"),
    ("lora_with_tr_dpo", ["--lora-rank", "4", "--sync-ref-model"], None, "sync_ref_model: not with LoRA"),
    ("lora_with_ep", ["--lora-rank", "4", "--dp", "2", "--ep", "2", "--no-distributed-optimizer"], None, "ep: LoRA with ep 2 > 1 is not supported yet"),
    ("init_adapter_missing", ["--init-adapter", "{model}/no_such_adapter"], "{model}/no_such_adapter", "does not exist"),
    ("init_adapter_no_config", ["--init-adapter", "{no_config}"], "{no_config}/adapter_config.json", "not found"),
    ("init_adapter_rank_mismatch", ["--lora-rank", "4", "--init-adapter", "{rank8}"], "{rank8}/adapter_config.json",
     "the adapter has rank 8, --lora-rank is 4"),
    ("init_adapter_other_base", ["--init-adapter", "{other_base_adapter}"], "{other_base_adapter}/adapter_model.safetensors",
     "the adapter was made for another base"),
    ("init_adapter_more_layers", ["--init-adapter", "{deeper_adapter}"], "{deeper_adapter}/adapter_model.safetensors",
     "has no place in a rank-4 adapter of this base (4 layers)"),
    ("init_adapter_dora", ["--init-adapter", "{dora}"], "{dora}/adapter_config.json", "field 'use_dora' is True"),
    ("init_adapter_saved_head", ["--objective", "reward", "--init-adapter", "{seq_cls}"], "{seq_cls}/adapter_config.json",
     "field 'modules_to_save' is ['score']"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_lora_input_gives_one_line_and_exit_2(case, paths, capsys, tmp_path):
    import ray

    _, flags, where, fragment = case
    out = tmp_path / "out"
    argv = ["--model", paths["model"], "--data", paths["valid"], *[f.format_map(paths) for f in flags],
            "--output-dir", str(out)]
    code = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, f"exit code {code}; stderr: {err}"
    assert "Traceback" not in captured.err + captured.out
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert not ray.is_initialized(), "Ray was started before the input was checked"
    if where is not None:
        assert where.format_map(paths) in err, err
    assert fragment in err, err
    assert not out.exists()


def test_adapter_config_round_trip(paths, tmp_path):
    """What the exporter writes, the reader takes back: rank, alpha, targets, dropout."""
    from checkpoint_convert.peft_adapter import lora_shape_of

    shape = LoraShape(rank=3, alpha=6.0, targets=("qkv", "fc2"))
    spec = open_hf_dir(paths["model"]).spec
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(adapter_config(shape, spec=spec, dropout=0.05,
                                                                                  base_model=None)))
    assert lora_shape_of(tmp_path / "a", spec=spec) == (shape, 0.05)
