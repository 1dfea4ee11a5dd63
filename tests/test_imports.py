"""Dependencies between the modules of neuron_ckpt run one way: no import cycles.

A cycle imports only while every import in it stays where it is (one inside a function, or below
the names the other module needs); moving one breaks the package at import time, and the two
modules cannot be read or tested apart. The graph is read from the source with ``ast``: an edge
``a -> b`` for every ``import`` / ``from ... import`` in ``a`` naming module ``b`` of the package
(``from .p import x`` names ``p.x`` when that is a submodule, else ``p``; those under ``if
TYPE_CHECKING:`` are left out, as they never run). Two graphs:

* module level (what runs when a module is imported): the whole package;
* every import, function-level ones included (a function-level import is usually a cycle put
  off until call time): the modules under ``CHECKED``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import neuron_ckpt

ROOT = Path(neuron_ckpt.__file__).parent
CHECKED = ("neuron_ckpt",)
"""Packages whose cycles fail the function-level check (``("neuron_ckpt",)``: all of them)."""

Edges = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _type_only(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:``: imports for annotations only, which never run (two modules whose
    types name each other; each still imports, and is tested, without the other)."""
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(node: ast.AST, in_function: bool, function_level: bool):
    """The import statements under ``node``, skipping function bodies unless ``function_level``,
    and type-only blocks (:func:`_type_only`) always."""
    for child in ast.iter_child_nodes(node):
        if _type_only(child):
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
        if function_level or not inside:
            yield from _imports(child, inside, function_level)


def _targets(module: str, stmt: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(stmt, ast.Import):
        return {a.name for a in stmt.names if a.name in MODULES}
    package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    if stmt.level:
        base = ".".join(package[: len(package) - (stmt.level - 1)] + ([stmt.module] if stmt.module else []))
    else:
        base = stmt.module or ""
    if base not in MODULES:
        return set()
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in stmt.names}


def import_graph(function_level: bool) -> Edges:
    graph: Edges = {}
    for module, path in MODULES.items():
        edges = graph.setdefault(module, {})
        for stmt in _imports(ast.parse(path.read_text()), False, function_level):
            for target in _targets(module, stmt) - {module}:
                edges.setdefault(target, stmt.lineno)
    return graph


def cycles(graph: Edges) -> list[list[str]]:
    """Each strongly connected component of more than one module, as one cycle through it."""
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = set()
            while v not in component:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
            if len(component) > 1:
                found.append(_cycle_through(min(component), component, graph))

    for v in graph:
        if v not in order:
            visit(v)
    return sorted(found)


def _cycle_through(start: str, component: set[str], graph: Edges) -> list[str]:
    """A shortest path ``start -> ... -> start`` inside ``component`` (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    return paths[v] + [start]
                if w in component and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def describe(cycle: list[str], graph: Edges) -> str:
    """``a (line 3) -> b (line 211) -> a``: each module with the line importing the next."""
    hops = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(hops + [cycle[-1]])


def _checked(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in CHECKED)


def test_the_graph_sees_the_package():
    graph = import_graph(function_level=True)
    assert "neuron_ckpt.distributed.parallel_state" in graph["neuron_ckpt.distributed.collectives"]
    assert "neuron_ckpt.parallel.layer_args" in graph["neuron_ckpt.parallel.qkv"]
    assert "neuron_ckpt.distributed.teardown" in graph["neuron_ckpt.distributed.local"]  # inside _worker
    assert "neuron_ckpt.memory.budget" in graph["neuron_ckpt.memory.moe.model"]
    assert "neuron_ckpt.memory.moe.model" not in graph["neuron_ckpt.memory.budget"]  # under TYPE_CHECKING
    assert "neuron_ckpt.distributed.teardown" not in import_graph(function_level=False)["neuron_ckpt.distributed.local"]
    assert describe(["a", "b", "a"], {"a": {"b": 3}, "b": {"a": 7}}) == "a (line 3) -> b (line 7) -> a"
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}}) == [["a", "b", "c", "a"]]


def test_no_import_cycle_at_module_level():
    graph = import_graph(function_level=False)
    found = cycles(graph)
    assert not found, "import cycles at module level:\n" + "\n".join(describe(c, graph) for c in found)


def test_no_import_cycle_counting_function_level_imports():
    graph = import_graph(function_level=True)
    found = cycles(graph)
    failing = [c for c in found if any(_checked(m) for m in c)]
    assert not failing, (
        f"import cycles through {', '.join(CHECKED)}:\n"
        + "\n".join(describe(c, graph) for c in failing)
        + "\n(all cycles in the package:\n"
        + "\n".join(describe(c, graph) for c in found)
        + ")"
    )
