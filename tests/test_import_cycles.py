"""No import cycles among tsterm's modules (DESIGN.md: dependencies point down).

What counts as an import, decided here:
- module-level and function-level imports alike: a lazy import is still a dependency, and importing upward inside a
  function only hides a layering inversion (`tsterm bench` used to import the CLI back this way);
- not the ones under `if TYPE_CHECKING:`, which never run (annotations only);
- an import names one module: `from tsterm.a import b` depends on `tsterm.a.b` when that module exists, else on
  `tsterm.a`. The enclosing packages that Python initialises on the way are not edges: a package's `__init__` may
  import its own submodules.
The top-level `kernels/` directory counts too, as the package `tsterm_kernels` it installs as.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"tsterm": ROOT / "tsterm", "tsterm_kernels": ROOT / "kernels"}


def find_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    type_only = {id(node) for block in ast.walk(tree)
                 if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                 for statement in block.body for node in ast.walk(statement)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    named = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x`, `from ..a import b`
                base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])])
            named.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    found = set()
    for target in named:
        while target and target not in modules:  # `import tsterm.x.Y` of a name inside a module: that module
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(component)
    return cycles


def test_the_cycle_finder_sees_a_function_level_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_tsterm_modules():
    modules = find_modules()
    assert "tsterm.cli" in modules and "tsterm_kernels.dispatch" in modules
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    cycles = [sorted(c) for c in import_cycles(graph)]
    assert not cycles, f"import cycles among tsterm modules: {cycles}"
