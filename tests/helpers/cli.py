"""CLI runners: the only way tests start a command in a subprocess (tests/helpers/tiers.py
marks a test that reaches one of these `cli`; `run_train` and `start_train` also `ray`, as the
command starts a local Ray cluster of its own).

Each runs from the repository root with the caller's environment, OMP_NUM_THREADS=1 unless the
caller's `env` says otherwise, and captures text output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.tiers import launches

REPO = Path(__file__).resolve().parents[2]
TRAIN = [sys.executable, "-m", "mcore_dpo.train"]


def command_env(env: dict | None = None, **changes: str) -> dict:
    """The environment a command runs with: `env` (default: this process's), one torch thread
    unless `env` sets another, then `changes`."""
    out = dict(os.environ if env is None else env)
    out.setdefault("OMP_NUM_THREADS", "1")
    out.update(changes)
    return out


@launches("cli")
def run(argv: list[str], *, env: dict | None = None, cwd: Path = REPO, timeout: float = 600,
        check: bool = False) -> subprocess.CompletedProcess:
    """Run argv to the end; stdout and stderr captured as text."""
    return subprocess.run(argv, cwd=cwd, env=command_env(env), capture_output=True, text=True, timeout=timeout,
                          check=check)


@launches("cli")
def start(argv: list[str], *, env: dict | None = None, cwd: Path = REPO, stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, **popen) -> subprocess.Popen:
    """Start argv and return at once (the caller waits for it, or kills it); text pipes unless
    `popen` (more subprocess.Popen arguments: stdin, start_new_session, ...) says text=False."""
    return subprocess.Popen(argv, cwd=cwd, env=command_env(env), stdout=stdout, stderr=stderr, **{"text": True, **popen})


@launches("cli")
def run_python(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    """`python ARGS` with this interpreter: `-m module ...`, `-c code ...` or a script path."""
    return run([sys.executable, *args], **kwargs)


@launches("cli", "ray")
def run_train(args: list[str], *, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    """`python -m mcore_dpo.train ARGS`, the user's command line, to the end."""
    return run([*TRAIN, *args], timeout=timeout, **kwargs)


@launches("cli", "ray")
def start_train(args: list[str], **kwargs) -> subprocess.Popen:
    """`python -m mcore_dpo.train ARGS`, returning at once."""
    return start([*TRAIN, *args], **kwargs)


def train_input_error(capsys, argv: list[str]) -> str:
    """`python -m mcore_dpo.train argv` in this process, for input it must refuse: exit 2, one
    line on stderr and no traceback, no worker group started; returns the line."""
    import ray

    from mcore_dpo.train import main

    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not ray.is_initialized(), "a worker group was started before the input was checked"
    return err
