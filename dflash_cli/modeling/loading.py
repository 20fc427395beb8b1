"""Instantiate the export-ready modules from an inject artifact (strict key matching)."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_cli.errors import CheckpointError


def _hf_config(config_path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(config_path.parent))


def _load_strict(module, state: dict, what: str) -> None:
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"{what} weights do not match the model: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}",
            hint="rebuild from a clean cache: `dflash build --force`",
        )


def load_pair_info(artifact_dir: Path) -> dict:
    return json.loads((artifact_dir / "pair.json").read_text())


def load_target(artifact_dir: Path, emit_logits: bool = False):
    """StaticCacheTarget with injected fc/hidden_norm, in eval mode, float32."""
    from safetensors.torch import load_file

    from dflash_cli.modeling.target import StaticCacheTarget

    pair = load_pair_info(artifact_dir)
    cfg = _hf_config(artifact_dir / "target" / "config.json")
    model = StaticCacheTarget(cfg, pair["target_layer_ids"], emit_logits=emit_logits)
    _load_strict(model, load_file(str(artifact_dir / "target" / "model.safetensors")), "target")
    return model.eval().float()


def load_draft(artifact_dir: Path):
    """DFlashDraft with injected embed_tokens/lm_head, in eval mode, float32."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    from dflash_cli.modeling.draft import DFlashDraft

    pair = load_pair_info(artifact_dir)
    raw = json.loads((artifact_dir / "draft" / "config.json").read_text())
    cfg = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("model_type", "dflash_config", "auto_map")})
    model = DFlashDraft(cfg, len(pair["target_layer_ids"]), pair["vocab_size"])
    _load_strict(model, load_file(str(artifact_dir / "draft" / "model.safetensors")), "draft")
    return model.eval().float()
