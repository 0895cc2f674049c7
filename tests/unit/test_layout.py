"""The package's layout rules, checked from the source: no import cycle at any level, one import path per
name, every module opens with a docstring, none is over 600 lines.

The import graph is read with ``ast``, so it holds every import an interpreter could run: module-level
ones, those inside functions and methods, and those under ``if TYPE_CHECKING``. An edge goes to the most
specific ``echo_p2p`` module an import names (``from echo_p2p.train import buffer`` -> ``echo_p2p.train.buffer``;
``from echo_p2p.train.buffer import ReplayBuffer`` -> ``echo_p2p.train.buffer``). Implicit imports of parent
packages are not edges: a package's ``__init__`` may import its own modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "echo_p2p"
MAX_LINES = 600
#: Cycles being taken apart elsewhere, tolerated until then (each with why). Any other cycle fails the test.
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, from ``__init__.py``)."""
    found: dict[str, Path] = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a module of the package (None if it is not ours)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                hit = _resolve(alias.name, modules)
                if hit:
                    targets.add(hit)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                drop = node.level - 1 if is_package else node.level
                base = base[: len(base) - drop] if drop else base
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                hit = _resolve(f"{source}.{alias.name}", modules)
                if hit:
                    targets.add(hit)
    targets.discard(module)
    return targets


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def visit(root: str) -> None:
        nonlocal counter
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(components)


def test_the_import_graph_has_no_cycle_at_any_level():
    cycles = [c for c in find_cycles(import_graph()) if tuple(c) not in KNOWN_CYCLES]
    assert cycles == [], "import cycles (function-level and TYPE_CHECKING imports count):\n" + "\n".join(
        " <-> ".join(component) for component in cycles
    )


def test_the_cycle_check_sees_function_level_and_type_checking_imports(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from echo_p2p.config import PeerConfig\n"
        "def f():\n    from echo_p2p.train import buffer\n    import echo_p2p.net.node\n"
    )
    path = tmp_path / "m.py"
    path.write_text(source)
    assert _imports("echo_p2p.x", path, _modules()) == {
        "echo_p2p.config",
        "echo_p2p.train.buffer",
        "echo_p2p.net.node",
    }


def _defined_names(path: Path) -> set[str]:
    """Names a module defines at its top level (classes, functions, assignments; under ``if``/``try`` too)."""
    names: set[str] = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
        elif isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + getattr(node, "handlers", []) + getattr(node, "finalbody", [])
        elif isinstance(node, ast.ExceptHandler):
            body += node.body
    return names


def test_every_name_is_imported_from_the_module_that_defines_it():
    """``from echo_p2p.X import N`` names the module that defines ``N`` (or ``N`` is a module of ``X``):
    one import path per name, no re-exports."""
    modules = _modules()
    defined = {name: _defined_names(path) for name, path in modules.items()}
    wrong = []
    for folder in (PACKAGE, "tests", "benchmarks", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom) or node.level or node.module not in modules:
                    continue
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in modules or alias.name in defined[node.module]:
                        continue
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name} from {node.module}")
    assert wrong == [], "names imported through a module that does not define them:\n" + "\n".join(wrong)


def test_every_module_opens_with_a_docstring_and_stays_under_the_line_limit():
    missing, long = [], []
    for name, path in _modules().items():
        if path.name.endswith("_pb2.py"):
            continue
        text = path.read_text()
        if ast.get_docstring(ast.parse(text)) is None and text.strip():
            missing.append(name)
        if text.count("\n") > MAX_LINES:
            long.append(name)
    assert missing == [], f"modules without a docstring: {missing}"
    assert long == [], f"modules over {MAX_LINES} lines: {long}"
