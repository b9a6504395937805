"""The folders of mcore_dpo (driver, rank, pipeline, objective, data, model, parallel, optim,
checkpoint, tools) depend on each other one way: no two import each other, at any depth of
the import (a module-level or a function-level import both count). The top-level modules
(config.py, hooks.py, io_errors.py, ...) are the shared layer every folder may use."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mcore_dpo"


def _folder_imports() -> dict[str, dict[str, set[str]]]:
    """folder -> folder it imports -> the files that do."""
    edges: dict[str, dict[str, set[str]]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) < 2:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                names = module.split(".")
                if names[0] == "mcore_dpo" and len(names) > 2 and (PACKAGE / names[1]).is_dir() \
                        and names[1] != parts[0]:
                    edges.setdefault(parts[0], {}).setdefault(names[1], set()).add(str(path.relative_to(PACKAGE)))
    return edges


def _cycles(edges: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Every cycle of the folder graph, each as the list of its folders (found by depth-first search)."""
    found, seen = [], set()

    def visit(node: str, trail: list[str]) -> None:
        for target in sorted(edges.get(node, {})):
            if target in trail:
                cycle = trail[trail.index(target):]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    found.append(cycle + [target])
            else:
                visit(target, trail + [target])

    for start in sorted(edges):
        visit(start, [start])
    return found


def test_no_two_folders_import_each_other():
    edges = _folder_imports()
    assert {"pipeline", "objective", "data"} <= set(edges["rank"])  # the scan sees the package
    cycles = _cycles(edges)
    described = ["; ".join(f"{a} -> {b} ({', '.join(sorted(edges[a][b]))})" for a, b in zip(c, c[1:])) for c in cycles]
    assert not cycles, "\n".join(described)


def test_the_cycle_finder_finds_a_cycle():
    edges = {"a": {"b": {"a/x.py"}}, "b": {"c": {"b/y.py"}}, "c": {"a": {"c/z.py"}}, "d": {"a": {"d/w.py"}}}
    assert _cycles(edges) == [["a", "b", "c", "a"]]
