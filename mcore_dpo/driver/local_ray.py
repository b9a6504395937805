"""What a local Ray cluster of the driver's leaves on the machine: its token, held in memory
(nothing under ~/.ray), and its temporary directory, swept once a killed driver left it.

`private_token` turns on Ray's token authentication for the cluster with a fresh token in the
environment, as ray_workers starts the head; `restore_env` undoes it when the cluster is gone.

A driver that ends normally removes its directory. After kill -9 the reaper
(mcore_dpo/driver/reaper.py) ends the cluster's processes, but nothing removes the directory, so
each driver sweeps, before it makes its own, the stale ones in the same parent:

- a directory made by `make_temp_dir()` holds OWNER_FILE (host, pid namespace, pid and start time of the
  driver that made it): it is stale when that process is gone (the pid is free, or now names a
  process started at another time). One recorded on another host or in another pid namespace is
  never judged from here;
- a directory without the record (made before the record existed) is stale when it is older than
  UNRECORDED_MIN_AGE_S and no live process names it on its command line (the cluster's
  `ray start --temp-dir=DIR`, its GCS server and its raylet all do while the cluster runs).

Only the directories of this user are looked at; without /proc (not Linux) nothing is swept.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import tempfile
from pathlib import Path

from mcore_dpo.driver import reaper

PREFIX = "mcore_dpo-ray-"
OWNER_FILE = "mcore_dpo_owner.json"
# Between mkdtemp and the record's write a directory has no record; nor has one of a cluster
# whose `ray start` has not yet begun. Younger than this, it is never taken for stale.
UNRECORDED_MIN_AGE_S = 600.0


def make_temp_dir() -> str:
    """A fresh private directory for a local cluster, with the record of its owner (this process)."""
    path = tempfile.mkdtemp(prefix=PREFIX)
    record = {"host": socket.gethostname(), "pid_namespace": _pid_namespace(), "pid": os.getpid(),
              "start_ticks": _start_ticks(os.getpid())}
    with open(os.path.join(path, OWNER_FILE), "w", encoding="utf-8") as fh:
        json.dump(record, fh)
    return path


def sweep_temp_dirs(parent: str | None = None) -> list[str]:
    """Remove the stale cluster directories in `parent` (the temporary directory by default);
    returns the paths removed."""
    if not os.path.isdir("/proc"):
        return []
    parent_dir = Path(parent or tempfile.gettempdir())
    try:
        candidates = [p for p in parent_dir.iterdir() if p.name.startswith(PREFIX)]
    except OSError:
        return []
    removed = []
    command_lines = None  # read once, only when a directory without a record needs it
    for path in candidates:
        try:
            info = path.lstat()
        except OSError:
            continue
        if not path.is_dir() or path.is_symlink() or info.st_uid != os.getuid():
            continue
        record = _read_record(path)
        if record is not None:
            stale = _owner_gone(record)
        else:
            if command_lines is None:
                command_lines = _command_lines()
            stale = _unrecorded_stale(path, mtime=info.st_mtime, command_lines=command_lines)
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(str(path))
    return removed


def _owner_gone(record: dict) -> bool:
    if record.get("host") != socket.gethostname() or record.get("pid_namespace") != _pid_namespace():
        return False  # its processes cannot be seen from here
    try:
        pid, start_ticks = int(record["pid"]), record.get("start_ticks")
    except (KeyError, TypeError, ValueError):
        return False
    if start_ticks is None:
        return False
    return _start_ticks(pid) != start_ticks  # None (gone) or a reused pid


def _unrecorded_stale(path: Path, *, mtime: float, command_lines: list[bytes]) -> bool:
    import time

    if time.time() - mtime < UNRECORDED_MIN_AGE_S:
        return False
    name = path.name.encode()  # by name: another process may spell the parent differently
    return not any(name in line for line in command_lines)


def _read_record(path: Path) -> dict | None:
    """The owner record, None when there is none; an unreadable one counts as a live owner."""
    record_path = path / OWNER_FILE
    if not record_path.exists():
        return None
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = {}
    return record if isinstance(record, dict) else {}


def _command_lines() -> list[bytes]:
    """The command line of every process visible now (NULs between the arguments)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as fh:
                    found.append(fh.read())
            except OSError:
                pass
    return found


def _start_ticks(pid: int) -> int | None:
    stat = reaper.stat(pid)
    return None if stat is None else stat[1]


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


_AUTH_MODE, _AUTH_TOKEN, _AUTH_TOKEN_PATH = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"


def private_token() -> dict:
    """Token authentication for the local cluster, as `ray.init()` turns it on for a new one (the
    cluster listens on every interface), with a fresh token of this run held in the environment
    (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN): `ray start`, its raylet and every worker inherit it, and
    this process, which connects to the head, reads it too. Unlike `ray.init()`, nothing is
    written to ~/.ray/auth_token and no warning is printed. A RAY_AUTH_MODE other than "token"
    is the user's choice and left alone, as is a token given in RAY_AUTH_TOKEN or
    RAY_AUTH_TOKEN_PATH. Releases without token authentication have nothing to set. Returns the
    variables' values before, for `restore_env`."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:
        return {}
    mode = os.environ.get(_AUTH_MODE)
    if mode is not None and mode.lower() != "token":
        return {}
    before = {name: os.environ.get(name) for name in (_AUTH_MODE, _AUTH_TOKEN)}
    os.environ[_AUTH_MODE] = "token"
    if not (os.environ.get(_AUTH_TOKEN) or os.environ.get(_AUTH_TOKEN_PATH)):
        os.environ[_AUTH_TOKEN] = secrets.token_hex(32)  # 256 bits, as Ray's own tokens
    Config.initialize("")  # Ray caches its configuration from the environment: read it again
    AuthenticationTokenLoader.instance().reset_cache()
    return before


def restore_env(before: dict | None) -> None:
    """Put back the variables `private_token` set, once the cluster is gone."""
    if not before:
        return
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
