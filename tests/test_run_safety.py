"""Driver safety without processes: the data-order seed, what a resume compares, checkpoint
metadata from the workers' layer spec, no custom code in exports without the flag, wandb only
when asked, the hook points, and the one-line error for an output directory a node cannot see."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from mcore_dpo import hooks
from mcore_dpo.driver import resume_check
from mcore_dpo.command_line import resolve
from mcore_dpo.config import ConfigError, TrainConfig
from mcore_dpo.data.pairs import global_batch_order
from tests.helpers.models import llama_gqa_untied, save_hf


def test_no_two_seed_epoch_pairs_share_a_data_order():
    """seed + epoch gave seed 1 epoch 1 the order of seed 2 epoch 0."""
    orders = {}
    for seed in range(4):
        for epoch in range(4):
            order = global_batch_order(num_pairs=50, global_batch_size=10, seed=seed, shuffle=True, epoch=epoch)
            key = tuple(map(tuple, order))
            assert key not in orders, f"seed {seed} epoch {epoch} repeats {orders.get(key)}"
            orders[key] = (seed, epoch)


# ----------------------------------------------------------------------------- resume identity


def _config(tmp_path: Path, model_dir: Path, **changes) -> TrainConfig:
    data = tmp_path / "prefs.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"prompt": f"p{i}", "chosen": " a", "rejected": " b"}) + "\n" for i in range(8)))
    return replace(TrainConfig(model=str(model_dir), data=str(data), output_dir=str(tmp_path / "out")), **changes)


def test_resume_identity_names_each_change(tmp_path, hf_llama):
    base = _config(tmp_path, hf_llama)
    saved = resume_check.run_identity(base)
    assert resume_check.changes(saved, resume_check.run_identity(base)) == []
    # the layout, max_steps and logging may change on resume
    same = replace(base, tp=2, max_steps=999, output_dir="elsewhere", eval_interval=3)
    assert resume_check.changes(saved, resume_check.run_identity(same)) == []
    cases = {
        "--seed 1234 -> 5": replace(base, seed=5),
        "--global-batch-size 64 -> 32": replace(base, global_batch_size=32),
        "shuffle True -> False": replace(base, no_shuffle=True),
        "the loss (loss_type 'sigmoid' -> 'ipo')": replace(base, loss_type="ipo"),
        "the loss (beta 0.1 -> 0.2)": replace(base, beta=0.2),
    }
    for expected, config in cases.items():
        assert resume_check.changes(saved, resume_check.run_identity(config)) == [expected]
    Path(base.data).write_text(Path(base.data).read_text().replace("p3", "p4"))
    assert resume_check.changes(saved, resume_check.run_identity(base)) == ["--data (its content or weights) changed"]
    other_model = save_hf(llama_gqa_untied(), tmp_path / "other")
    config = json.loads((other_model / "config.json").read_text())
    (other_model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    changed = resume_check.changes(saved, resume_check.run_identity(replace(base, model=str(other_model))))
    assert changed[-1] == "--model changed"
    assert resume_check.changes({}, resume_check.run_identity(base)) == []  # a checkpoint without a record


# ----------------------------------------------------------------------------- checkpoint metadata


class _FakeGroup:
    """Stands in for the policy worker group: answers the driver's calls like the workers of a
    machine without Transformer Engine would (shards themselves are not needed here)."""

    def __init__(self, layer_spec: str):
        self.layer_spec, self.calls = layer_spec, []

    def call(self, method: str, *args, **kwargs):
        self.calls.append(method)
        if method == "layer_spec":
            return [self.layer_spec, None]
        if method == "save_checkpoint":  # the workers write their rank files (tp 1, pp 1; not read here)
            for kind in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
                (Path(args[0]) / kind / "tp0_pp0").mkdir(parents=True)
                (Path(args[0]) / kind / "tp0_pp0" / "model.safetensors").write_bytes(b"")
        return [None, None]


def _save_with_fake_group(tmp_path, model_dir, **config_changes):
    from checkpoint_convert.io import open_hf_dir
    from mcore_dpo.checkpoint import layout as checkpoint
    from mcore_dpo.driver.outputs import save_checkpoint

    config = _config(tmp_path, model_dir, **config_changes)
    spec = open_hf_dir(model_dir).spec
    final = save_checkpoint(_FakeGroup("local"), config=config, spec=spec, out=Path(config.output_dir), step=1)
    assert checkpoint.latest(config.output_dir) == final
    return final


def test_checkpoint_layer_spec_comes_from_the_workers(tmp_path, hf_llama, monkeypatch):
    """A driver that sees Transformer Engine (the workers do not) still writes the workers' spec."""
    import mcore_dpo.parallel.platform

    monkeypatch.setattr(mcore_dpo.parallel.platform, "transformer_engine_available", lambda: True)
    final = _save_with_fake_group(tmp_path, hf_llama)
    for kind in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
        assert json.loads((final / kind / "mcore_checkpoint.json").read_text())["layer_spec"] == "local"


@pytest.mark.parametrize("trust", [False, True])
def test_custom_code_is_carried_only_with_trust_remote_code(tmp_path, hf_llama, trust):
    custom = tmp_path / "custom_model"
    save_hf(llama_gqa_untied(), custom)
    (custom / "modeling_custom.py").write_text("raise SystemExit('custom code ran')\n")
    (custom / "generation_config.json").write_text("{}\n")
    final = _save_with_fake_group(tmp_path, custom, trust_remote_code=trust)
    carried = {p.name for p in (final / "model" / "hf_files").iterdir()}
    assert "generation_config.json" in carried
    assert ("modeling_custom.py" in carried) == trust


# ----------------------------------------------------------------------------- wandb


def test_wandb_is_off_without_the_flag_even_with_an_api_key(tmp_path, monkeypatch):
    from mcore_dpo.driver.metrics_log import MetricsLog

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb = pytest.importorskip("wandb")
    log = MetricsLog(tmp_path, total_steps=1)
    log.write(1, {"loss": 0.5})
    assert wandb.run is None  # no run was started
    log.close()
    assert not (tmp_path / "wandb").exists()


def test_wandb_project_needs_the_wandb_flag(hf_llama, tmp_path):
    data = _config(tmp_path, hf_llama).data
    with pytest.raises(ConfigError, match="wandb_project: given without --wandb"):
        resolve(["--model", str(hf_llama), "--data", data, "--wandb-project", "p"])
    config, _ = resolve(["--model", str(hf_llama), "--data", data, "--wandb", "--wandb-project", "p"])
    assert config.wandb and config.wandb_project == "p"
    assert not resolve(["--model", str(hf_llama), "--data", data])[0].wandb


# ----------------------------------------------------------------------------- hooks


def test_hook_points_are_empty_until_filled():
    seen = []
    hooks.fire("train_step", step=1, rank=0, output_dir="x")  # nothing registered: nothing happens
    hooks.register("train_step", lambda **info: seen.append(info))
    try:
        hooks.fire("train_step", step=2, rank=0, output_dir="x")
        hooks.fire("save_checkpoint", step=2, rank=0, output_dir="x")
    finally:
        hooks.clear()
    assert seen == [{"step": 2, "rank": 0, "output_dir": "x"}]
    with pytest.raises(ValueError, match="unknown hook point"):
        hooks.register("nowhere", print)


def test_no_fault_injection_in_the_package():
    """Test-only faults (process exits, sleeps) live under tests/, not in the training code."""
    root = Path(__file__).resolve().parents[1] / "mcore_dpo"
    for path in root.glob("*.py"):
        text = path.read_text()
        assert "os._exit" not in text and "MCORE_DPO_FAULT" not in text, path


# ----------------------------------------------------------------------------- shared output dir


def test_an_output_dir_a_node_cannot_see_is_one_line_naming_the_node(tmp_path, monkeypatch):
    from mcore_dpo.driver import ray_workers, run

    seen = {}

    def not_seeing(group, *, path, text):
        seen["token"] = (Path(path).read_text(), text)
        return [("policy/tp0-pp1-dp0", "10.1.2.3")]

    monkeypatch.setattr(ray_workers, "ranks_not_seeing", not_seeing)
    with pytest.raises(run.InputError) as error:
        run.check_shared_output_dir(object(), tmp_path)
    message = str(error.value)
    assert "\n" not in message and "node 10.1.2.3 (policy/tp0-pp1-dp0)" in message
    assert "file system every node shares" in message
    assert seen["token"][0] == seen["token"][1]  # the driver wrote the token before asking


def test_help_documents_the_new_flags():
    from mcore_dpo.command_line import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--resume-with-changes, --no-resume-with-changes Resume even when --data (its content)" in text
    assert "--wandb, --no-wandb Also log metrics to Weights & Biases" in text
    assert "--wandb-project WANDB_PROJECT Weights & Biases project" in text
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "--deterministic, --no-deterministic Deterministic GPU kernels" in text
    assert "--fused-kernels, --no-fused-kernels megatron-core's and Transformer Engine's fused kernels" in text
    for flag in ("--resume-with-changes", "--wandb", "--wandb-project", "--deterministic", "--fused-kernels"):
        assert flag in readme, flag
