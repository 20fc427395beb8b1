"""Golden-file comparison for the QAIC tests; DFLASH_UPDATE_GOLDEN=1 rewrites the files."""

from __future__ import annotations

import os
from pathlib import Path

GOLDEN_DIR = Path(__file__).parent / "golden" / "qaic"


def assert_golden(name: str, actual: str) -> None:
    path = GOLDEN_DIR / name
    if os.environ.get("DFLASH_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual, encoding="utf-8")
    assert path.exists(), f"missing golden file {path}; run with DFLASH_UPDATE_GOLDEN=1 once and review it"
    expected = path.read_text(encoding="utf-8")
    assert actual == expected, f"{name} differs from its golden file {path}"


def argv_text(argv: list[str]) -> str:
    """One argument per line: diffs of golden commands stay readable."""
    return "\n".join(argv) + "\n"
