"""No import circles in `operator/` or `runtime/` (issue 35): a module never needs, at import
time or for its types, a module that needs it back. Imports inside functions count too: a
deferred import hides a circle, it does not remove it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"ember_operator": ROOT / "operator", "ember_runtime": ROOT / "runtime"}


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, here: str, is_package: bool) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                package = here if is_package else here.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}
    return out


def graph() -> dict[str, set[str]]:
    modules: dict[str, tuple[Path, bool]] = {}
    for base in PACKAGES.values():
        for path in base.rglob("*.py"):
            if "api_pb2" in path.name:  # generated gRPC stubs
                continue
            modules[module_name(path, base)] = (path, path.name == "__init__.py")
    edges: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        targets = imported(ast.parse(path.read_text()), name, is_package)
        edges[name] = {t for t in targets if t in modules and t != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read() -> None:
    edges = graph()
    assert "ember_operator.handlers" in edges["ember_operator.__main__"] | {
        m for targets in edges.values() for m in targets
    }
    assert "ember_runtime.contract.config" in edges["ember_runtime.memory"]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_circle(package: str) -> None:
    circles = [c for c in cycles(graph()) if c[0].startswith(package)]
    assert circles == [], f"import circles: {circles}"
