"""The suite's tiers, and how each test gets its own without anyone marking it.

A test is marked by what it starts (markers registered in pytest.ini):

    cli    a command in a subprocess: `python -m mcore_dpo.train`, `python -m checkpoint_convert`, a
           script (tests/helpers/cli.py)
    ranks  torch.distributed ranks in processes of their own (tests/helpers/ranks.py,
           tests/helpers/megatron_ranks.py)
    ray    a Ray cluster: the session's (the `ray_cluster` fixture, tests/helpers/ray_runs.py) or one
           of its own
    slurm  SLURM daemons (tests/test_slurm.py, marked in the module)
    fast   none of these, and the two launching tests kept on purpose (`in_fast_tier`): one
           two-step in-process run at world size 1 and one two-rank gloo parity

How: every helper that starts something carries the kinds it starts (`@launches("cli")`). At
collection, conftest.py follows the code each test can run, its fixtures' code and its
parameters (names of functions of the test module and of tests.helpers, recursively, and names
imported inside functions) to the helpers it reaches, and marks the test with their kinds.
While a fast-tier test runs, conftest.py also watches for process starts: a test that starts
a process some other way fails and says to use the helpers, so the fast tier stays fast.
"""

from __future__ import annotations

import inspect
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from xml.etree import ElementTree

LAUNCH_KINDS = ("cli", "ranks", "ray", "slurm")
# At most this many tests launch and still run in the fast tier (`@pytest.mark.in_fast_tier`).
FAST_TIER_LAUNCHES = 2
# How many worker processes the fast tier and the whole suite run on (pytest-xdist), a test file
# per worker so that a module's fixtures are built once. A fast test keeps one core busy, so the
# fast tier runs one worker per core of the 2-core machines; a launching test's ranks fill the
# cores only part of the time (imports, Ray start-up, waits for a signal, a timeout or SLURM), so
# the whole suite runs a third worker in the gaps (tests/README.md has the figures).
FAST_WORKERS = 2
SUITE_WORKERS = 3
# How long each test file takes, in seconds on 2 cores (tests/helpers/file_seconds.json, recorded
# from a whole-suite run's junit XML: `python -m tests.helpers.tiers record JUNIT_XML`): the
# dearest files go to the workers first, so that no long file starts last while the other worker
# idles. A file not recorded yet is estimated from its tests' kinds.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
KIND_COST_S = {"slurm": 60.0, "cli": 25.0, "ray": 15.0, "ranks": 10.0}
FAST_COST_S = 0.2


def workers_for(*, markexpr: str, whole_suite: bool, numprocesses, collect_only: bool, in_worker: bool) -> int | None:
    """The workers a run goes on, or None to leave it as it is. `pytest -m fast` goes on
    FAST_WORKERS, the whole suite (no test paths given) on SUITE_WORKERS; anything else stays in one process: test
    paths or node ids given (one area, or a GPU check of scripts/gpu_checks.sh), `-n N` given
    (`-n 0`: one process), a collection only, or inside a worker. `numprocesses` is "absent"
    where pytest-xdist is not installed."""
    if not (markexpr == "fast" or whole_suite) or numprocesses is not None or collect_only or in_worker:
        return None
    return FAST_WORKERS if markexpr == "fast" else SUITE_WORKERS


def estimated_cost(kinds_per_test: list[set[str]]) -> float:
    """A file's cost from its tests: the dearest kind of each (KIND_COST_S), FAST_COST_S a fast one."""
    return sum(max((KIND_COST_S[k] for k in kinds if k in KIND_COST_S), default=FAST_COST_S)
               for kinds in kinds_per_test)


def dearest_files_first(files: list[str], kinds_per_test: list[set[str]], recorded: dict[str, float]) -> list[int]:
    """The order of the tests (indices) with their files (names like "test_x.py") by falling
    cost, the recorded seconds where there are some, else estimated_cost; each file's tests in
    their own order, files of equal cost in theirs."""
    by_file: dict[str, list[int]] = {}
    for index, name in enumerate(files):
        by_file.setdefault(name, []).append(index)

    def cost(name: str) -> float:
        return recorded[name] if name in recorded else estimated_cost([kinds_per_test[i] for i in by_file[name]])

    return [index for name in sorted(by_file, key=lambda name: -cost(name)) for index in by_file[name]]


def recorded_seconds() -> dict[str, float]:
    return json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}


def seconds_per_file(junit_xml: Path) -> dict[str, float]:
    """Each test file's total time (set-up, call and teardown) in a junit XML of a pytest run."""
    totals: dict[str, float] = {}
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")
        if len(name) >= 2 and name[0] == "tests" and name[1].startswith("test_"):
            key = f"{name[1]}.py"
            totals[key] = totals.get(key, 0.0) + float(case.get("time", 0.0))
    return {key: round(totals[key], 1) for key in sorted(totals, key=lambda key: -totals[key])}


def launches(*kinds: str) -> Callable:
    """Mark a helper as starting processes of these kinds."""
    assert kinds and set(kinds) <= set(LAUNCH_KINDS), kinds

    def mark(function: Callable) -> Callable:
        function.launches = tuple(kinds)
        return function

    return mark


def _is_ours(module_name: str | None) -> bool:
    """Code whose calls are followed: test modules, conftest and tests.helpers."""
    if not module_name:
        return False
    leaf = module_name.rsplit(".", 1)[-1]
    return module_name.startswith("tests.") or leaf.startswith("test_") or leaf == "conftest"


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _referenced(function: types.FunctionType) -> list[object]:
    """The objects the function's code can reach by name: its globals, attributes of modules it
    names (`cli.run_train`), modules it imports inside its body, and its closure."""
    names: list[str] = []
    for code in _code_objects(function.__code__):
        names.extend(code.co_names)
    found: list[object] = []
    modules: list[types.ModuleType] = []
    for name in names:
        value = function.__globals__.get(name)
        if value is None and name in sys.modules:  # `from tests.helpers.cli import run_train` in the body
            value = sys.modules[name]
        if isinstance(value, types.ModuleType):
            modules.append(value)
        elif value is not None:
            found.append(value)
    for module in modules:
        if _is_ours(module.__name__):
            found.extend(getattr(module, name) for name in names if hasattr(module, name))
    for cell in function.__closure__ or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return found


def kinds_reached(function: object, _seen: dict | None = None) -> set[str]:
    """The launch kinds of every tagged helper `function` can reach (module docstring)."""
    seen = {} if _seen is None else _seen
    function = inspect.unwrap(function) if callable(function) else function
    kinds = set(getattr(function, "launches", ()))
    if kinds or not isinstance(function, types.FunctionType) or not _is_ours(function.__module__):
        return kinds
    if id(function) in seen:
        return seen[id(function)]
    seen[id(function)] = kinds  # cycles end here
    for value in _referenced(function):
        if callable(value):
            kinds |= kinds_reached(value, seen)
    seen[id(function)] = kinds
    return kinds


def kinds_of_item(item, seen: dict) -> set[str]:
    """What a collected test starts: its own code, its fixtures' and its parameters'."""
    kinds = kinds_reached(item.function, seen)
    for name in item.fixturenames:
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):
            kinds |= kinds_reached(definition.func, seen)
    callspec = getattr(item, "callspec", None)
    for value in (callspec.params.values() if callspec else ()):
        if callable(value):
            kinds |= kinds_reached(value, seen)
    kinds |= {mark.name for mark in item.iter_markers() if mark.name in LAUNCH_KINDS}
    return kinds


if __name__ == "__main__":  # python -m tests.helpers.tiers record JUNIT_XML
    if sys.argv[1:2] != ["record"] or len(sys.argv) != 3:
        sys.exit("usage: python -m tests.helpers.tiers record JUNIT_XML")
    FILE_SECONDS.write_text(json.dumps(seconds_per_file(Path(sys.argv[2])), indent=1) + "\n")
    print(f"wrote {FILE_SECONDS}")
