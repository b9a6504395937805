"""A mature trainer's manners, through the real command line: runs never mix in one output
directory, a step directory exports directly, and --help documents every option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_dpo.driver import output_dir, ray_workers, run
from mcore_dpo.train import main


@pytest.fixture
def driver_only(monkeypatch):
    """The driver's checks and directory handling run for real; the worker group is replaced by
    a stand-in that writes what a run writes (metrics.jsonl), so no Ray cluster starts."""
    monkeypatch.setattr(ray_workers, "connect", lambda **_: False)
    monkeypatch.setattr(ray_workers, "disconnect", lambda started: None)
    attempts = []

    def attempt(prep, *, out, log):
        attempts.append(out)
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "seed": prep.config.seed}) + "\n")

    monkeypatch.setattr(run, "_attempt", attempt)
    return attempts


def test_two_runs_without_output_dir_keep_separate_outputs(tmp_path, monkeypatch, capsys, driver_only):
    monkeypatch.chdir(tmp_path)
    assert main(["--max-steps", "1"]) == 0
    assert main(["--max-steps", "1", "--seed", "7"]) == 0
    first, second = driver_only
    assert first != second and first.parent == second.parent == Path("outputs")
    assert first.name.endswith("tiny-default") or "tiny-default-" in first.name
    for out, seed in ((first, 1234), (second, 7)):
        assert json.loads((out / "metrics.jsonl").read_text())["seed"] == seed
        assert (out / "config.yaml").is_file() and (out / output_dir.RUN_FILE).is_file()
    printed = capsys.readouterr().out
    assert f"output directory: {first}" in printed and f"output directory: {second}" in printed


def test_an_explicit_output_dir_of_another_run_is_refused_unless_overwrite(tmp_path, capsys, driver_only):
    out = tmp_path / "run"
    assert main(["--max-steps", "1", "--output-dir", str(out)]) == 0
    capsys.readouterr()
    # The same command again is the same run: allowed (here it is already complete).
    assert main(["--max-steps", "1", "--output-dir", str(out)]) == 0
    assert "already complete" in capsys.readouterr().out
    # Another run (another seed) into it, finished or not: one line naming the change with both
    # ways out, exit 2, nothing touched.
    assert main(["--max-steps", "1", "--seed", "7", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err, err
    assert "holds another run: --seed 1234 -> 7;" in err and "--resume-with-changes" in err and "--overwrite" in err, err
    assert json.loads((out / "metrics.jsonl").read_text())["seed"] == 1234
    # Another model into a finished run's directory is refused the same way, not "already complete".
    other_model = tmp_path / "model-b"
    _copy_default_model_with_other_weights(other_model)
    assert main(["--max-steps", "1", "--model", str(other_model), "--data", _default_data(), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds another run: --model changed" in err, err
    assert "--resume-with-changes" in err and "--overwrite" in err
    # A directory of unrelated files is refused too.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine\n")
    assert main(["--max-steps", "1", "--output-dir", str(other)]) == 2
    assert (other / "notes.txt").read_text() == "mine\n"
    capsys.readouterr()
    # --overwrite starts afresh there.
    assert main(["--max-steps", "1", "--seed", "7", "--output-dir", str(out), "--overwrite"]) == 0
    assert json.loads((out / "metrics.jsonl").read_text())["seed"] == 7
    assert len(driver_only) == 2


def _default_data() -> str:
    from mcore_dpo.driver import defaults

    return defaults.DEFAULT_TRAIN_DATA


def _copy_default_model_with_other_weights(target: Path) -> None:
    """The tiny default model's directory with the same architecture, file names and sizes, but
    other weights: only the weights' content tells the two apart."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from mcore_dpo.driver import defaults

    shutil.copytree(defaults.ensure_default_model(), target)
    for path in target.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({k: (v + 1e-3 * torch.randn_like(v)).contiguous() for k, v in tensors.items()}, path,
                  metadata={"format": "pt"})


def test_resume_with_changes_continues_another_run_in_its_directory(tmp_path, capsys, driver_only):
    out = tmp_path / "run"
    assert main(["--max-steps", "1", "--output-dir", str(out)]) == 0
    capsys.readouterr()
    assert main(["--max-steps", "2", "--seed", "7", "--output-dir", str(out), "--resume-with-changes"]) == 0
    printed = capsys.readouterr().out
    assert "resuming despite changes (--resume-with-changes): --seed 1234 -> 7" in printed, printed
    assert len(driver_only) == 2 and json.loads((out / "metrics.jsonl").read_text())["seed"] == 7
    # the directory now holds the changed run: its own command continues it without the flag
    assert main(["--max-steps", "2", "--seed", "7", "--output-dir", str(out)]) == 0
    assert "already complete at step 2" in capsys.readouterr().out


def test_a_refused_or_complete_run_starts_no_ray(tmp_path, capsys, driver_only):
    out = tmp_path / "run"
    assert main(["--max-steps", "1", "--output-dir", str(out)]) == 0
    assert "starting a local Ray cluster" in capsys.readouterr().out
    for argv, code in ((["--max-steps", "1"], 0), (["--max-steps", "1", "--seed", "7"], 2)):
        assert main([*argv, "--output-dir", str(out)]) == code
        captured = capsys.readouterr()
        assert "starting a local Ray cluster" not in captured.out + captured.err


def test_fresh_dirs_never_collide(tmp_path):
    first = output_dir.fresh_dir(model="/models/Llama-3-8B/", base=tmp_path, now=0)
    assert first.name == "19700101-000000-Llama-3-8B"
    first.mkdir()
    second = output_dir.fresh_dir(model="/models/Llama-3-8B", base=tmp_path, now=0)
    assert second != first and not second.exists()


def test_mcore_to_hf_accepts_a_trainer_step_dir_and_latest(tmp_path, capsys):
    """A trainer checkpoint's step directory (and the `latest` pointer) exports exactly as its
    inner model/ folder does."""
    from safetensors.torch import load_file

    from checkpoint_convert.__main__ import main as convert
    from mcore_dpo.checkpoint import layout as checkpoint
    from mcore_dpo.driver import defaults

    model = defaults.ensure_default_model()
    out = tmp_path / "run"
    tmp = checkpoint.begin(out, step=3)
    assert convert(["hf-to-mcore", "--hf-dir", model, "--out", str(tmp / "model")]) == 0
    step_dir = checkpoint.commit(out, tmp, step=3, trainer_state={"step": 3}, keep_last=0)
    exports = {}
    for name, given in (("inner", step_dir / "model"), ("step", step_dir),
                        ("latest", checkpoint.root(out) / "latest")):
        exports[name] = tmp_path / f"hf-{name}"
        assert convert(["mcore-to-hf", "--mcore-dir", str(given), "--out", str(exports[name])]) == 0, \
            capsys.readouterr().err
    inner = {p.name: load_file(p) for p in exports["inner"].glob("*.safetensors")}
    assert inner
    for name in ("step", "latest"):
        got = {p.name: load_file(p) for p in exports[name].glob("*.safetensors")}
        assert got.keys() == inner.keys()
        for file, tensors in inner.items():
            assert all(got[file][k].equal(v) for k, v in tensors.items())


def test_rerunning_a_finished_run_says_already_complete_and_does_not_train(tmp_path, capsys, driver_only):
    out = tmp_path / "run"
    argv = ["--max-steps", "2", "--output-dir", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 0
    assert "already complete at step 2" in capsys.readouterr().out
    assert len(driver_only) == 1  # the rerun started no workers
    # Extending the run (more steps) trains again.
    assert main(["--max-steps", "3", "--output-dir", str(out)]) == 0
    assert len(driver_only) == 2


def test_checkpointing_is_on_by_default():
    from mcore_dpo.command_line import resolve

    config, _ = resolve([])
    assert config.save_interval > 0 and config.save_interval_min > 0
    config, _ = resolve(["--save-interval-min", "0.5", "--save-interval", "0"])
    assert config.save_interval_min == 0.5 and config.save_interval == 0


# SIGTERM through the real command line: tests/test_process_lifetime.py (to the process group: the
# stop line, the checkpoint of that step, no completion mark) and tests/test_run_directory.py (to
# the driver, then the run resumed and finished).


def test_help_gives_every_option_a_description_default_and_group(capsys):
    from mcore_dpo.command_line import HELP_GROUPS, build_parser

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    parser = build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and "(default:" in action.help, action.option_strings
        description = action.help.split("(default:")[0].strip()
        assert len(description) > 8, action.option_strings
        for flag in action.option_strings:
            assert flag in printed
    for group in HELP_GROUPS:
        assert f"\n{group}:\n" in printed
    for allowed in ("precomputed", "separate", "ipo", "bfloat16", "float16"):  # ref modes, loss types, dtypes
        assert allowed in printed
    assert "--no-no-shuffle" not in printed


def test_an_abbreviated_option_is_rejected(capsys):
    assert main(["--max-step", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-step" in err, err


def test_the_console_script_shows_its_own_name(monkeypatch):
    import sys

    from mcore_dpo.command_line import build_parser

    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/mcore-dpo-train", "--help"])
    assert build_parser().format_usage().startswith("usage: mcore-dpo-train ")
    monkeypatch.setattr(sys, "argv", ["/repo/mcore_dpo/train.py", "--help"])
    assert build_parser().format_usage().startswith("usage: python -m mcore_dpo.train ")


def test_the_same_command_without_output_dir_continues_its_own_directory(tmp_path, monkeypatch, capsys, driver_only):
    monkeypatch.chdir(tmp_path)
    assert main(["--max-steps", "1"]) == 0
    capsys.readouterr()
    assert main(["--max-steps", "1"]) == 0
    printed = capsys.readouterr().out
    assert "continuing there" in printed and "already complete at step 1" in printed, printed
    assert len(driver_only) == 1 and len(list((tmp_path / "outputs").iterdir())) == 1
    assert main(["--max-steps", "2"]) == 0  # a larger --max-steps extends the same run, in its directory
    assert len(driver_only) == 2 and driver_only[1] == driver_only[0]
    assert main(["--max-steps", "2", "--seed", "7"]) == 0  # another command: a directory of its own
    assert len(driver_only) == 3 and driver_only[2] != driver_only[0]
