"""Checkpoint directory protocol: atomic commit, the `latest` pointer, pruning, leftovers."""

from __future__ import annotations

import pytest

from mcore_dpo.checkpoint import layout as checkpoint


def _save(out, step: int, *, keep_last: int = 0):
    tmp = checkpoint.begin(out, step=step)
    (tmp / "payload.txt").write_text(f"step {step}\n")
    return checkpoint.commit(out, tmp, step=step, trainer_state={"step": step}, keep_last=keep_last)


def test_commit_makes_the_checkpoint_current(tmp_path):
    assert checkpoint.latest(tmp_path) is None
    path = _save(tmp_path, 2)
    assert checkpoint.latest(tmp_path) == path and path.name == "step_00000002"
    assert checkpoint.read_state(path)["step"] == 2
    _save(tmp_path, 4)
    assert checkpoint.latest(tmp_path).name == "step_00000004"


def test_a_partial_checkpoint_is_never_current_and_is_cleaned_up(tmp_path):
    _save(tmp_path, 2)
    partial = checkpoint.begin(tmp_path, step=4)
    (partial / "half_written.bin").write_bytes(b"\0" * 10)
    assert checkpoint.latest(tmp_path).name == "step_00000002"
    checkpoint.remove_partials(tmp_path)
    assert not partial.exists()
    assert checkpoint.latest(tmp_path).name == "step_00000002"


def test_keep_last_prunes_older_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2)
    names = sorted(p.name for p in checkpoint.root(tmp_path).iterdir() if p.name.startswith("step_"))
    assert names == ["step_00000003", "step_00000004"]


def test_a_pointer_to_an_incomplete_checkpoint_is_an_error(tmp_path):
    _save(tmp_path, 2)
    (checkpoint.root(tmp_path) / "latest").write_text("step_00000009\n")
    with pytest.raises(checkpoint.CheckpointError, match="not a complete checkpoint"):
        checkpoint.latest(tmp_path)


def test_trainer_state_of_another_format_is_rejected(tmp_path):
    path = _save(tmp_path, 2)
    (path / "trainer_state.json").write_text('{"format": "something-else", "step": 2}')
    with pytest.raises(checkpoint.CheckpointError, match="trainer_state.json"):
        checkpoint.read_state(path)


def test_the_cli_reports_a_broken_checkpoint_pointer_in_one_line(tmp_path, capsys):
    import ray

    from mcore_dpo.train import main

    out = tmp_path / "run"
    _save(out, 2)
    (checkpoint.root(out) / "latest").write_text("step_00000009\n")
    code = main(["--output-dir", str(out), "--max-steps", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "latest" in err, err
    assert not ray.is_initialized()


def test_a_run_writes_its_checkpoints_in_one_format_and_reads_them_by_what_is_on_disk(tmp_path):
    """checkpoint.formats: the run's config picks the format it writes (adapters for LoRA,
    torch_dist when asked, shards otherwise); a resume reads a checkpoint by its own layout on
    disk. Every format answers the same calls."""
    from mcore_dpo.checkpoint import formats
    from mcore_dpo.checkpoint.adapter import Adapter
    from mcore_dpo.checkpoint.shards import Shards
    from mcore_dpo.checkpoint.torch_dist import TorchDist
    from mcore_dpo.config import TrainConfig

    assert isinstance(formats.for_run(TrainConfig()), Shards)
    assert isinstance(formats.for_run(TrainConfig(save_format="torch_dist")), TorchDist)
    assert isinstance(formats.for_run(TrainConfig(lora_rank=4)), Adapter)
    plain = tmp_path / "step"
    (plain / "model").mkdir(parents=True)
    assert isinstance(formats.of_checkpoint(plain, TrainConfig(save_format="torch_dist")), Shards)
    for fmt in (Shards(), Adapter(), TorchDist()):
        for call in ("write", "finish", "policy_weights", "moving_reference", "read"):
            assert callable(getattr(fmt, call)), (fmt, call)
    assert Shards().policy_weights(plain) == str(plain / "model") and Adapter().policy_weights(plain) is None
    assert Shards().moving_reference(plain) is None  # no reference/ directory: the source
    (plain / "reference").mkdir()
    assert Shards().moving_reference(plain) == str(plain / "reference")
