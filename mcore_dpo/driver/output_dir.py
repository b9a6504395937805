"""Which directory a run writes to, and the rule that two runs never mix in one.

- No --output-dir: a fresh directory per run, outputs/<UTC time>-<model name>; except that the
  same command (the same resolved configuration) run again continues its own earlier directory
  there (resumes it, or says it is already complete), so that rerunning a command resumes.
- An explicit --output-dir that is empty or missing: used as is.
- One that holds this same run (its run.json names the same run identity): used, so rerunning
  the same command resumes, says it is already complete, or, with a larger --max-steps,
  continues from the final step.
- One that holds another run, finished or not: refused in one line naming each field that
  differs (old -> new), unless --resume-with-changes (continued with the changes) or
  --overwrite (emptied, started afresh). Any other contents: refused unless --overwrite.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from checkpoint_convert import durable
from mcore_dpo.driver.run_lock import LOCK_FILE

RUN_FILE = "run.json"  # the run identity of the run that owns the directory


def _as_stored(value: dict) -> dict:
    """`value` as it reads back from its JSON file (tuples become lists), for comparison."""
    return json.loads(json.dumps(value))


def fresh_dir(*, model: str | None, base: str | Path = "outputs", now: float | None = None) -> Path:
    """A new, not yet existing directory under `base` named after the UTC time and the model."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    name = Path(model.rstrip("/")).name if model else "tiny-default"
    candidate = Path(base) / f"{stamp}-{name}"
    n = 1
    while candidate.exists():
        n += 1
        candidate = Path(base) / f"{stamp}-{name}-{n}"
    return candidate


def same_command_dir(*, command: dict, base: str | Path = "outputs") -> Path | None:
    """The newest directory under `base` that a run of this same `command` (its resolved
    configuration, output directory aside) claimed, or None."""
    wanted = _as_stored(command)
    found = []
    for out in Path(base).iterdir() if Path(base).is_dir() else ():
        try:
            if json.loads((out / RUN_FILE).read_text(encoding="utf-8")).get("command") == wanted:
                found.append(((out / RUN_FILE).stat().st_mtime, out.name, out))
        except (OSError, ValueError, AttributeError):
            continue
    return max(found)[2] if found else None


def owner_identity(out: Path) -> dict | None:
    """The run identity recorded in `out`, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((out / RUN_FILE).read_text(encoding="utf-8")).get("run")
    except (OSError, ValueError, AttributeError):
        return None


def is_empty(out: Path) -> bool:
    """Nothing in `out` but the run lock (run_lock.py) the driver takes before it asks."""
    return not out.exists() or (out.is_dir() and all(p.name == LOCK_FILE for p in out.iterdir()))


def door_problem(out: Path, *, identity: dict, checkpoint_identity: dict | None, has_checkpoint: bool,
                 resume: bool, resume_with_changes: bool) -> tuple[str | None, list[str]]:
    """The one rule of an existing `out` for the run of `identity`: (why it may not be used,
    None when it may; the changes from the run it holds that --resume-with-changes accepted).

    The run a directory holds is the identity in its run.json (else its checkpoint's). The same
    run continues (resumes, extends, or is already complete). Any other run, finished or not,
    is refused in one line naming each field that differs, with both ways out."""
    from mcore_dpo.driver.resume_check import changes

    if is_empty(out):
        return None, []
    if not out.is_dir():
        return f"output_dir: {out} is a file, not a directory", []
    held = owner_identity(out) or checkpoint_identity
    if held is None:
        return (f"output_dir: {out} holds files that are not a run's outputs; pass --overwrite to empty it and "
                "start there, or choose another --output-dir"), []
    differs = changes(held, _as_stored(identity))
    if differs and not resume_with_changes:
        return (f"output_dir: {out} holds another run: {'; '.join(differs)}; pass --resume-with-changes to continue "
                "it with these changes, or --overwrite to start afresh there"), []
    if has_checkpoint and not resume:
        return (f"output_dir: {out} holds checkpoints and --no-resume is set; pass --overwrite to start afresh "
                "there, or choose another --output-dir"), []
    return None, differs


def claim(out: Path, *, identity: dict, overwrite: bool, command: dict | None = None) -> None:
    """Empty `out` when overwriting, create it, and record the run that owns it (its identity,
    and the resolved configuration that `same_command_dir` looks for)."""
    if overwrite and out.exists():  # everything but the lock this driver holds
        for path in out.iterdir():
            if path.name != LOCK_FILE:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    record = {"run": identity} if command is None else {"run": identity, "command": command}
    durable.replace_file(out / RUN_FILE, json.dumps(record, indent=2) + "\n")


COMPLETE_FILE = "complete.json"  # written when a run finished all its steps


def mark_complete(out: Path, *, identity: dict, step: int) -> None:
    durable.replace_file(out / COMPLETE_FILE, json.dumps({"step": step, "run": identity}, indent=2) + "\n")


def completed_step(out: Path) -> int | None:
    """The step the run in `out` finished at, or None when it has not finished (the door,
    `door_problem`, has said whose run it is)."""
    try:
        done = json.loads((out / COMPLETE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(done, dict):
        return None
    step = done.get("step")
    return step if isinstance(step, int) else None
