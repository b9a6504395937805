"""Resume is the same run or an explicit choice: through the command line, a checkpointed run
refuses to resume with another --seed or changed data content (one line naming the change,
exit 2, before any worker starts), and continues with --resume-with-changes. The first run also
logs to Weights & Biases (the wandb package, offline mode) because --wandb asks it to."""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

import pytest

from tests.helpers.cli import run_train
from tests.helpers.ray_runs import main_in_process

SMALL = ["--global-batch-size", "8", "--micro-batch-size", "4", "--eval-interval", "0", "--no-export-hf"]


def _run(args: list[str], *, env: dict) -> subprocess.CompletedProcess:
    return run_train([*SMALL, *args], env=env, timeout=600)


def _wandb_records(run_file: Path):
    """The records of an offline wandb run file: a 7-byte header, then LevelDB-log blocks of
    32 KiB whose chunks (4-byte CRC, 2-byte length, 1-byte type) carry protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_resume_refuses_a_changed_run_unless_asked(tmp_path, ray_cluster):
    """The first run through `python -m mcore_dpo.train` (wandb's offline service stays in its
    process); the later ones through the command line in this process, on the session's cluster."""
    pytest.importorskip("wandb")
    from mcore_dpo.driver import defaults

    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("WANDB_API_KEY", None)
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(Path(defaults.DEFAULT_TRAIN_DATA).read_text().splitlines(keepends=True)[:16]))
    out = tmp_path / "run"
    base = ["--data", str(data), "--output-dir", str(out)]

    first = _run([*base, "--max-steps", "2", "--save-interval", "1", "--wandb", "--wandb-project", "dpo-test"], env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    # the last step is saved too: `latest` names the newest checkpoint
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"

    # --wandb logged every metric line under the project it names
    run_files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, run_files
    projects, logged = set(), {}
    for record in _wandb_records(run_files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            projects.add(record.run.project)
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            logged[int(items["_step"])] = {k for k in items if not k.startswith("_")}
    assert projects == {"dpo-test"}
    assert sorted(logged) == [1, 2]
    for keys in logged.values():
        assert {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected", "grad_norm", "lr"} <= keys, keys

    refused = main_in_process([*SMALL, *base, "--max-steps", "3", "--seed", "5"], cluster=ray_cluster)
    assert refused.returncode == 2
    err = refused.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"output_dir: {out} holds another run: --seed 1234 -> 5;" in err, err
    assert "--resume-with-changes" in err

    data.write_text(data.read_text().replace('"', '"', 1) + data.read_text().splitlines(keepends=True)[0])
    refused = main_in_process([*SMALL, *base, "--max-steps", "3"], cluster=ray_cluster)
    assert refused.returncode == 2 and "--data (its content or weights) changed" in refused.stderr, refused.stderr[-2000:]

    resumed = main_in_process([*SMALL, *base, "--max-steps", "3", "--seed", "5", "--resume-with-changes"],
                              cluster=ray_cluster)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming despite changes (--resume-with-changes): --data (its content or weights) changed; --seed 1234 -> 5" in resumed.stdout
    assert "resuming from" in resumed.stdout
