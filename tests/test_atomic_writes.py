"""A kill at any moment leaves the previous state readable: the checkpoint commit and the
metrics.jsonl rewrite on resume, with a failure injected at each of their write points in turn.

The injector counts every call that changes the disk (an open for writing, which already
truncates or creates the file; an fsync; a rename; a tree removal) and raises at the k-th one,
for k = 1, 2, ... until a run gets through. What is on disk at that moment is what a kill
would leave (short of losing unsynced data, which the fsyncs guard against).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import stat

import pytest

from mcore_dpo.checkpoint import layout as checkpoint
from mcore_dpo.driver.metrics_log import MetricsLog


class Killed(Exception):
    pass


class Injector:
    """Patches the write points; raises Killed at call number `kill_at` (0: never)."""

    def __init__(self, monkeypatch, kill_at: int):
        self.kill_at, self.calls = kill_at, 0
        self.events: list[tuple[str, str]] = []  # (what, path) of every write point reached
        real_open, real_replace, real_fsync, real_rmtree = builtins.open, os.replace, os.fsync, shutil.rmtree

        def point(what: str, path) -> None:
            self.events.append((what, str(path)))
            self.calls += 1
            if self.calls == self.kill_at:
                raise Killed(what)

        def open_(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            if any(c in mode for c in "wax+"):
                try:
                    point("open", os.fsdecode(file) if not isinstance(file, int) else file)
                except Killed:
                    handle.close()
                    raise
            return handle

        def replace(src, dst, *args, **kwargs):
            point("replace", dst)
            return real_replace(src, dst, *args, **kwargs)

        def fsync(fd):
            kind = "fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file"
            point(kind, os.readlink(f"/proc/self/fd/{fd}"))
            return real_fsync(fd)

        def rmtree(path, *args, **kwargs):
            point("rmtree", path)
            return real_rmtree(path, *args, **kwargs)

        for target, name, value in ((builtins, "open", open_), (io, "open", open_), (os, "replace", replace),
                                    (os, "fsync", fsync), (shutil, "rmtree", rmtree)):
            monkeypatch.setattr(target, name, value)


def _each_kill_point(monkeypatch, *, setup, action, check) -> tuple[int, list[tuple[str, str]]]:
    """For k = 1, 2, ...: `setup(k)` a fresh directory, run `action` on it with a kill at write
    point k, `check` the disk. Returns the number of write points (the first k at which
    `action` completes) and that complete run's write events."""
    k = 1
    while True:
        state = setup(k)
        with monkeypatch.context() as patch:
            injector = Injector(patch, kill_at=k)
            try:
                action(state)
                return k, injector.events
            except Killed:
                where = f"kill at {injector.events[-1]}"
        check(state, where)
        k += 1
        assert k < 200, "the action never completed"


def _payload(path) -> str:
    return (path / "payload.txt").read_text()


def _write_checkpoint(out, step: int, *, keep_last: int = 0):
    tmp = checkpoint.begin(out, step=step)
    (tmp / "payload.txt").write_text(f"step {step}\n")
    return checkpoint.commit(out, tmp, step=step, trainer_state={"step": step}, keep_last=keep_last)


@pytest.mark.parametrize("stale_same_step", [False, True], ids=["fresh", "earlier_attempt_of_same_step"])
def test_checkpoint_commit_killed_at_each_write_point(tmp_path, monkeypatch, stale_same_step):
    """Step 2 is current; step 4 is being committed (in the second case over a step-4 directory
    that an earlier attempt renamed but never made current). At every kill point, `latest`
    names a complete, readable checkpoint (step 2, or the new step 4 once the pointer moved),
    the earlier step-4 copy is not lost before the new one has its name, and a resume (clean
    the partials, write step 4 again) succeeds."""
    def setup(k):
        out = tmp_path / f"run{k}"
        _write_checkpoint(out, 2)
        if stale_same_step:
            stale = checkpoint.root(out) / "step_00000004"
            stale.mkdir()
            (stale / "payload.txt").write_text("stale step 4\n")
            (stale / "trainer_state.json").write_text(json.dumps({"format": checkpoint.FORMAT,
                                                                  "format_version": checkpoint.FORMAT_VERSION,
                                                                  "step": 4}))
        tmp = checkpoint.begin(out, step=4)
        (tmp / "payload.txt").write_text("step 4\n")
        return out, tmp

    def action(state):
        out, tmp = state
        checkpoint.commit(out, tmp, step=4, trainer_state={"step": 4}, keep_last=0)

    def check(state, where):
        out, _ = state
        current = checkpoint.latest(out)
        assert current is not None, where
        saved = checkpoint.read_state(current)
        assert (current.name, saved["step"], _payload(current)) in (
            ("step_00000002", 2, "step 2\n"), ("step_00000004", 4, "step 4\n")), where
        if stale_same_step:  # the final name, or the copy moved aside (not the partial being committed)
            copies = [p for p in checkpoint.root(out).iterdir()
                      if p.name == "step_00000004" or p.name.startswith("step_00000004.partial-replaced-")]
            assert {_payload(p) for p in copies} & {"stale step 4\n", "step 4\n"}, f"step 4 lost: {where}"
        checkpoint.remove_partials(out)
        _write_checkpoint(out, 6)  # the resumed run goes on and saves again
        assert checkpoint.latest(out).name == "step_00000006"

    points, events = _each_kill_point(monkeypatch, setup=setup, action=action, check=check)
    assert points >= 6  # state file, fsyncs, renames, pointer: every one was a kill point
    # Durability order: each rename is followed by an fsync of the directory that holds it,
    # and the checkpoint's files are fsynced before its rename.
    ckpts = str(checkpoint.root(tmp_path / f"run{points}"))
    renames = [i for i, (what, path) in enumerate(events) if what == "replace"]
    for i in renames:
        assert ("fsync dir", os.path.dirname(events[i][1])) in events[i + 1 :], f"no directory fsync after {events[i]}"
    final_rename = next(i for i in renames if events[i][1] == os.path.join(ckpts, "step_00000004"))
    synced = {os.path.basename(path) for what, path in events[:final_rename] if what == "fsync file"}
    assert {"payload.txt", "trainer_state.json"} <= synced, events[:final_rename]


def test_metrics_rewrite_on_resume_killed_at_each_write_point(tmp_path, monkeypatch):
    """Resuming from step 2 drops steps 3-4 from metrics.jsonl; a kill at any point leaves
    either the old file or the new one, never a truncated mix."""
    old = [{"step": s, "loss": 1.0 / (s + 1)} for s in range(5)]
    old_text = "".join(json.dumps(r) + "\n" for r in old)
    new_text = "".join(json.dumps(r) + "\n" for r in old[:3])

    import torch.utils.tensorboard

    def no_tensorboard(*args, **kwargs):
        raise ImportError("not in this test")

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", no_tensorboard)  # its writer thread opens files

    def setup(k):
        out = tmp_path / f"run{k}"
        out.mkdir()
        (out / "metrics.jsonl").write_text(old_text)
        return out

    def action(out):
        MetricsLog(out, total_steps=4, keep_up_to_step=2).close()

    def check(out, where):
        assert (out / "metrics.jsonl").read_text() in (old_text, new_text), where

    points, _ = _each_kill_point(monkeypatch, setup=setup, action=action, check=check)
    assert (tmp_path / f"run{points}" / "metrics.jsonl").read_text() == new_text


def test_metrics_of_a_run_without_checkpoint_are_kept(tmp_path):
    """Starting over (no checkpoint) does not empty an earlier metrics.jsonl: it moves to
    metrics.jsonl.1 (then .2, ...) and the new run starts a fresh file."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    log = MetricsLog(tmp_path, total_steps=1)
    log.write(1, {"loss": 0.25})
    log.close()
    assert (tmp_path / "metrics.jsonl.1").read_text() == '{"step": 1, "loss": 0.5}\n'
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 0.25
    MetricsLog(tmp_path, total_steps=1).close()
    assert (tmp_path / "metrics.jsonl.2").is_file() and (tmp_path / "metrics.jsonl.1").is_file()
