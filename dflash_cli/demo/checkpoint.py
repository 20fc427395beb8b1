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


def resume(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, float]:
    """Restore model and optimizer from `path` if it exists; returns (step, training seconds so far)."""
    state = load(path)
    if state is None:
        return 0, 0.0
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return state["step"], state["elapsed"]


def save_training(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, elapsed: float) -> None:
    save(path, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed})
