"""The imports between dflash_cli's folders, with the layer of each end, and any import cycles.

    python benchmarks/import_layers.py

One line per (folder, folder) pair that imports, lowest importer first: layers, how many imports, and
"UP" where an import runs back up. Reads the sources with `ast` (nothing is imported, no torch); the
parsing and the layer table are tests/test_import_layers.py's, which asserts what this prints.
Exits 1 if an import runs up or anything imports in a circle.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_checks():
    spec = importlib.util.spec_from_file_location("test_import_layers", ROOT / "tests" / "test_import_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    checks = load_checks()
    edges = checks.edges()
    layers = checks.LAYERS
    by_unit = checks.unit_edges(edges)
    print(f"{len(checks.modules())} modules, {len(edges)} imports between them, {len(by_unit)} between folders")
    order = sorted(by_unit, key=lambda e: (layers.get(e[0], 99), e[0], -layers.get(e[1], 99), e[1]))
    for src, dst in order:
        ls, ld = layers.get(src, "?"), layers.get(dst, "?")
        flag = "  UP" if isinstance(ls, int) and isinstance(ld, int) and ld > ls else ""
        print(f"  {src:>12} ({ls:>2}) -> {dst:<12} ({ld:>2})  x{len(by_unit[src, dst])}{flag}")
    problems = {
        "folders/modules missing from LAYERS": checks.unknown_units(edges),
        "imports that run back up": checks.upward(edges),
        "cycles between folders": checks.unit_cycles(edges),
        "cycles between modules": checks.module_cycles(edges),
    }
    for title, found in problems.items():
        print(f"{title}: {len(found) or 'none'}")
        for line in found:
            print(f"  {line}")
    return 1 if any(problems.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
