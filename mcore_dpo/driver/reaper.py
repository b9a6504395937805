"""The processes of a local Ray cluster end with the driver that started it, even after kill -9.

The driver starts its local Ray head (`ray start --head --block`) in a session of its own, so
that a signal to the driver's process group (Ctrl-C, `timeout`, `kill -TERM -PGID`) reaches the
driver alone; nothing then ties the head to the driver. The reaper is a small process the
driver starts right after the head, in a session of its own too (a group signal, kill -9 of the
group included, does not reach it). It records, every `POLL_S`, the process tree under the
head, and reads its stdin: a pipe from the driver. The pipe ends when the driver ends, however
it ends; the reaper then kills every recorded process that is still the same process (pid and
start time) and exits. A driver that shut Ray down itself says "done" first, and the reaper
exits without killing anything.

Linux only (/proc); elsewhere no reaper starts. It imports nothing of Ray or of this project.

    python reaper.py ROOT_PID [ROOT_PID ...]      # stdin: the pipe from the driver
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

POLL_S = 0.5


def stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of `pid`, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every process visible now."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            found_stat = stat(int(name))
            if found_stat is not None:
                found[int(name)] = found_stat
    return found


def tree(roots: set[int]) -> dict[int, int]:
    """pid -> start time of `roots` and all their descendants alive now."""
    procs = _processes()
    kids: dict[int, list[int]] = {}
    for pid, (parent, _) in procs.items():
        kids.setdefault(parent, []).append(pid)
    found, todo = {}, [r for r in roots if r in procs]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = procs[pid][1]
            todo.extend(kids.get(pid, []))
    return found


def in_session(sid: int) -> dict[int, int]:
    """pid -> start time of every process of session `sid` alive now (empty without /proc)."""
    found = {}
    if not os.path.isdir("/proc"):
        return found
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found[int(name)] = int(fields[19])
    return found


def kill(recorded: dict[int, int]) -> None:
    """SIGKILL each recorded process (pid -> start time) that is still that process."""
    for pid, start in recorded.items():
        now = stat(pid)
        if now is not None and now[1] == start:  # the same process, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def watch(roots: set[int], *, pipe) -> None:
    """Record the tree under `roots` until `pipe` says "done" (return) or ends (kill it all)."""
    recorded = tree(roots)
    while True:
        readable, _, _ = select.select([pipe], [], [], POLL_S)
        if readable:
            line = pipe.readline()
            if line.strip() == "done":
                return
            if not line:  # the driver is gone
                recorded.update(tree(set(recorded)))
                kill(recorded)
                return
        recorded = {pid: start for pid, start in recorded.items() if stat(pid) is not None}
        recorded.update(tree(roots | set(recorded)))


def start(*, roots: set[int]) -> subprocess.Popen | None:
    """Start a reaper for the processes under `roots` (None on a system without /proc)."""
    if not roots or not os.path.isdir("/proc"):
        return None
    return subprocess.Popen(
        [sys.executable, "-u", os.path.abspath(__file__), *map(str, sorted(roots))],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, close_fds=True, start_new_session=True,
    )


def release(reaper: subprocess.Popen | None) -> None:
    """The driver shut Ray down itself: the reaper exits without killing anything."""
    if reaper is None:
        return
    try:
        reaper.stdin.write("done\n")
        reaper.stdin.close()
    except OSError:
        pass
    try:
        reaper.wait(timeout=10)
    except subprocess.TimeoutExpired:
        reaper.kill()


if __name__ == "__main__":
    # SLURM signals every process of a job, whatever its session; the driver decides what they do.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch({int(a) for a in sys.argv[1:]}, pipe=sys.stdin)
