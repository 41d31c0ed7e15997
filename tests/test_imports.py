"""The package's import graph has no cycle, counting imports inside functions too (a lazy import in a circle is
still a circle a reader must untangle), and imports written as calls with a literal name (`importlib.import_module`,
`__import__`), which hide a circle as well; and the engine's options live in one module."""

import ast
from collections.abc import Iterator
from pathlib import Path

import tokenmill

ROOT = Path(tokenmill.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def call_import(node: ast.Call) -> str | None:
    """The module an `importlib.import_module("a.b")`, `import_module("a.b")` or `__import__("a.b")` call names."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def imported(source: str) -> Iterator[str]:
    """Every name a module's source imports, anywhere in it: statements and calls with a literal name."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and (target := call_import(node)):
            yield target


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for t in imported(path.read_text()):
            if t in modules and t != name and not name.startswith(t + "."):  # a package's own __init__ aside
                graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_written_as_calls_are_edges():
    source = """
import importlib
from importlib import import_module

def lazy(name):
    importlib.import_module("tokenmill.parallel.worker")
    import_module("tokenmill.engine.core")
    __import__("tokenmill.config")
    importlib.import_module(name)  # not a literal: no edge
"""
    assert set(imported(source)) == {"importlib", "importlib.import_module", "tokenmill.parallel.worker",
                                     "tokenmill.engine.core", "tokenmill.config"}


def test_the_runner_does_not_reach_the_rank_launchers():
    """Launching ranks reaches the worker, which builds a runner: the runner must not reach back."""
    graph = import_graph()
    assert "tokenmill.parallel.worker" in graph["tokenmill.parallel.ray_executor"]
    seen, todo = set(), ["tokenmill.engine.runner"]
    while todo:
        if (m := todo.pop()) not in seen:
            seen.add(m)
            todo.extend(graph[m])
    launchers = {f"tokenmill.parallel.{m}" for m in ("executor", "ray_executor", "launch", "worker")}
    assert not seen & launchers


# Modules that import a package above their own, each a seam not yet cut: a proposer's hooks and the draft model's
# runner (spec/ builds on the engine's contracts, and the engine core builds the speculator), and a parallel rank's
# loop (it builds a runner as the engine core does).
UPWARD = {("tokenmill.spec.speculator", "tokenmill.engine"), ("tokenmill.spec.draft_model", "tokenmill.engine"),
          ("tokenmill.parallel.worker", "tokenmill.engine")}


def package(module: str) -> str:
    """The layer a module belongs to: its top-level package under tokenmill (or itself, a top-level module)."""
    return ".".join(module.split(".")[:2])


def test_packages_form_layers_but_for_three_known_upward_imports():
    """Between packages the imports run one way (no package imports one that imports it back, directly or round
    a circle) once the UPWARD imports are set aside; and there are at most three of those."""
    graph: dict[str, set[str]] = {}
    upward = set()
    for module, targets in import_graph().items():
        for target in targets:
            if package(module) == package(target):
                continue
            if (module, package(target)) in UPWARD:
                upward.add((module, package(target)))
                continue
            graph.setdefault(package(module), set()).add(package(target))
            graph.setdefault(package(target), set())
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
    assert upward == UPWARD and len(UPWARD) <= 3, upward
