"""Only dflash_cli/cli/ may import typer: the library stays usable without the command line."""

from __future__ import annotations

import ast
from pathlib import Path

import dflash_cli

PACKAGE = Path(dflash_cli.__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_no_typer_below_cli() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "cli":
            continue
        if any(m == "typer" or m.startswith("typer.") for m in imported_modules(path)):
            offenders.append(str(rel))
    assert offenders == [], f"typer imported outside dflash_cli/cli/: {offenders}"


def test_scanner_sees_imports(tmp_path: Path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text("import typer.testing\nfrom typer import Option\ndef f():\n    import typer\n")
    assert {"typer.testing", "typer"} <= imported_modules(sample)
