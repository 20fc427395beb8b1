"""The package's imports run downwards only, and nothing imports in a circle.

Every `import dflash_cli...` / `from dflash_cli... import` in a module counts, function-level (lazy) ones
included; those under `if TYPE_CHECKING:` do not. Modules are read with `ast`, never imported.
A unit is a folder (dflash_cli/backends/...) or a top-level module (dflash_cli/cache/store.py); a module may import
from units of its own layer or lower ones. benchmarks/import_layers.py prints the listing this checks.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_cli"
NAME = PACKAGE.name

# Lowest first. "__init__" is dflash_cli/__init__.py; a folder's own __init__.py belongs to the folder.
LAYERS = {
    "errors": 0,
    "host": 0,  # tool versions, ONNX Runtime's process-wide thread pool, this process's memory
    "checkpoints": 0,  # checkpoints on disk: locating, fingerprinting, lazy tensors, a multimodal text path
    "families": 0,  # one module per target family and their registry (recipe validates its `family` by it)
    "recipe": 0,  # the recipe schema and finding recipe files
    "cache": 0,  # the artifact store, its locks, integrity checks, upkeep and hashing
    "corpora": 0,  # the standard library's sources as text (the demo trains on them, readiness measures on them)
    "__init__": 0,
    "modeling": 1,
    "vision": 1,  # images into a prompt (the tower's feeds, M-RoPE positions) and each call's image inputs
    "demo": 1,  # demo may import modeling (not the reverse: the folder-cycle test)
    "pairing": 2,  # a target and draft as one pair; speculators drafts read as z-lab's
    "exporting": 3,
    "ortcompile": 4,
    "backends": 5,
    "qaic": 6,
    "stages": 7,  # the stages and the pipeline that runs them
    "readiness": 8,
    "decoding": 9,
    "bench": 10,
    "serve": 10,
    "cli": 11,
    "__main__": 11,
}


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package's name for its __init__.py)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def unit(module: str) -> str:
    """dflash_cli.backends.ort -> backends; dflash_cli.cache.store -> cache; dflash_cli -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _resolve(name: str, known: dict[str, Path]) -> str:
    """The module an import loads last: `dflash_cli.a.b.X` -> dflash_cli.a.b, or dflash_cli.a if b is a name."""
    parts = name.split(".")
    while len(parts) > 1 and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) if ".".join(parts) in known else name


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported package module, line) for each of the package's modules that `module` imports."""
    found: list[tuple[str, int]] = []
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((_resolve(alias.name, known), node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            # `from pkg import submodule` imports the submodule, `from pkg import name` the package
            found.extend((_resolve(f"{base}.{alias.name}", known), node.lineno) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return [(m, line) for m, line in found if m == NAME or m.startswith(NAME + ".")]


def edges(package: Path = PACKAGE) -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import between two different modules of the package."""
    known = modules(package)
    out = set()
    for module, path in known.items():
        for target, line in imports(module, path, known):
            if target != module:
                out.add((module, target, line))
    return sorted(out)


def unit_edges(module_edges) -> dict[tuple[str, str], list[str]]:
    """(unit, unit) -> the module imports behind it ("a.b:12 -> c.d"), for imports between different units."""
    out: dict[tuple[str, str], list[str]] = defaultdict(list)
    for src, dst, line in module_edges:
        if unit(src) != unit(dst):
            out[unit(src), unit(dst)].append(f"{src}:{line} -> {dst}")
    return dict(sorted(out.items()))


def unknown_units(module_edges) -> list[str]:
    found = {unit(m) for m in modules()} | {unit(d) for _, d, _ in module_edges}
    return sorted(found - LAYERS.keys())


def upward(module_edges) -> list[str]:
    """The imports that run back up: 'a.b:12 -> c.d (layer 3 -> 5)'."""
    return [
        f"{src}:{line} -> {dst} (layer {LAYERS[unit(src)]} -> {LAYERS[unit(dst)]})"
        for src, dst, line in module_edges
        if LAYERS.get(unit(dst), -1) > LAYERS.get(unit(src), -1)
    ]


def cycles(pairs) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted: every import cycle."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in pairs:
        if a != b:
            graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def unit_cycles(module_edges) -> list[str]:
    """Each cycle between units, named by the imports in it that do not run downwards (one must, to close it)."""
    by_unit = unit_edges(module_edges)
    out = []
    for component in cycles(by_unit):
        closing = [
            e
            for (a, b), es in by_unit.items()
            if a in component and b in component and LAYERS.get(b, -1) >= LAYERS.get(a, -1)
            for e in es
        ]
        out.append(" <-> ".join(component) + ", closed by: " + "; ".join(closing))
    return out


def module_cycles(module_edges) -> list[str]:
    """Each cycle between modules, with the imports inside it."""
    out = []
    for component in cycles((a, b) for a, b, _ in module_edges):
        members = set(component)
        inside = [f"{a}:{line} -> {b}" for a, b, line in module_edges if a in members and b in members]
        out.append(" <-> ".join(component) + ": " + "; ".join(inside))
    return out


def test_every_unit_has_a_layer():
    assert not unknown_units(edges()), "add these folders/modules to LAYERS: " + ", ".join(unknown_units(edges()))


def test_no_import_runs_back_up():
    bad = upward(edges())
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)


def test_no_cycle_between_folders():
    bad = unit_cycles(edges())
    assert not bad, "import cycles between folders/top-level modules:\n" + "\n".join(bad)


def test_no_cycle_between_modules():
    bad = module_cycles(edges())
    assert not bad, "import cycles between modules:\n" + "\n".join(bad)


def test_the_scan_sees_lazy_imports_and_skips_type_checking(tmp_path):
    pkg = tmp_path / NAME
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from dflash_cli.high import b\n"
        "def f():\n    from dflash_cli.high.b import X\n"
        "from . import c\n"
    )
    (pkg / "low" / "c.py").write_text("")
    (pkg / "high.py").write_text("from dflash_cli.low import a\n")
    assert edges(pkg) == [
        ("dflash_cli.high", "dflash_cli.low.a", 1),
        ("dflash_cli.low.a", "dflash_cli.high", 5),  # high.b is no module here: the import names high
        ("dflash_cli.low.a", "dflash_cli.low.c", 6),
    ]
    assert module_cycles(edges(pkg)) and unit_cycles(edges(pkg))
