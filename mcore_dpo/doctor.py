"""What is installed, against what this project supports: `python -m mcore_dpo.doctor`.

One line per item: Python, torch (with its CUDA and NCCL), megatron-core, Transformer Engine,
apex, ray, transformers and the other requirements, and the GPUs with their memory.

    ok     within the tested range
    WARN   outside the tested range but expected to run, or a missing optional GPU speed-up
    ERROR  would break a run: a required package missing or not importable, Python older than
           3.10, torch or megatron-core older than the oldest supported release (the calls the
           project makes need at least those), or a GPU with a torch that has no NCCL
    info   facts (versions of CUDA and NCCL, the GPUs); `-` marks a GPU-only item on a CPU machine

Exits 1 when any line is an ERROR, else 0. The ranges are setup.py's (a test keeps them equal).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
import platform as _py_platform
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

PYTHON_RANGE = ">=3.10,<3.13"
# distribution -> (supported range, module to import). The same ranges as setup.py's install_requires.
REQUIRED: dict[str, tuple[str, str]] = {
    "torch": (">=2.13.0,<2.16", "torch"),
    "megatron-core": (">=0.16.1,<0.20", "megatron.core"),
    "ray": (">=2.50,<2.61", "ray"),
    "transformers": (">=5.20,<5.25", "transformers"),
    "safetensors": (">=0.8,<0.9", "safetensors"),
    "datasets": (">=5.2,<5.3", "datasets"),
    "pyyaml": (">=6.0,<7", "yaml"),
    "tensorboard": (">=2.21,<2.22", "tensorboard"),
    "matplotlib": (">=3.10,<3.12", "matplotlib"),
    "packaging": (">=24.2", "packaging"),
    "xxhash": (">=3", "xxhash"),
    "numpy": (">=1.26", "numpy"),
}
# Imported to check they load (a container's torch or megatron-core can be built against another
# CUDA); the rest are only looked up, which keeps the report to a few seconds.
IMPORT_CHECKED = frozenset({"torch", "megatron-core", "transformers", "ray", "safetensors", "pyyaml"})
# The model code calls these two by API; older releases lack what it calls.
BREAKS_BELOW_MINIMUM = frozenset({"torch", "megatron-core"})
# A run without these still works (TensorBoard events are skipped, with a note).
OPTIONAL_AT_RUN_TIME = frozenset({"tensorboard"})
TRANSFORMER_ENGINE_RANGE = ">=2.20,<2.21"  # setup.py's "gpu" extra


@dataclass(frozen=True)
class Line:
    status: str  # "ok", "WARN", "ERROR", "info", "-"
    name: str
    text: str

    def render(self) -> str:
        return f"{self.status:<6} {self.name:<18} {self.text}"


def installed_version(distribution: str, module: str) -> str | None:
    """The installed version: the distribution's metadata, else the module's __version__ (a
    source checkout on PYTHONPATH, as some containers ship megatron-core). None if absent."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return None
    try:
        with _quiet():
            return str(getattr(importlib.import_module(module), "__version__"))
    except Exception:
        return None


def import_error(module: str) -> str | None:
    """None when the module imports, else the error in one line."""
    try:
        with _quiet():
            importlib.import_module(module)
    except Exception as error:  # any failure here is what a run would hit first
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
    return None


@contextlib.contextmanager
def _quiet():
    """Keep import-time warnings and log lines out of the report (megatron-core warns when TE
    and apex are absent; torch logs that it found no CUDA runtime)."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def range_line(name: str, version: str, spec: str, *, breaks_below: bool) -> Line:
    """ok inside the range; above it WARN; below it ERROR when `breaks_below`, else WARN."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return Line("WARN", name, f"{version}: not a version number; supported {spec}")
    specifiers = SpecifierSet(spec)
    if parsed in specifiers or Version(parsed.base_version) in specifiers:
        return Line("ok", name, f"{version} (supported {spec})")
    minimum = next((Version(s.version) for s in specifiers if s.operator in (">=", ">")), None)
    if minimum is not None and parsed < minimum:
        status = "ERROR" if breaks_below else "WARN"
        return Line(status, name, f"{version} is older than supported ({spec})")
    return Line("WARN", name, f"{version} is newer than tested ({spec}); scripts/compat_check.sh tests a new release")


def check_python(version: str) -> Line:
    return range_line("python", version, PYTHON_RANGE, breaks_below=True)


def check_required(version_of: Callable[[str, str], str | None], import_check: Callable[[str], str | None]) -> list[Line]:
    lines = []
    for distribution, (spec, module) in REQUIRED.items():
        version = version_of(distribution, module)
        missing_status = "WARN" if distribution in OPTIONAL_AT_RUN_TIME else "ERROR"
        if version is None:
            lines.append(Line(missing_status, distribution, f"not installed (supported {spec})"))
            continue
        error = import_check(module) if distribution in IMPORT_CHECKED else None
        if error is not None:
            lines.append(Line(missing_status, distribution, f"{version} does not import: {error}"))
            continue
        lines.append(range_line(distribution, version, spec, breaks_below=distribution in BREAKS_BELOW_MINIMUM))
    return lines


def check_accelerator() -> list[Line]:
    """CUDA, NCCL and the GPUs as torch sees them."""
    import torch

    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        return [Line("info", "gpus", f"none visible (torch is {built}): runs use the CPU and gloo")]
    lines = [Line("info", "cuda", f"{torch.version.cuda} (torch build)")]
    if torch.distributed.is_available() and torch.distributed.is_nccl_available():
        nccl = torch.cuda.nccl.version()
        lines.append(Line("info", "nccl", ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)))
    else:
        lines.append(Line("ERROR", "nccl", "torch has no NCCL: multi-GPU runs cannot start"))
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gib = props.total_memory / 2**30
        lines.append(Line("info", f"gpu{index}", f"{props.name}, {gib:.1f} GiB, compute capability {props.major}.{props.minor}"))
    return lines


def check_speedups(*, on_gpu: bool, version_of: Callable[[str, str], str | None]) -> list[Line]:
    """Transformer Engine and apex's fused kernels: optional; WARN on a GPU when missing."""
    absent = "WARN" if on_gpu else "-"
    lines = []
    te = version_of("transformer-engine", "transformer_engine")
    if te is None:
        te = version_of("transformer_engine", "transformer_engine")
    if te is None:
        lines.append(Line(absent, "transformer-engine", 'not installed (optional GPU speed-up: pip install -e ".[gpu]")'))
    elif on_gpu and (error := import_error("transformer_engine.pytorch")) is not None:
        lines.append(Line("WARN", "transformer-engine", f"{te} does not import ({error}); runs use the local layers"))
    else:
        lines.append(range_line("transformer-engine", te, TRANSFORMER_ENGINE_RANGE, breaks_below=False))
    if importlib.util.find_spec("apex") is None:
        lines.append(Line(absent, "apex", "not installed (optional fused kernels; NVIDIA apex, built from source)"))
    elif importlib.util.find_spec("apex.normalization") is None:
        lines.append(Line("WARN", "apex", "this `apex` is not NVIDIA apex (the unrelated PyPI package?)"))
    else:
        kernels = [m for m in ("fused_layer_norm_cuda", "amp_C") if importlib.util.find_spec(m) is None]
        if kernels:
            lines.append(Line(absent, "apex", f"installed without its fused kernels ({', '.join(kernels)} missing)"))
        else:
            lines.append(Line("ok", "apex", "NVIDIA apex with fused kernels (fused_layer_norm_cuda, amp_C)"))
    return lines


def diagnose(
    *,
    python_version: str | None = None,
    version_of: Callable[[str, str], str | None] | None = None,
    import_check: Callable[[str], str | None] | None = None,
) -> list[Line]:
    """Every line of the report, in order. The arguments replace what is looked up (for tests)."""
    version_of = version_of or installed_version
    import_check = import_check or import_error
    lines = [check_python(python_version or _py_platform.python_version())]
    lines += check_required(version_of, import_check)
    torch_usable = not any(l.name == "torch" and l.status == "ERROR" for l in lines)
    on_gpu = False
    if torch_usable:
        accel = check_accelerator()
        on_gpu = any(l.name.startswith("gpu") and l.name != "gpus" for l in accel)
        lines += accel
    lines += check_speedups(on_gpu=on_gpu, version_of=version_of)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcore_dpo.doctor", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    lines = diagnose()
    for line in lines:
        print(line.render())
    errors = sum(l.status == "ERROR" for l in lines)
    warnings = sum(l.status == "WARN" for l in lines)
    print(f"doctor: {errors} error(s), {warnings} warning(s)" + (" - a run would fail" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
