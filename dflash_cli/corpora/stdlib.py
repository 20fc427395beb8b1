"""The demo corpus: the running interpreter's standard-library sources, split by file."""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Third-party code is not part of the standard library, whatever the layout.
_EXCLUDED_PARTS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class CorpusSplit:
    train: list[Path]
    heldout: list[Path]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path | None = None) -> list[Path]:
    """Every .py file under the stdlib, in a deterministic (sorted relative path) order."""
    root = root or stdlib_root()
    files = [p for p in root.rglob("*.py") if not (_EXCLUDED_PARTS & set(p.relative_to(root).parts))]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(relative_path: str, heldout_percent: int = 3) -> bool:
    """Hash-based split: stable across machines and independent of which files exist."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return digest[0] * 100 // 256 < heldout_percent


def split_sources(root: Path | None = None, heldout_percent: int = 3) -> CorpusSplit:
    root = root or stdlib_root()
    train, heldout = [], []
    for path in list_sources(root):
        rel = path.relative_to(root).as_posix()
        (heldout if is_heldout(rel, heldout_percent) else train).append(path)
    return CorpusSplit(train=train, heldout=heldout)


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
