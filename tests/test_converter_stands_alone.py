"""checkpoint_convert stands alone: it imports nothing from mcore_dpo (at any depth), runs its
commands in a process where mcore_dpo cannot be imported, and finds verify's Megatron runner
through an interface of its own (register_runner, the entry point group RUNNER_GROUP); no import
cycle between the modules of either package."""

from __future__ import annotations

import ast
import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_convert import verify as verify_lib
from checkpoint_convert.__main__ import main as convert
from checkpoint_convert.families.base import ConversionError
from tests.helpers.cli import REPO, command_env, run_python

PACKAGES = ("mcore_dpo", "checkpoint_convert")
NO_RUNNER_LINE = "error: " + verify_lib.NO_RUNNER

# `python -c NO_TRAINER [-m MODULE ARGS | --import-all]`: mcore_dpo and its submodules cannot be
# imported (a meta path finder ahead of every other raises ImportError for them); each attempt is
# appended to the file $NO_TRAINER_LOG. `-m` runs MODULE as `python -m MODULE ARGS` does;
# `--import-all` imports checkpoint_convert and every module under it and prints their names.
NO_TRAINER = textwrap.dedent("""
    import importlib, importlib.abc, os, pkgutil, runpy, sys

    class NoTrainer(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "mcore_dpo" or name.startswith("mcore_dpo."):
                with open(os.environ["NO_TRAINER_LOG"], "a") as log:
                    log.write(name + "\\n")
                raise ImportError(f"No module named {name!r} (mcore_dpo is absent here)", name=name)
            return None

    sys.meta_path.insert(0, NoTrainer())
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        import checkpoint_convert
        names = [info.name for info in pkgutil.walk_packages(checkpoint_convert.__path__, "checkpoint_convert.")]
        for name in names:
            importlib.import_module(name)
        assert not [m for m in sys.modules if m.split(".")[0] == "mcore_dpo"]
        print(" ".join(["checkpoint_convert", *names]))
""")


def _without_trainer(args: list[str], tmp_path: Path, *, pythonpath: tuple[Path, ...] = ()):
    """`python -c NO_TRAINER ARGS` from tmp_path, this checkout first on the path (after
    `pythonpath`); returns the finished process and the mcore_dpo imports it attempted."""
    log = tmp_path / "no_trainer.log"
    log.unlink(missing_ok=True)
    path = os.pathsep.join(str(p) for p in (*pythonpath, REPO, os.environ.get("PYTHONPATH")) if p)
    done = run_python(["-c", NO_TRAINER, *args], cwd=tmp_path, timeout=300,
                      env=command_env(PYTHONPATH=path, NO_TRAINER_LOG=str(log)))
    return done, (log.read_text().split() if log.exists() else [])


def _modules_on_disk(package: str) -> dict[str, Path]:
    """module name -> file of every module of `package` (a package is its __init__.py)."""
    out = {}
    for file in sorted((REPO / package).rglob("*.py")):
        parts = file.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return out


def test_the_converter_imports_and_converts_without_the_trainer(hf_llama, tmp_path):
    done, attempts = _without_trainer(["--import-all"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.split()) == sorted(_modules_on_disk("checkpoint_convert")), done.stdout
    assert attempts == []

    done, attempts = _without_trainer(["-m", "checkpoint_convert", "--help"], tmp_path)
    assert done.returncode == 0 and "hf-to-mcore" in done.stdout and "verify" in done.stdout, done.stderr[-3000:]
    assert attempts == []

    out = tmp_path / "m"
    done, attempts = _without_trainer(["-m", "checkpoint_convert", "hf-to-mcore", "--hf-dir", str(hf_llama),
                                       "--out", str(out), "--tp", "2", "--pp", "2"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert attempts == []
    # the same shards as this process (with mcore_dpo importable) writes
    assert convert(["hf-to-mcore", "--hf-dir", str(hf_llama), "--out", str(tmp_path / "here"), "--tp", "2",
                    "--pp", "2"]) == 0
    shards = sorted(p.relative_to(out) for p in out.rglob("model.safetensors"))
    assert len(shards) == 4
    for shard in shards:
        ours, theirs = load_file(str(out / shard)), load_file(str(tmp_path / "here" / shard))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), shard

    # verify needs the trainer's runner: one line says so, with no traceback
    done, _ = _without_trainer(["-m", "checkpoint_convert", "verify", "--hf-dir", str(hf_llama), "--mcore-dir",
                                str(out)], tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith(NO_RUNNER_LINE), line


FAKE_RUNNER = textwrap.dedent("""
    import json
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    def logits(mcore_dir, tokens, *, hf_config_dir):
        Path(__file__).with_name("called.json").write_text(json.dumps(
            {"mcore_dir": str(mcore_dir), "hf_config_dir": str(hf_config_dir), "tokens": list(tokens.shape)}))
        model = AutoModelForCausalLM.from_pretrained(str(hf_config_dir), dtype=torch.float32)
        with torch.no_grad():
            return model(input_ids=tokens).logits.float()
""")


def test_verify_finds_a_runner_through_its_entry_point_group(hf_llama, tmp_path):
    """An installed distribution (here a dist-info on PYTHONPATH) that names a runner in the group
    checkpoint_convert.megatron_runners is what `python -m checkpoint_convert verify` uses, in a
    process where mcore_dpo cannot be imported (the fake runner returns the HF model's own logits)."""
    site = tmp_path / "site"
    info = site / "fake_megatron_runner-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-megatron-runner\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{verify_lib.RUNNER_GROUP}]\nfake = fake_megatron_runner:logits\n")
    (site / "fake_megatron_runner.py").write_text(FAKE_RUNNER)
    assert convert(["hf-to-mcore", "--hf-dir", str(hf_llama), "--out", str(tmp_path / "m"), "--pp", "2"]) == 0

    done, _ = _without_trainer(["-m", "checkpoint_convert", "verify", "--hf-dir", str(hf_llama), "--mcore-dir",
                                str(tmp_path / "m"), "--seq-len", "8"], tmp_path, pythonpath=(site,))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("verify tp=1 pp=2: max |dlogit| 0.000e+00, argmax agreement 100.00%"), done.stdout
    called = json.loads((site / "called.json").read_text())
    assert called == {"mcore_dir": str((tmp_path / "m").resolve()), "hf_config_dir": str(Path(hf_llama).resolve()),
                      "tokens": [2, 8]}


def test_find_runner_takes_the_registered_one_then_an_entry_point_else_says_what_to_install(monkeypatch):
    class Entry:
        def __init__(self, name: str, value: str, loaded=None):
            self.name, self.value, self._loaded = name, value, loaded

        def load(self):
            if self._loaded is None:
                raise ImportError(f"No module named {self.value.split('.')[0]!r}")
            return self._loaded

    def runner(mcore_dir, tokens, *, hf_config_dir):
        raise AssertionError("not called here")

    def other(mcore_dir, tokens, *, hf_config_dir):
        raise AssertionError("not called here")

    found = {"group": None, "entries": []}

    def entry_points(*, group):
        found["group"] = group
        return found["entries"]

    monkeypatch.setattr(verify_lib, "entry_points", entry_points)
    monkeypatch.setattr(verify_lib, "_registered", None)
    with pytest.raises(ConversionError) as caught:
        verify_lib.find_runner()
    assert str(caught.value) == verify_lib.NO_RUNNER and found["group"] == "checkpoint_convert.megatron_runners"

    # metadata installed, package not importable: the one line says which entry point failed
    found["entries"] = [Entry("mcore_dpo", "mcore_dpo.tools.verify_runner:megatron_logits")]
    with pytest.raises(ConversionError) as caught:
        verify_lib.find_runner()
    assert str(caught.value).startswith(verify_lib.NO_RUNNER + " (could not import mcore_dpo.tools.verify_runner")
    assert "\n" not in str(caught.value)

    # the first entry point by name that loads
    found["entries"] = [Entry("z", "z:run", other), Entry("b", "b:run", runner), Entry("a", "a:run")]
    assert verify_lib.find_runner() is runner

    # a registered runner comes before any entry point; unregistering goes back to them
    assert verify_lib.register_runner(other) is None
    assert verify_lib.find_runner() is other
    assert verify_lib.register_runner(None) is other
    assert verify_lib.find_runner() is runner


def test_verify_without_a_runner_prints_one_line_after_checking_its_inputs(hf_llama, tmp_path, monkeypatch,
                                                                            capsys):
    monkeypatch.setattr(verify_lib, "entry_points", lambda *, group: [])
    monkeypatch.setattr(verify_lib, "_registered", None)
    assert convert(["hf-to-mcore", "--hf-dir", str(hf_llama), "--out", str(tmp_path / "m")]) == 0
    capsys.readouterr()
    assert convert(["verify", "--hf-dir", str(hf_llama), "--mcore-dir", str(tmp_path / "m")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == NO_RUNNER_LINE + "\n"
    # bad input is still named first
    assert convert(["verify", "--hf-dir", str(hf_llama), "--mcore-dir", str(tmp_path / "m"), "--seq-len", "0"]) == 2
    assert "--seq-len must be in" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# Imports, read from the source
# ---------------------------------------------------------------------------------------


def _imports(module: str, file: Path, *, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute name) of every import statement in the file, at any depth (functions,
    classes, `if TYPE_CHECKING:` blocks), relative ones resolved; `from X import Y` gives X.Y."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), filename=str(file))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return found


def _module_of(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that importing `name` names: its longest prefix that is a module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_no_module_of_the_converter_imports_the_trainer():
    modules = _modules_on_disk("checkpoint_convert")
    assert len(modules) > 10
    found = [f"{file.relative_to(REPO)}:{line} imports {name}"
             for module, file in modules.items()
             for line, name in _imports(module, file, is_package=file.name == "__init__.py")
             if name.split(".")[0] == "mcore_dpo"]
    assert found == [], "\n".join(found)


def _import_graph() -> dict[str, set[str]]:
    """module -> the modules of PACKAGES its import statements name (any depth)."""
    modules = {name: file for package in PACKAGES for name, file in _modules_on_disk(package).items()}
    graph = {}
    for module, file in modules.items():
        targets = {_module_of(name, modules) for _, name in _imports(module, file, is_package=file.name == "__init__.py")}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as [a, b, ..., a], or None (depth-first search, colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_names_a_cycle():
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_between_modules_or_packages():
    graph = _import_graph()
    assert {"checkpoint_convert.io", "checkpoint_convert.torch_dist", "mcore_dpo.driver.run"} <= graph.keys()
    assert "checkpoint_convert.io" in graph["checkpoint_convert.torch_dist"]  # edges are found
    cycle = _a_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    packages = {p: {t.split(".")[0] for m, ts in graph.items() if m.split(".")[0] == p for t in ts} - {p}
                for p in PACKAGES}
    cycle = _a_cycle(packages)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)
