"""The driver's output: a closed stdout never ends a run, and the run log also goes to OUTPUT/.

- `install()` (the command line calls it first) makes sys.stdout and sys.stderr survive their
  reader going away: `| tee log` killed by the same Ctrl-C, `| head`, a terminal that hung up
  under a driver that outlives the hang-up (nohup; EIO). The first write that fails with EPIPE
  or EIO points the file descriptor at /dev/null, so that this write, the text still buffered,
  and every later write (the driver's lines, the workers' lines Ray prints here, Ray's own
  logging on the same descriptor) succeed; other errors still raise.
- `RunLog` is the driver's `log`: each line is shown as before and appended to
  OUTPUT/train.log once the run directory is known (the lines logged before are written first).
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path

LOG_FILE = "train.log"
_GONE = (errno.EPIPE, errno.EIO)  # the reader or the terminal went away


class _Survivor:
    """A text stream whose writes outlive the stream's reader."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            self._gone(error)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            self._gone(error)

    def _gone(self, error: OSError) -> None:
        if error.errno not in _GONE:
            raise error
        try:
            fd = self._stream.fileno()
        except (OSError, ValueError):  # a stream without a descriptor: replace the stream itself
            self._stream = open(os.devnull, "w", encoding="utf-8")
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)
        try:
            self._stream.flush()  # what the failed write left buffered goes to /dev/null now
        except OSError:
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def install() -> None:
    """Wrap sys.stdout and sys.stderr (once) so that a reader going away never raises."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Survivor):
            setattr(sys, name, _Survivor(stream))


class RunLog:
    """`log(line)`: show the line (`show`, print by default) and append it to the run's log
    file; `log.note(line)`: the file only (the progress bar, lines shown elsewhere)."""

    def __init__(self, show: Callable[[str], object] = print):
        self._show = show
        self._path: Path | None = None
        self._early: list[str] = []

    def __call__(self, line: str) -> None:
        self._show(line)
        sys.stdout.flush()  # a line at a time, also into a pipe
        self.note(line)

    def note(self, line: str) -> None:
        if self._path is None:
            self._early.append(line)
            return
        with open(self._path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")

    def open(self, out_dir: Path) -> None:
        """From now on lines go to OUT/train.log (appended: a resumed run adds to it)."""
        self._path = Path(out_dir) / LOG_FILE
        early, self._early = self._early, []
        for line in early:
            self.note(line)
