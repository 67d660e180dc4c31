"""The shape of ``src/tripath``: no import circle between its modules nor between its packages, layers that
import only downwards, the engine's and the server's subpackages each in one order, no module importing
another's private names, and no file over 450 lines. Every import counts, at module level or inside a
function, ``TYPE_CHECKING`` ones too."""

from __future__ import annotations

import ast
from pathlib import Path

import tripath

SRC = Path(tripath.__file__).resolve().parent
MAX_LINES = 450
# The layers, lowest first: a module imports only from its own layer or lower ones. The root modules
# (constants, platform, _env, the version) come first; the command comes last.
LAYERS = [("tripath",), ("triton_internals",), ("kernels",), ("ops",), ("attention",), ("models",), ("engine",),
          ("server",), ("portability", "bench"), ("cli",)]
# The server's subpackages, lowest first (each imports only the ones before it, and the engine).
SERVER_ORDER = [f"tripath.server.{part}" for part in ("metrics", "transport", "processes", "http")]
# The engine's subpackages, lowest first (each imports only the ones before it); the engine's own modules
# (tripath.engine: the LLM facade, and what its __init__.py re-exports) over them all.
ENGINE_ORDER = [f"tripath.engine.{part}" for part in ("requests", "config", "sampling", "speculative", "scheduling",
                                                      "runner", "drafters", "core")] + ["tripath.engine"]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = ("tripath", *path.relative_to(SRC).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imports(name: str):
    """``(imported module, names taken from it, line)`` of each import in module ``name``."""
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in MODULES:
                    yield sub, None, node.lineno
                elif node.module in MODULES:
                    yield node.module, alias.name, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name, None, node.lineno


GRAPH = {name: {target for target, _, _ in _imports(name)} - {name} for name in MODULES}


def _package(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_circle_between_modules():
    assert _cycles(GRAPH) == []


def _package_imports() -> dict[tuple[str, str], list[str]]:
    """``(package, package it imports)`` -> the module imports behind that arrow. A package is a folder of
    ``src/tripath`` (its ``__init__.py`` among its modules, so what it re-exports counts as its import)."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for a, targets in GRAPH.items():
        for b in targets:
            if _package(a) != _package(b):
                arrows.setdefault((_package(a), _package(b)), []).append(f"{a} imports {b}")
    return arrows


def test_no_import_circle_between_packages():
    """No package imports, through any chain of packages, one that imports it: each package of ``src`` (and
    each subpackage apart from its parent) sits above or below each other one. A parent package that
    re-exports its subpackages' names is above them, so they never import its own modules."""
    arrows = _package_imports()
    graph: dict[str, set[str]] = {_package(name): set() for name in MODULES}
    for a, b in arrows:
        graph[a].add(b)
    circles = []
    for component in _cycles(graph):
        inside = set(component)
        circles.append({f"{a} -> {b}": sorted(why) for (a, b), why in sorted(arrows.items())
                        if a in inside and b in inside})
    assert circles == []


def _layer(name: str) -> int:
    top = name.split(".")[1] if name.count(".") else "tripath"
    top = top if any(top in layer for layer in LAYERS) else "tripath"   # constants, platform, _env
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def test_layers_import_only_downwards():
    upward = [f"{a} imports {b}" for a, targets in GRAPH.items() for b in targets if _layer(b) > _layer(a)]
    assert upward == []


def _upward_imports(order: list[str]) -> list[str]:
    """The imports from a package of ``order`` (or one inside it) into a later one."""
    rank = {package: i for i, package in enumerate(order)}

    def place(package: str) -> str | None:   # the entry of ``order`` the package is or lies in (the longest)
        return max((p for p in order if package == p or package.startswith(p + ".")), key=len, default=None)

    wrong = []
    for a, targets in GRAPH.items():
        for b in targets:
            pa, pb = place(_package(a)), place(_package(b))
            if pa and pb and pa != pb and rank[pb] > rank[pa]:
                wrong.append(f"{a} imports {b}")
    return wrong


def test_the_server_subpackages_import_in_one_direction():
    """metrics <- transport <- processes <- http: the HTTP side over the processes, over the core's
    transport, over what the server tells its operators."""
    assert _upward_imports(SERVER_ORDER) == []


def test_the_engine_subpackages_import_in_one_direction():
    """requests <- config <- sampling <- speculative <- scheduling <- runner <- drafters <- core <- the
    engine's own modules: a request's vocabulary under the settings, under how tokens are drawn and drafts
    kept, under what a step takes, under what runs it, under the proposers that run a model of their own,
    under the core that drives them all, under the LLM facade."""
    assert _upward_imports(ENGINE_ORDER) == []


def test_no_module_imports_another_modules_private_names():
    """``from tripath.x import _name`` (other than a module, such as ``tripath._env``) and ``x._name`` on an
    imported tripath module are private access."""
    found = []
    for name in MODULES:
        aliases = {}
        for node in ast.walk(TREES[name]):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if sub in MODULES:
                        aliases[alias.asname or alias.name] = sub
                    elif alias.name.startswith("_") and not alias.name.startswith("__") and node.module != name:
                        found.append(f"{name}:{node.lineno} imports {node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in MODULES and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(TREES[name]):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in aliases and aliases[node.value.id] != name and \
                    node.attr.startswith("_") and not node.attr.startswith("__") and \
                    f"{aliases[node.value.id]}.{node.attr}" not in MODULES:
                found.append(f"{name}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}")
    assert found == []


def test_no_source_file_over_450_lines():
    sizes = {str(path.relative_to(SRC.parent)): path.read_text().count("\n") for path in MODULES.values()}
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}
