"""`python -m mcore_dpo.doctor` in this environment and with simulated out-of-range versions;
setup.py's ranges and extras against the doctor's table and against what the code imports."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

from mcore_dpo import doctor
from tests.helpers.cli import REPO, command_env, run_python


def _setup_kwargs() -> dict:
    """The literal keyword arguments of setup(...) in setup.py."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords
            if kw.arg in ("python_requires", "install_requires", "extras_require")}


def _split(requirement: str) -> tuple[str, str]:
    name, spec = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*(.*)$", requirement).groups()
    return _norm(name), spec


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _fake_versions(**overrides: str | None):
    """version_of for diagnose(): the real installed versions, some replaced (None = absent)."""
    wanted = {_norm(k): v for k, v in overrides.items()}
    real = doctor.installed_version

    def version_of(distribution: str, module: str) -> str | None:
        if _norm(distribution) in wanted:
            return wanted[_norm(distribution)]
        return real(distribution, module)

    return version_of


def test_clean_environment_exits_0_with_every_item(tmp_path):
    result = run_python(["-m", "mcore_dpo.doctor"], cwd=tmp_path, env=command_env(PYTHONPATH=str(REPO)), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    by_name = {line.split()[1]: line.split()[0] for line in lines[:-1]}
    for name in ("python", "torch", "megatron-core", "ray", "transformers", "datasets", "safetensors"):
        assert by_name[name] == "ok", result.stdout
    assert "transformer-engine" in by_name and "apex" in by_name
    assert "gpus" in by_name or "gpu0" in by_name
    assert not any(status == "ERROR" for status in by_name.values())
    assert lines[-1].startswith("doctor: 0 error(s)")
    assert result.stderr == ""  # megatron-core's import warnings stay out of the report


def test_megatron_core_older_than_supported_is_an_error(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "installed_version", _fake_versions(**{"megatron-core": "0.15.3"}))
    monkeypatch.setattr(doctor, "import_error", lambda module: None)  # the subprocess test imports for real
    assert doctor.main([]) == 1
    out = capsys.readouterr().out.splitlines()
    errors = [line for line in out if line.startswith("ERROR")]
    assert errors == [doctor.Line("ERROR", "megatron-core", "0.15.3 is older than supported (>=0.16.1,<0.20)").render()]
    assert out[-1] == "doctor: 1 error(s), 0 warning(s) - a run would fail"


def test_newer_release_than_tested_is_a_warning_only(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "installed_version", _fake_versions(transformers="5.31.0", **{"megatron-core": "0.21.0rc1"}))
    monkeypatch.setattr(doctor, "import_error", lambda module: None)
    assert doctor.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    warned = sorted(line.split()[1] for line in out if line.startswith("WARN"))
    assert warned == ["megatron-core", "transformers"]
    assert out[-1] == "doctor: 0 error(s), 2 warning(s)"


def test_missing_or_broken_packages():
    lines = doctor.diagnose(version_of=_fake_versions(ray=None, tensorboard=None),
                            import_check=lambda m: "ImportError: libcudart.so.13" if m == "megatron.core" else None)
    status = {line.name: (line.status, line.text) for line in lines}
    assert status["ray"] == ("ERROR", "not installed (supported >=2.50,<2.61)")
    assert status["tensorboard"][0] == "WARN"  # a run skips its events and goes on
    assert status["megatron-core"][0] == "ERROR" and "does not import: ImportError: libcudart.so.13" in status["megatron-core"][1]


@pytest.mark.parametrize("version,status", [("3.9.18", "ERROR"), ("3.10.13", "ok"), ("3.11.7", "ok"), ("3.12.1", "ok"), ("3.13.0", "WARN")])
def test_python_version(version, status):
    assert doctor.check_python(version).status == status


def test_range_edges_and_local_versions():
    assert doctor.range_line("torch", "2.13.0+cpu", ">=2.13.0,<2.16", breaks_below=True).status == "ok"
    assert doctor.range_line("torch", "2.16.0a0+nv25.01", ">=2.13.0,<2.16", breaks_below=True).status == "WARN"
    assert doctor.range_line("torch", "2.12.1", ">=2.13.0,<2.16", breaks_below=True).status == "ERROR"
    assert doctor.range_line("ray", "2.49.2", ">=2.50,<2.61", breaks_below=False).status == "WARN"
    assert doctor.range_line("megatron-core", "0.19.0rc0", ">=0.16.1,<0.20", breaks_below=True).status == "ok"


def test_doctor_ranges_are_setup_py_ranges():
    kwargs = _setup_kwargs()
    assert kwargs["python_requires"] == doctor.PYTHON_RANGE
    setup_ranges = dict(_split(r) for r in kwargs["install_requires"])
    assert setup_ranges == {_norm(name): spec for name, (spec, _) in doctor.REQUIRED.items()}
    gpu = dict(_split(r) for r in kwargs["extras_require"]["gpu"])
    assert gpu["transformer-engine"] == doctor.TRANSFORMER_ENGINE_RANGE


def _third_party_imports(path: Path, *, module_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    local = {p.stem for p in (REPO / "tests").rglob("*.py")} | {"tests", "mcore_dpo", "checkpoint_convert", "benchmarks"}
    return {n for n in names if n not in sys.stdlib_module_names and n not in local}


def test_test_extra_holds_everything_the_suite_imports():
    kwargs = _setup_kwargs()
    declared = {_split(r)[0] for r in kwargs["install_requires"] + kwargs["extras_require"]["test"]}
    modules = set()
    for path in [*(REPO / "tests").rglob("*.py"), REPO / "scripts" / "compat_suite.py"]:  # tests/helpers too
        modules |= _third_party_imports(path, module_level_only=False)
    # The suite imports these packages' modules; only their module-level imports run.
    for package in ("mcore_dpo", "checkpoint_convert", "benchmarks"):
        for path in (REPO / package).glob("*.py"):
            modules |= _third_party_imports(path, module_level_only=True)
    owners = importlib.metadata.packages_distributions()
    undeclared = {m: owners.get(m) for m in modules if not {_norm(d) for d in owners.get(m, [m])} & declared}
    assert not undeclared, f"imported by the suite but not in install_requires or the test extra: {undeclared}"


def test_optional_integrations_are_not_needed_to_import_anything():
    """Every module of both packages and of benchmarks/ imports with wandb, peft, trl, Transformer
    Engine and apex made unimportable."""
    code = (
        "import importlib, pkgutil, sys\n"
        "for name in ('wandb', 'peft', 'trl', 'transformer_engine', 'apex'):\n"
        "    sys.modules[name] = None  # import raises ImportError\n"
        "import warnings; warnings.simplefilter('ignore')\n"
        "done = []\n"
        "for package in ('mcore_dpo', 'checkpoint_convert', 'benchmarks'):\n"
        "    pkg = importlib.import_module(package)\n"
        "    for info in pkgutil.iter_modules(pkg.__path__, package + '.'):\n"
        "        if not info.name.endswith('__main__'):\n"
        "            importlib.import_module(info.name); done.append(info.name)\n"
        "print(len(done), 'modules')\n"
    )
    result = run_python(["-c", code], env=command_env(PYTHONPATH=str(REPO)), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[0]) >= 20


def test_container_list_is_setup_py_without_the_container_stack():
    """scripts/container-requirements.txt: install_requires less torch and megatron-core."""
    lines = (REPO / "scripts" / "container-requirements.txt").read_text().splitlines()
    listed = dict(_split(line) for line in lines if line.strip() and not line.startswith("#"))
    required = dict(_split(r) for r in _setup_kwargs()["install_requires"])
    assert listed == {name: spec for name, spec in required.items() if name not in ("torch", "megatron-core")}


def test_cpu_platform_serves_megatron_cores_cuda_stream_calls():
    """megatron-core 0.19's DDP gradient sync waits on torch.cuda.current_stream(); on the CPU
    the platform's stand-in answers it (in a fresh process: the adaptation is process-wide).
    The same process: activating the CPU platform imports megatron-core without TorchInductor
    (its fused functions stay plain functions, its jit fuser is off), and torch.compile is
    torch's own again afterwards."""
    code = (
        "import sys, torch\n"
        "from mcore_dpo.parallel import platform\n"
        "compile_ = torch.compile\n"
        "f = lambda x: x\n"
        "assert platform._uncompiled(f) is f and platform._uncompiled(mode='default')(f) is f\n"
        "p = platform.detect()\n"
        "assert not p.is_cuda\n"
        "platform.activate(p)\n"
        "s = torch.cuda.current_stream()\n"
        "s.wait_event(None); s.wait_stream(s); s.synchronize()\n"
        "assert torch.cuda.current_device() == torch.device('cpu')\n"
        "assert 'megatron.core.jit' in sys.modules and torch.compile is compile_\n"
        "from megatron.core import jit\n"
        "from megatron.core.transformer.utils import gelu_impl\n"
        "from megatron.core.models.gpt import GPTModel\n"
        "assert jit.jit_fuser is jit.noop_decorator and type(gelu_impl).__name__ == 'function'\n"
        "assert not [m for m in sys.modules if m.startswith('torch._inductor')], 'TorchInductor was imported'\n"
        "print('ok')\n"
    )
    result = run_python(["-c", code], env=command_env(PYTHONPATH=str(REPO), MCORE_DPO_FORCE_CPU="1"), timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
