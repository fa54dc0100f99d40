"""The package's import graph from the source's AST: cycles and arrows that run back up the layers.

``python -m pcast_jax._dev.imports`` (in a source checkout) prints every cycle, every back-arrow and
every use of another module's ``_private`` name (:func:`private_uses`), and exits 1 if there is one.
Every import counts, at module level or inside a function (an import deferred into a function is
still an arrow); imports under ``if TYPE_CHECKING:`` do not, since they never run.

:data:`LAYERS` is the order ARCHITECTURE.md draws, top (imports nothing of ours) to bottom: a module
may import modules of its own layer or of layers above it, never below.
"""

from __future__ import annotations

import ast
import pathlib
import sys

#: Layers from the top (the number line) down (the command line). Each entry is a module or a package
#: prefix of ``pcast_jax`` (or ``pallas_kernels`` / ``pcast_experiments``); the longest prefix that
#: matches a module decides its layer. ``pcast_jax`` alone is the package's ``__init__`` (its public
#: names load lazily on first use, so it imports nothing of ours when it runs) and matches only itself.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("pcast_jax", "pcast_jax.errors", "pcast_jax._dev"),
    ("pcast_jax.numberline", "pcast_jax.stats", "pcast_jax.fileio", "pcast_jax.safetensors_files",
     "pcast_jax.quantities"),
    ("pcast_jax.formats",),
    ("pcast_jax.theory", "pcast_jax.knob", "pcast_jax.config"),
    ("pcast_jax.presets", "pcast_jax.deployment_table"),
    ("pcast_jax.block",),
    ("pcast_jax.implementations", "pcast_jax.engine", "pcast_jax.workloads", "pallas_kernels"),
    ("pcast_jax.nn", "pcast_jax.nn_common", "pcast_jax.metrics", "pcast_jax.cache", "pallas_kernels.machine_code"),
    ("pcast_jax.sweep", "pcast_jax.report", "pcast_jax.criterion"),
    ("pcast_jax.whatif", "pcast_jax.analysis", "pcast_jax.fingerprint", "pcast_jax.deployments", "pcast_jax.jax_fp8"),
    ("pcast_jax.models", "pcast_jax.testing"),
    ("pcast_jax.commands", "pcast_jax.cli"),
    ("pcast_experiments",),
)

_ROOTS = {"pcast_jax": "pcast_jax", "pallas_kernels": "pallas_kernels", "experiments": "pcast_experiments"}


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    rel = path.relative_to(root)
    parts = list(rel.with_suffix("").parts)
    parts[0] = _ROOTS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for sub in node.body:
                    skip.update(id(n) for n in ast.walk(sub))
    return skip


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module → the package modules it imports (every import that can run)."""
    files = [p for top in _ROOTS for p in sorted((root / top).rglob("*.py"))]
    modules = {_module_name(root, p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_nodes(tree)
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = (_resolve_relative(name, is_package, node.level, node.module) if node.level
                        else node.module or "")
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else base)
        graph[name] = {_owner(t, modules) for t in targets if _owner(t, modules)} - {name}
    return graph


def private_uses(root: pathlib.Path) -> list[tuple[str, int, str]]:
    """Uses of another module's ``_private`` name: ``(module, line, "owner._name")``, sorted.

    A name counts when it is imported (``from pcast_jax.x import _helper``) or read as an attribute of
    a module of ours (``engine._helper`` after ``from pcast_jax import engine``) by a module other than
    its own. Modules themselves are not names (``from pcast_jax.commands import _options`` is not
    reported), nor are dunders. A helper another module needs is public, in a ``*_common`` module or
    where it lives.
    """
    files = [p for top in _ROOTS for p in sorted((root / top).rglob("*.py"))]
    modules = {_module_name(root, p): p for p in files}
    found: set[tuple[str, int, str]] = set()

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        bound: dict[str, str] = {}  # local name -> module of ours it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in modules:
                        bound[alias.asname] = alias.name
                    elif not alias.asname:
                        top = alias.name.split(".")[0]
                        bound[top] = top
            elif isinstance(node, ast.ImportFrom):
                base = (_resolve_relative(name, is_package, node.level, node.module) if node.level
                        else node.module or "")
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:
                        bound[alias.asname or alias.name] = full
                    elif private(alias.name) and base in modules and base != name:
                        found.add((name, node.lineno, f"{base}.{alias.name}"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr):
                dotted, value = [], node.value
                while isinstance(value, ast.Attribute):
                    dotted.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in bound:
                    owner = ".".join([bound[value.id], *reversed(dotted)])
                    if owner in modules and owner != name and f"{owner}.{node.attr}" not in modules:
                        found.add((name, node.lineno, f"{owner}.{node.attr}"))
    return sorted(found)


def _owner(target: str, modules: dict[str, pathlib.Path]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def layer_of(module: str) -> int:
    """Index in :data:`LAYERS` of the longest prefix that matches ``module``."""
    best, best_len = -1, -1
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            nested = module.startswith(prefix + ".") and prefix != "pcast_jax"
            if (module == prefix or nested) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best < 0:
        raise ValueError(f"module {module} is in no layer of LAYERS")
    return best


def back_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of a module from a layer below its own, sorted."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def main() -> int:
    root = pathlib.Path(__file__).resolve().parents[2]
    graph = import_graph(root)
    found_cycles, arrows = cycles(graph), back_arrows(graph)
    for component in found_cycles:
        print("cycle:", " <-> ".join(component))
    for a, b in arrows:
        print(f"back-arrow: {a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})")
    privates = private_uses(root)
    for module, line, used in privates:
        print(f"private name: {module} (line {line}) uses {used}")
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports: "
          f"{len(found_cycles)} import cycles, {len(arrows)} back-arrows, {len(privates)} uses of another "
          "module's private names")
    return 1 if found_cycles or arrows or privates else 0


if __name__ == "__main__":
    raise SystemExit(main())
