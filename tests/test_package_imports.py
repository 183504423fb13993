"""The package's layering: no import cycle between its subpackages (function-local imports count),
and the CLI and the background workers stay free of MPI (and the CLI of torch)."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mpickpt"


def unit_of(module: str) -> str:
    """The subpackage (or top-level module) a dotted module name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imported_modules(path: Path) -> list[str]:
    """Every mpickpt module `path` imports, at any depth of the file (functions included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            base = node.module
            names += [base] if base != "mpickpt" else [f"mpickpt.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n == "mpickpt" or n.startswith("mpickpt.")]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> {unit it imports: [files that do]} over the whole package."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = unit_of(module_name(path))
        graph.setdefault(src, {})
        for target in imported_modules(path):
            dst = unit_of(target)
            if dst != src and target != "mpickpt":
                graph[src].setdefault(dst, []).append(str(path.relative_to(PACKAGE.parent)))
    return graph


def find_cycle(graph) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_between_subpackages():
    graph = unit_graph()
    assert {"store", "kinds", "engine", "incrcp", "recovery", "checkpoint"} <= set(graph)
    cycle = find_cycle(graph)
    if cycle:
        edges = [f"{a} -> {b} ({', '.join(sorted(set(graph[a][b])))})"
                 for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle between subpackages: " + "; ".join(edges))


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": []}, "b": {}, "c": {"a": [], "b": []}}) is None
    tree = imported_modules(Path(__file__))  # this file imports nothing of mpickpt
    assert tree == []


def test_format_layer_imports_no_policy_and_no_mpi():
    """store/ is the on-disk format: it depends on nothing that plans, trains or talks MPI."""
    graph = unit_graph()
    # _rows_cpu: the C kernel of the row gathers (no Python imports of its own); owned_names:
    # whether the process that made a temporary still runs (os only)
    assert set(graph["store"]) <= {"quant", "options", "_rows_cpu", "owned_names"}, \
        graph["store"]
    for path in PACKAGE.joinpath("store").rglob("*.py"):
        text = path.read_text()
        assert "mpi4py" not in text and "import torch" not in text, path
