"""Checkpoint integrity: checksums (checkpoint_convert/integrity.py), the rank each Megatron
rank file records, the trainer's manifest and the resume's fallback to the newest intact
checkpoint (checkpoint/layout.py). Unit tests on files first, then the command lines: one
training run at tp 2 is shared by the tests that need a trainer's output (copied per test)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import xxhash
from safetensors.torch import load_file, save_file

from checkpoint_convert import integrity
from checkpoint_convert.convert import hf_to_mcore
from checkpoint_convert.families.base import ConversionError
from checkpoint_convert.io import META_FILE, McoreCheckpoint
from checkpoint_convert.safetensors_stream import SafetensorsReader
from mcore_dpo.checkpoint import layout
from tests.helpers.cli import run_python, run_train
from tests.helpers.models import llama_gqa_untied, save_hf

RANK_FILE = "tp0_pp0/model.safetensors"


def _overwrite(path: Path, *, length: int = 256) -> None:
    """`length` bytes overwritten in the middle of the file's data (a safetensors file's
    tensor data: past its header), its size unchanged."""
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little") if path.suffix == ".safetensors" else 0
    offset = header + (path.stat().st_size - header - length) // 2
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(bytes(255 - b for b in path.read_bytes()[offset:offset + length]))


def _one_error_line(result) -> str:
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# --- integrity.py -------------------------------------------------------------------------------

def test_checksum_streams_in_blocks_and_matches_xxh3(tmp_path, monkeypatch):
    data = bytes(range(256)) * 1000 + b"tail"
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    monkeypatch.setattr(integrity, "BLOCK_BYTES", 1000)  # many blocks, the last one short
    assert integrity.file_checksum(path) == xxhash.xxh3_64(data).hexdigest()
    assert integrity.checksum_entry(path) == {"bytes": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}


@pytest.fixture
def tree(tmp_path) -> Path:
    root = tmp_path / "ckpt"
    (root / "model" / "tp0_pp0").mkdir(parents=True)
    (root / "model" / "tp0_pp0" / "model.safetensors").write_bytes(b"\x01" * 4096)
    (root / "rng").mkdir()
    (root / "rng" / "rank0.safetensors").write_bytes(b"rng")
    (root / "trainer_state.json").write_text("{}")
    return root


def test_manifest_lists_every_file_and_verifies(tree):
    entries = integrity.write_manifest(tree)
    assert sorted(entries) == ["model/tp0_pp0/model.safetensors", "rng/rank0.safetensors", "trainer_state.json"]
    assert integrity.verify_manifest(tree) is True


@pytest.mark.parametrize("damage, problem", [
    (lambda f: f.write_bytes(b"\x02" + f.read_bytes()[1:]), "checksum mismatch (the file is corrupt or was replaced)"),
    (lambda f: f.write_bytes(f.read_bytes()[:-1]), "has 4095 bytes, 4096 were recorded"),
    (lambda f: f.unlink(), "file is missing"),
])
def test_a_changed_file_is_named_in_one_line(tree, damage, problem):
    integrity.write_manifest(tree)
    bad = tree / "model" / "tp0_pp0" / "model.safetensors"
    damage(bad)
    with pytest.raises(integrity.IntegrityError) as caught:
        integrity.verify_manifest(tree)
    message = str(caught.value)
    assert message.startswith(f"{bad}: ") and problem in message and "\n" not in message
    assert caught.value.path == bad and isinstance(caught.value, ConversionError)


def test_an_unlisted_file_is_refused_and_no_manifest_checks_nothing(tree):
    assert integrity.verify_manifest(tree) is False  # written before manifests: nothing to check
    integrity.write_manifest(tree)
    extra = tree / "model" / "tp1_pp0" / "model.safetensors"
    extra.parent.mkdir()
    extra.write_bytes(b"x")
    with pytest.raises(integrity.IntegrityError, match="is not listed in"):
        integrity.verify_manifest(tree)


def test_known_entries_are_reused_when_the_size_matches(tree):
    rel = "rng/rank0.safetensors"
    known = {rel: {"bytes": 3, "xxh3_64": "recorded"}, "trainer_state.json": {"bytes": 99, "xxh3_64": "stale"}}
    entries = integrity.tree_checksums(tree, known=known)
    assert entries[rel]["xxh3_64"] == "recorded"  # not read again
    assert entries["trainer_state.json"] == integrity.checksum_entry(tree / "trainer_state.json")


# --- Megatron directories: rank records and checksums -------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_hf(llama_gqa_untied(), tmp_path_factory.mktemp("llama") / "hf")


@pytest.fixture
def mcore_tp2(hf_dir, tmp_path) -> Path:
    out = tmp_path / "m"
    hf_to_mcore(hf_dir, out, tp=2, pp=1, log=lambda _msg: None)
    return out


def test_rank_files_record_their_rank_and_the_meta_their_checksums(mcore_tp2):
    for tp_rank in (0, 1):
        rel = f"tp{tp_rank}_pp0/model.safetensors"
        metadata = SafetensorsReader(mcore_tp2 / rel).metadata
        assert (metadata["tp_rank"], metadata["pp_rank"], metadata["ep_rank"]) == (str(tp_rank), "0", "0")
        recorded = json.loads((mcore_tp2 / META_FILE).read_text())["checksums"][rel]
        assert recorded == integrity.checksum_entry(mcore_tp2 / rel)


def test_rank_file_checksums_are_taken_from_the_writer_not_read_back(hf_dir, tmp_path, monkeypatch):
    """The rank files are hashed as they are written: recording their checksums in the metadata
    reads no file back, and no note of the writer's is left in the directory."""
    def no_reading(path):
        raise AssertionError(f"{path} was read back to be hashed")

    monkeypatch.setattr(integrity, "file_checksum", no_reading)
    out = tmp_path / "m"
    hf_to_mcore(hf_dir, out, tp=2, pp=1, log=lambda _msg: None)
    monkeypatch.undo()
    recorded = json.loads((out / META_FILE).read_text())["checksums"]
    assert recorded == {rel: integrity.checksum_entry(out / rel) for rel in recorded} and len(recorded) == 2
    assert not [p.name for p in out.rglob(".*")]


def test_a_rank_file_copied_over_another_is_refused_on_open(mcore_tp2):
    shutil.copy(mcore_tp2 / "tp1_pp0/model.safetensors", mcore_tp2 / RANK_FILE)
    with pytest.raises(ConversionError) as caught:
        McoreCheckpoint(mcore_tp2)
    assert str(caught.value).startswith(f"{mcore_tp2 / RANK_FILE}: holds the shard of rank (tp 1, pp 0, ep 0)")


def test_a_corrupt_rank_file_is_refused_before_its_first_tensor(mcore_tp2):
    _overwrite(mcore_tp2 / RANK_FILE)
    view = McoreCheckpoint(mcore_tp2).hf_view()  # opening reads headers only
    with pytest.raises(ConversionError, match="checksum mismatch"):
        view.get("model.embed_tokens.weight")
    McoreCheckpoint(mcore_tp2, verify_checksums=False).hf_view().get("model.embed_tokens.weight")  # a checked caller


def test_a_directory_written_before_checksums_still_loads(mcore_tp2):
    meta = json.loads((mcore_tp2 / META_FILE).read_text())
    del meta["checksums"]
    (mcore_tp2 / META_FILE).write_text(json.dumps(meta))
    for rel in ("tp0_pp0/model.safetensors", "tp1_pp0/model.safetensors"):  # headers without a record
        save_file(load_file(str(mcore_tp2 / rel)), str(mcore_tp2 / rel), metadata={"format": "pt"})
    view = McoreCheckpoint(mcore_tp2).hf_view()
    assert view.get("model.embed_tokens.weight").shape[0] > 0


def test_a_rank_file_of_another_layout_left_behind_is_refused(mcore_tp2):
    extra = mcore_tp2 / "tp2_pp0" / "model.safetensors"
    extra.parent.mkdir()
    shutil.copy(mcore_tp2 / RANK_FILE, extra)
    with pytest.raises(ConversionError, match=f"{extra}: is not a rank file of the layout"):
        McoreCheckpoint(mcore_tp2)


# --- the trainer's checkpoints: manifest, resume point, fallback --------------------------------

def _commit(out: Path, step: int, *, keep_last: int = 0) -> Path:
    tmp = layout.begin(out, step=step)
    (tmp / "model").mkdir()
    (tmp / "model" / "weights.bin").write_bytes(bytes([step]) * 1000)
    return layout.commit(out, tmp, step=step, trainer_state={"step": step}, keep_last=keep_last)


def test_commit_writes_a_manifest_of_every_file(tmp_path):
    final = _commit(tmp_path, 2)
    files = json.loads((final / integrity.MANIFEST_FILE).read_text())["files"]
    assert sorted(files) == ["model/weights.bin", "trainer_state.json"]
    assert layout.resume_point(tmp_path) == (final, None)


def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path):
    _commit(tmp_path, 2)
    four = _commit(tmp_path, 4)
    six = _commit(tmp_path, 6)
    _overwrite(six / "model" / "weights.bin", length=16)
    layout._checked.clear()  # a fresh driver: nothing checked by this process yet
    point, note = layout.resume_point(tmp_path)
    assert point == four
    assert note == (f"{six / 'model' / 'weights.bin'}: checksum mismatch (the file is corrupt or was replaced); "
                    "resuming from the older intact checkpoint step_00000004 (step 4) instead")
    layout.make_current(tmp_path, four)
    again = _commit(tmp_path, 6, keep_last=2)  # the run saves step 6 again: it replaces the failed one
    assert layout.latest(tmp_path) == again and integrity.verify_manifest(again)
    assert sorted(p.name for p in layout.root(tmp_path).iterdir() if p.name.startswith("step_")) == [
        "step_00000004", "step_00000006"]


def test_no_intact_checkpoint_is_one_line_naming_the_file(tmp_path):
    two, four = _commit(tmp_path, 2), _commit(tmp_path, 4)
    (two / "model" / "weights.bin").write_bytes(b"")
    _overwrite(four / "model" / "weights.bin", length=16)
    layout._checked.clear()
    with pytest.raises(layout.CheckpointError) as caught:
        layout.resume_point(tmp_path)
    assert str(caught.value).startswith(f"{four / 'model' / 'weights.bin'}: checksum mismatch")
    assert "no intact checkpoint to resume from (and the 1 older one too)" in str(caught.value)


def test_a_checkpoint_written_before_manifests_resumes_unchecked(tmp_path):
    final = _commit(tmp_path, 2)
    (final / integrity.MANIFEST_FILE).unlink()
    layout._checked.clear()
    assert layout.resume_point(tmp_path) == (final, None)


# --- through the command lines ------------------------------------------------------------------

TRAIN = ["--tp", "2", "--max-steps", "6", "--save-interval", "2", "--eval-interval", "0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """An uninterrupted run at tp 2 with checkpoints at steps 2, 4 and 6 (and its hf/ export,
    which went through the export's checks)."""
    out = tmp_path_factory.mktemp("trained") / "out"
    result = run_train([*TRAIN, "--output-dir", str(out)])
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _copy(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    return out


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timing = ("tokens/s", "step_time_s", "bubble_fraction")  # measured, not computed
    return [{k: v for k, v in row.items() if k not in timing and not k.startswith("memory/")} for row in rows]


def test_resume_falls_back_from_a_corrupt_newest_checkpoint(trained, tmp_path):
    out = _copy(trained, tmp_path)
    (out / "complete.json").unlink()  # killed after the last checkpoint, before the run was marked complete
    bad = out / "checkpoints" / "step_00000006" / "model" / RANK_FILE
    _overwrite(bad)
    result = run_train([*TRAIN, "--output-dir", str(out)])
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "resuming from" in line]
    assert lines == [f"{bad}: checksum mismatch (the file is corrupt or was replaced); resuming from the older "
                     "intact checkpoint step_00000004 (step 4) instead"], result.stdout
    assert _metrics(out) == _metrics(trained)  # steps 5 and 6 trained again, as the uninterrupted run did
    before, after = ({n: t for f in sorted((d / "hf").glob("*.safetensors")) for n, t in load_file(str(f)).items()}
                     for d in (trained, out))
    assert before.keys() == after.keys() and all(before[n].equal(after[n]) for n in before)
    assert layout.latest(out).name == "step_00000006" and integrity.verify_manifest(layout.latest(out))


def test_every_checkpoint_corrupt_is_one_line(trained, tmp_path):
    out = _copy(trained, tmp_path)
    (out / "complete.json").unlink()
    for step in (2, 4, 6):
        _overwrite(out / "checkpoints" / f"step_{step:08d}" / "model" / RANK_FILE)
    result = run_train([*TRAIN, "--output-dir", str(out)])
    assert result.returncode == 2, result.stdout + result.stderr
    err = _one_error_line(result)
    assert f"step_00000006/model/{RANK_FILE}: checksum mismatch" in err and "no intact checkpoint" in err, err


@pytest.mark.parametrize("command", ["mcore-to-hf", "reshard"])
def test_a_swapped_tp_shard_is_refused_by_the_converter(trained, tmp_path, command):
    model = tmp_path / "model"
    shutil.copytree(trained / "checkpoints" / "step_00000006" / "model", model)
    for tp_rank in (0, 1):  # the trainer's ranks recorded theirs
        assert SafetensorsReader(model / f"tp{tp_rank}_pp0/model.safetensors").metadata["tp_rank"] == str(tp_rank)
    shutil.copy(model / "tp1_pp0/model.safetensors", model / RANK_FILE)
    target = tmp_path / "target"
    extra = ["--tp", "1", "--pp", "1"] if command == "reshard" else []
    result = run_python(["-m", "checkpoint_convert", command, "--mcore-dir", str(model), "--out", str(target), *extra])
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{model / RANK_FILE}: holds the shard of rank (tp 1, pp 0, ep 0)" in _one_error_line(result)
    assert not target.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".target")]


def test_a_corrupt_shard_is_refused_by_mcore_to_hf(trained, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(trained / "checkpoints" / "step_00000006" / "model", model)
    _overwrite(model / "tp1_pp0/model.safetensors")
    result = run_python(["-m", "checkpoint_convert", "mcore-to-hf", "--mcore-dir", str(model), "--out", str(tmp_path / "hf")])
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{model / 'tp1_pp0/model.safetensors'}: checksum mismatch" in _one_error_line(result)
    assert not (tmp_path / "hf").exists()


def test_the_checksum_benchmark_runs():
    result = run_python(["benchmarks/checksum.py", "--mib", "4", "--runs", "1"])
    assert result.returncode == 0 and "MB/s" in result.stdout, result.stdout + result.stderr
