"""Fault injection for the reliability tests, loaded at start-up by every Python process whose
PYTHONPATH holds this directory (tests/helpers/faults.py puts it there for the runs that need it, and
Ray's worker processes inherit it). It fills mcore_dpo's hook points from MCORE_DPO_FAULT:

    "step:3,7"  kills rank 0's process at the start of steps 3 and 7
    "save:4"    kills rank 0's process in the middle of the step-4 checkpoint write
    "hang:2"    makes rank 0 stop responding at the start of step 2 (its peers time out)
    "say:1,2"   makes rank 0 print a line to its stdout and one to its stderr at the start of
                steps 1 and 2 (Ray shows them on the driver's stdout and stderr)
    "pace:2"    makes rank 0 sleep 2 s at the start of every step: a long run that waits for a
                signal keeps the cores mostly free for the other tests meanwhile

Each fault but pace fires once per run directory (a marker file remembers it).

MCORE_DPO_IO_FAULT="ENOSPC:/\.hf\.tmp-" makes every opening for writing (and every mkdir) of a
path in which the regular expression after the colon is found fail with that errno, as a full disk (ENOSPC), a
read-only file system (EROFS) or a denied permission (EACCES) would: root, which the tests run
as, is never denied by file modes. Several faults are separated by ";".

MCORE_DPO_GROUPED_STANDIN=1 installs grouped_standin.py: MoE runs on the CPU get a
stand-in for megatron-core's grouped GEMM experts (TEGroupedMLP's parameter names).
"""

import os


def _install(spec: str) -> None:
    import time
    from pathlib import Path

    from mcore_dpo import hooks

    kind, _, steps = spec.partition(":")
    if kind == "pace":
        def pace(*, step: int, rank: int, output_dir: str) -> None:
            if rank == 0:
                time.sleep(float(steps))

        hooks.register("train_step", pace)
        return
    point = {"step": "train_step", "hang": "train_step", "say": "train_step", "save": "save_checkpoint"}[kind]

    def fault(*, step: int, rank: int, output_dir: str) -> None:
        if rank != 0 or str(step) not in steps.split(","):
            return
        marker = Path(output_dir) / f".fault-{kind}-{step}"
        if marker.exists():
            return
        marker.write_text("fired\n")
        if kind == "say":
            import sys

            print(f"fault hook: rank 0 at step {step} on stdout", flush=True)
            print(f"fault hook: rank 0 at step {step} on stderr", file=sys.stderr, flush=True)
            return
        if kind == "hang":
            time.sleep(3600)
        if kind == "save":
            time.sleep(0.5)  # let the other ranks get into their writes
        os._exit(9)

    hooks.register(point, fault)


if os.environ.get("MCORE_DPO_FAULT"):
    try:
        _install(os.environ["MCORE_DPO_FAULT"])
    except ImportError:  # a helper process of Ray's without the project on its path
        pass

def _install_io_fault(spec: str) -> None:
    import builtins
    import errno
    import io
    import re

    rules = []
    for part in spec.split(";"):
        name, _, fragment = part.partition(":")
        rules.append((getattr(errno, name.rstrip("!")), re.compile(fragment), not name.endswith("!")))

    def check(path) -> None:
        try:
            text = os.fsdecode(os.fspath(path))
        except TypeError:  # a file descriptor
            return
        for code, pattern, named in rules:
            if pattern.search(text):
                raise OSError(code, os.strerror(code), *([text] if named else []))

    real_open, real_os_open, real_mkdir = io.open, os.open, os.mkdir

    def fault_open(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            check(file)
        return real_open(file, mode, *args, **kwargs)

    def fault_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            check(path)
        return real_os_open(path, flags, *args, **kwargs)

    def fault_mkdir(path, *args, **kwargs):
        check(path)
        return real_mkdir(path, *args, **kwargs)

    builtins.open = io.open = fault_open
    os.open, os.mkdir = fault_os_open, fault_mkdir


if os.environ.get("MCORE_DPO_IO_FAULT"):
    _install_io_fault(os.environ["MCORE_DPO_IO_FAULT"])

if os.environ.get("MCORE_DPO_GROUPED_STANDIN") == "1":
    # Before the worker imports build_stage_model by name (grouped_standin.py says what it does).
    try:
        from grouped_standin import install as _install_grouped_standin

        _install_grouped_standin()
    except ImportError:  # a helper process of Ray's without the project on its path
        pass
