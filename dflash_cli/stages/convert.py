"""Stage `convert`: locate both checkpoints, validate the pair, write normalised float32 copies.

Output layout (names are the contract for `inject`):
  target/config.json, target/model.safetensors (Hugging Face keys, lm_head.weight always present),
  target/<generation config and tokenizer files that exist>
  draft/config.json (block_size, num_target_layers, dflash_config resolved),
  draft/model.safetensors (z-lab keys exactly)
  pair.json (PairInfo)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_cli import checkpoints as ckpt
from dflash_cli.errors import CheckpointError
from dflash_cli.pair import PAIR_FILE, PairInfo, draft_weight_shapes, resolve_pair
from dflash_cli.stages.base import StageContext

if TYPE_CHECKING:
    import torch

EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
TARGET_DIR = "target"
DRAFT_DIR = "draft"


class ConvertStage:
    name = "convert"
    version = 1
    upstream: tuple[str, ...] = ()

    def key_fields(self, recipe: Any) -> dict[str, Any]:
        target_dir = ckpt.resolve_checkpoint_dir(recipe.target.path, "target")
        draft_dir = ckpt.resolve_checkpoint_dir(recipe.draft.path, "draft")
        ids = recipe.dflash.target_layer_ids
        return {
            "family": recipe.family,
            "target_path": str(recipe.target.path),
            "draft_path": str(recipe.draft.path),
            "block_size": recipe.dflash.block_size,
            "target_layer_ids": None if ids is None else list(ids),
            "mask_token_id": recipe.dflash.mask_token_id,
            "target_fingerprint": ckpt.fingerprint(target_dir),
            "draft_fingerprint": ckpt.fingerprint(draft_dir),
        }

    def run(self, ctx: StageContext) -> dict[str, Any]:
        recipe = ctx.recipe
        target_dir = ckpt.resolve_checkpoint_dir(recipe.target.path, "target")
        draft_dir = ckpt.resolve_checkpoint_dir(recipe.draft.path, "draft")
        target_cfg = ckpt.load_config(target_dir)
        draft_cfg = ckpt.load_config(draft_dir)

        ctx.progress(f"loading target weights from {target_dir}")
        target_sd = ckpt.load_state_dict(target_dir)
        embed = target_sd.get(EMBED_KEY)
        if embed is None:
            raise CheckpointError(
                f"target weights have no {EMBED_KEY}", hint="point target.path at a Hugging Face causal LM checkpoint"
            )
        pair = resolve_pair(
            target_cfg, draft_cfg, recipe, int(embed.shape[0]), generation_cfg=ckpt.load_generation_config(target_dir)
        )
        _complete_lm_head(target_sd, pair)
        _check_target_layers(target_sd, pair)

        ctx.progress(f"loading draft weights from {draft_dir}")
        draft_sd = ckpt.load_state_dict(draft_dir)
        _check_draft_weights(draft_sd, draft_weight_shapes(draft_cfg, pair))

        ctx.progress("writing float32 target")
        out_target = ctx.out_dir / TARGET_DIR
        out_target.mkdir(parents=True)
        _write_json(out_target / ckpt.CONFIG_FILE, _float32_config(target_cfg))
        for name in (ckpt.GENERATION_CONFIG_FILE, *ckpt.TOKENIZER_FILES):
            if (target_dir / name).is_file():
                shutil.copyfile(target_dir / name, out_target / name)
        target_params = _save_float32(target_sd, out_target / ckpt.SINGLE_WEIGHTS_FILE)

        ctx.progress("writing float32 draft")
        out_draft = ctx.out_dir / DRAFT_DIR
        out_draft.mkdir(parents=True)
        _write_json(out_draft / ckpt.CONFIG_FILE, _resolved_draft_config(draft_cfg, pair))
        draft_params = _save_float32(draft_sd, out_draft / ckpt.SINGLE_WEIGHTS_FILE)

        (ctx.out_dir / PAIR_FILE).write_text(pair.to_json(), encoding="utf-8")
        return {
            "target_params": target_params,
            "draft_params": draft_params,
            "dtype": "float32",
            "block_size": pair.block_size,
            "target_layer_ids": list(pair.target_layer_ids),
            "mask_token_id": pair.mask_token_id,
        }


def _complete_lm_head(target_sd: dict[str, torch.Tensor], pair: PairInfo) -> None:
    # Later stages (inject, export) always find lm_head.weight; tied checkpoints omit it on disk.
    if LM_HEAD_KEY in target_sd:
        return
    if not pair.tie_word_embeddings:
        raise CheckpointError(
            f"target weights have no {LM_HEAD_KEY} and tie_word_embeddings is false",
            hint="the target checkpoint is incomplete; download it again",
        )
    target_sd[LM_HEAD_KEY] = target_sd[EMBED_KEY].clone()  # a copy: safetensors rejects shared storage


def _check_target_layers(target_sd: dict[str, torch.Tensor], pair: PairInfo) -> None:
    present = {int(k.split(".")[2]) for k in target_sd if k.startswith("model.layers.")}
    missing = sorted(set(range(pair.num_target_layers)) - present)
    if missing:
        raise CheckpointError(
            f"target weights lack decoder layers {missing[:5]} of the {pair.num_target_layers} in its config",
            hint="the target checkpoint is incomplete; download it again",
        )


def _check_draft_weights(draft_sd: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    missing = sorted(set(expected) - set(draft_sd))
    unexpected = sorted(set(draft_sd) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({', '.join(unexpected[:3])})")
        prefixed = any(k.startswith("model.") for k in unexpected)
        raise CheckpointError(
            f"draft weights do not match the DFlash draft layout: {'; '.join(parts)}",
            hint="this looks like a full causal LM, not a DFlash draft"
            if prefixed
            else "use a z-lab format DFlash draft whose config matches its weights",
        )
    wrong = [(k, tuple(draft_sd[k].shape), s) for k, s in expected.items() if tuple(draft_sd[k].shape) != s]
    if wrong:
        key, got, want = wrong[0]
        raise CheckpointError(
            f"draft tensor {key} has shape {list(got)}, expected {list(want)} ({len(wrong)} mismatched)",
            hint="target_layer_ids must have as many entries as the draft's fc was trained with"
            if key == "fc.weight"
            else "the draft config does not match its weights",
        )


def _resolved_draft_config(draft_cfg: dict[str, Any], pair: PairInfo) -> dict[str, Any]:
    cfg = _float32_config(draft_cfg)
    cfg["block_size"] = pair.block_size
    cfg["num_target_layers"] = pair.num_target_layers
    cfg["dflash_config"] = {
        **draft_cfg.get("dflash_config", {}),
        "mask_token_id": pair.mask_token_id,
        "target_layer_ids": list(pair.target_layer_ids),
    }
    return cfg


def _float32_config(cfg: dict[str, Any]) -> dict[str, Any]:
    # The weights are rewritten in float32, so the config must not claim bf16 any more.
    out = dict(cfg)
    for key in ("dtype", "torch_dtype"):
        if key in out:
            out[key] = "float32"
    return out


def _save_float32(tensors: dict[str, torch.Tensor], path: Path) -> int:
    import torch

    for key, value in tensors.items():  # in place, so each original-dtype tensor is freed as we go
        if value.is_floating_point():
            tensors[key] = value.to(torch.float32)
    ckpt.save_state_dict(tensors, path)
    return sum(v.numel() for v in tensors.values())


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


STAGE = ConvertStage()
