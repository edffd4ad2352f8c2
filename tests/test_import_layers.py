"""The package's imports point downward and have no cycles (DESIGN §1, STYLE "no import cycles").

The layer order, lowest first. A module may import its own layer and the layers below it, never
one above; and no two modules may import each other, directly or through others. Imports under
``if TYPE_CHECKING:`` count too: a cycle of annotations is still a cycle of concepts.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dormant"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("dormant.memory",),  # never imports the engine
    ("dormant.errors",),
    ("dormant.distributed",),  # parallel_state: what layers import
    ("dormant.layers",),
    ("dormant.models",),
    ("dormant.core",),  # what crosses the driver/worker boundary
    ("dormant.worker", "dormant.vllm_weight_transfer"),  # the trainer's end of a refit group
    ("dormant.executors",),
    ("dormant.engine", "dormant", "dormant.vllm_compat"),  # the driver; the root re-exports it
    ("dormant.server",),
    ("dormant.cli", "dormant.__main__"),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """Every dormant module ``path`` imports (``from a import b`` counts ``a.b`` if it is a
    module, else ``a``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in known else node.module)
    return {name for name in found if name in known}


def layer_of(module: str) -> int:
    """The layer of the longest entry that is ``module`` or a package above it (the root
    ``dormant`` entry names only the root module itself)."""
    matches = [
        (len(entry), index)
        for index, entries in enumerate(LAYERS)
        for entry in entries
        if module == entry or (entry != "dormant" and module.startswith(entry + "."))
    ]
    assert matches, f"{module} is in no layer: add its package to LAYERS"
    return max(matches)[1]


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(paths)
    return {name: imported_modules(path, known) - {name} for name, path in paths.items()}


def test_nothing_imports_upward() -> None:
    upward = [
        f"{module} (layer {layer_of(module)}) imports {dep} (layer {layer_of(dep)})"
        for module, deps in import_graph().items()
        for dep in deps
        if layer_of(dep) > layer_of(module)
    ]
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_memory_layer_imports_nothing_else_of_dormant() -> None:
    outside = [
        f"{module} imports {dep}"
        for module, deps in import_graph().items()
        if module.startswith("dormant.memory")
        for dep in deps
        if not dep.startswith("dormant.memory")
    ]
    assert not outside, "\n".join(outside)
