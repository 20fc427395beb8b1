"""Atomic, resumable training checkpoints (model, optimizer, step, RNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # a kill mid-save leaves the previous checkpoint intact


def load(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
