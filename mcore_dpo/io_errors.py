"""I/O failures as one line naming the path, on the driver and on the ranks.

    with naming(directory):           # an OSError without a file name gets `directory`
        write_shards(directory)
    describe(error)                   # "/out/hf/model.safetensors: No space left on device [ENOSPC]"

Python's own `open` names the file in its OSError; other writers do not (os.write, a Rust
writer's error, a C extension), and a rank's "No space left on device" then says nowhere. The
line keeps the symbolic errno (ENOSPC, EROFS, ENOTDIR, EACCES) so that it can be searched for.
"""

from __future__ import annotations

import errno as errno_names
import os
from collections.abc import Iterator
from contextlib import contextmanager


def describe(error: OSError) -> str:
    """One line: the path(s), the system's words for the error and its errno name."""
    text = str(error).strip()
    words = error.strerror or (text.splitlines()[0] if text else type(error).__name__)
    code = f" [{errno_names.errorcode[error.errno]}]" if error.errno in errno_names.errorcode else ""
    if error.filename is None:
        return f"{words}{code}"
    where = os.fspath(error.filename)
    if error.filename2 is not None:
        where += f" -> {os.fspath(error.filename2)}"
    return f"{where}: {words}{code}"


def _errno_in(text: str) -> int | None:
    """The errno a wrapped writer's message carries ("... code: 28, kind: StorageFull ..." from
    safetensors' Rust writer, "[Errno 28] ..." from Python), or None."""
    for marker in ("code: ", "[Errno "):
        at = text.find(marker)
        if at >= 0:
            digits = "".join(ch for ch in text[at + len(marker):at + len(marker) + 6] if ch.isdigit())
            return int(digits) if digits else None
    return None


@contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Inside: an OSError that names no file is raised again naming `path`; a writer's error that
    carries an errno in its text (safetensors raises its own type) becomes that OSError."""
    try:
        yield
    except OSError as error:
        if error.filename is not None:
            raise
        raise OSError(error.errno, error.strerror or str(error), os.fspath(path)) from None
    except Exception as error:  # noqa: BLE001 - only writers' errors that carry an errno are translated
        code = _errno_in(str(error))
        if code is None or type(error).__name__ != "SafetensorError":
            raise
        raise OSError(code, os.strerror(code), os.fspath(path)) from None
