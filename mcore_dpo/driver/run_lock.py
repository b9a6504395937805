"""One run per output directory: the driver holds an exclusive lock on OUTPUT for its whole life.

    with RunLock(out, log=log):      # refused in one line while another driver holds OUTPUT
        ...train...

The lock is `flock(LOCK_EX | LOCK_NB)` on OUTPUT/.run.lock, a file that also records the
holder (host, PID, start time) for the refusal line. The kernel drops a flock when its process
ends, however it ends (kill -9 included), so a lock left by a dead driver is never in the way:
the next run takes it over and says whose it was. The file itself stays (an empty record after
a clean exit); `output_dir` ignores it when it asks whether a directory is empty.

Shared file systems: flock is coherent across nodes on NFSv4 and on Lustre mounted with
`-o flock`; there a second run on another node is refused like one on the same node. A file
system that refuses flock (ENOLCK, EOPNOTSUPP: Lustre with `-o noflock`, some NFSv3 set-ups)
falls back to the record alone: a record of a live process on this host, or of another host
(whose processes cannot be seen from here), refuses the run; remove OUTPUT/.run.lock by hand
once that run is known to be gone. Where flock is silently node-local (Lustre `-o localflock`),
two drivers on different nodes are not kept apart: use a distinct --output-dir per run there.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".run.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class LockHeld(ValueError):
    """Another live run holds the directory; str() is one line naming its host and PID."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _describe(record: dict) -> str:
    started = record.get("started")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else ""
    return f"host {record.get('host', '?')} PID {record.get('pid', '?')}{when}"


class RunLock:
    """Exclusive ownership of an output directory by one driver process (see the module)."""

    def __init__(self, out: str | Path, *, log=print):
        self.out = Path(out)
        self.path = self.out / LOCK_FILE
        self._log = log
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            previous = self._read(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockHeld(self._held_line(previous)) from None
            except OSError as error:
                if error.errno not in _UNSUPPORTED:
                    raise
                self._record_only(previous)  # no flock on this file system: the record decides
            if previous and previous.get("pid"):
                self._log(f"output_dir: taking over {self.path} from {_describe(previous)} (its process is gone)")
            record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
            self._write(fd, record)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Empty the record and drop the lock (the kernel drops it anyway when the process ends)."""
        if self._fd is None:
            return
        try:
            self._write(self._fd, {})
        except OSError:
            pass
        finally:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def _held_line(self, record: dict) -> str:
        holder = _describe(record) if record.get("pid") else "another process"
        return (f"output_dir: {self.out} is in use by another run ({holder}, lock {self.path}); one directory holds "
                "one run at a time: wait for it, stop it, or choose another --output-dir")

    def _record_only(self, record: dict) -> None:
        if not record.get("pid"):
            return
        here = record.get("host") == socket.gethostname()
        if here and not _pid_alive(int(record["pid"])):
            return
        note = "" if here else (f" (this file system refuses flock, so a run on another host cannot be checked; remove "
                                f"{self.path} once it is known to be gone)")
        raise LockHeld(self._held_line(record) + note)

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            text = os.read(fd, 4096).decode("utf-8", "replace")
            record = json.loads(text) if text.strip() else {}
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    @staticmethod
    def _write(fd: int, record: dict) -> None:
        data = (json.dumps(record) + "\n").encode() if record else b""
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
