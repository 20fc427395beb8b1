"""Stage `inject`: move weights across the pair (REFERENCE 4).

* draft <- target: `embed_tokens.weight` and `lm_head.weight` (the draft ships neither).
* target <- draft: `dflash.fc.weight` (scaled into fp16 range) and `dflash.hidden_norm.weight`, so
  the exported target emits the fused [batch, seq, H] context instead of len(ids) hidden states.
  The draft keeps its own unscaled `fc`/`hidden_norm`, so it stays a complete z-lab draft that a
  PyTorch reference can run unchanged.

Same file names as `convert`; pair.json gains `fc_scale`. Every injected tensor is checked on disk
after writing: a missing one would silently pin acceptance at 1.00.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_cli import checkpoints as ckpt
from dflash_cli.errors import CheckpointError
from dflash_cli.pair import PAIR_FILE, PairInfo
from dflash_cli.stages.base import StageContext
from dflash_cli.stages.convert import DRAFT_DIR, EMBED_KEY, LM_HEAD_KEY, TARGET_DIR

if TYPE_CHECKING:
    import torch

DRAFT_EMBED_KEY = "embed_tokens.weight"
DRAFT_LM_HEAD_KEY = "lm_head.weight"
TARGET_FC_KEY = "dflash.fc.weight"
TARGET_HIDDEN_NORM_KEY = "dflash.hidden_norm.weight"
FP16_HEADROOM = 128.0  # QEfficient's target bound for |fc output| per unit of feature magnitude


def fc_scale(fc_weight: torch.Tensor) -> float:
    """Divisor that keeps fc outputs in fp16 range; RMSNorm after fc makes any divisor harmless."""
    in_features = fc_weight.shape[1]
    bound = math.sqrt(in_features) * float(fc_weight.float().norm(dim=1).max())
    return max(bound / FP16_HEADROOM, 1.0)


def fused_context(
    features: list[torch.Tensor], fc_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """ctx = hidden_norm(fc(concat(features))): fc without bias, RMSNorm computed in float32."""
    import torch

    projected = torch.cat(features, dim=-1) @ fc_weight.T
    x = projected.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (norm_weight.float() * x).to(projected.dtype)


class InjectStage:
    name = "inject"
    version = 1
    upstream: tuple[str, ...] = ("convert",)

    def key_fields(self, recipe: Any) -> dict[str, Any]:
        return {}  # everything inject reads comes through the convert artifact and its key

    def run(self, ctx: StageContext) -> dict[str, Any]:
        src = ctx.inputs["convert"]
        pair = PairInfo.from_json((src / PAIR_FILE).read_text(encoding="utf-8"))
        ctx.progress("loading converted weights")
        target_sd = ckpt.load_state_dict(src / TARGET_DIR)
        draft_sd = ckpt.load_state_dict(src / DRAFT_DIR)

        embed = _required(target_sd, EMBED_KEY, "target")
        lm_head = target_sd.get(LM_HEAD_KEY, embed)  # convert materialises it; tied fallback anyway
        fc = _required(draft_sd, "fc.weight", "draft")
        hidden_norm = _required(draft_sd, "hidden_norm.weight", "draft")

        scale = fc_scale(fc)
        draft_sd[DRAFT_EMBED_KEY] = embed.clone()  # clones: safetensors rejects shared storage
        draft_sd[DRAFT_LM_HEAD_KEY] = lm_head.clone()
        target_sd[TARGET_FC_KEY] = fc / scale
        target_sd[TARGET_HIDDEN_NORM_KEY] = hidden_norm.clone()

        ctx.progress(f"writing injected pair (fc scaled by 1/{scale:.4g})")
        for role, sd in ((TARGET_DIR, target_sd), (DRAFT_DIR, draft_sd)):
            out = ctx.out_dir / role
            out.mkdir(parents=True)
            _copy_side_files(src / role, out)
            ckpt.save_state_dict(sd, out / ckpt.SINGLE_WEIGHTS_FILE)
        pair = replace(pair, fc_scale=scale)
        (ctx.out_dir / PAIR_FILE).write_text(pair.to_json(), encoding="utf-8")

        expected = _expected_injected(pair)
        _verify(ctx.out_dir, expected)
        return {"fc_scale": scale, "injected": {role: sorted(keys) for role, keys in expected.items()}}


def _required(sd: dict[str, torch.Tensor], key: str, role: str) -> torch.Tensor:
    if key not in sd:
        raise CheckpointError(f"converted {role} has no {key}", hint="rebuild the convert stage")
    return sd[key]


def _copy_side_files(src: Path, dst: Path) -> None:
    for path in sorted(src.iterdir()):
        if path.is_file() and not path.name.endswith(".safetensors"):
            shutil.copyfile(path, dst / path.name)


def _expected_injected(pair: PairInfo) -> dict[str, dict[str, tuple[int, ...]]]:
    # Shapes from pair.json, not from the tensors just written, so the check is independent.
    vocab, hidden = pair.vocab_size, pair.hidden_size
    fc_shape = (hidden, len(pair.target_layer_ids) * hidden)
    return {
        TARGET_DIR: {TARGET_FC_KEY: fc_shape, TARGET_HIDDEN_NORM_KEY: (hidden,)},
        DRAFT_DIR: {DRAFT_EMBED_KEY: (vocab, hidden), DRAFT_LM_HEAD_KEY: (vocab, hidden)},
    }


def _verify(out_dir: Path, expected: dict[str, dict[str, tuple[int, ...]]]) -> None:
    """Re-read the written headers: every injected tensor must be there with its shape."""
    for role, tensors in expected.items():
        shapes = ckpt.tensor_shapes(out_dir / role / ckpt.SINGLE_WEIGHTS_FILE)
        for key, shape in tensors.items():
            if shapes.get(key) != shape:
                got = "missing" if key not in shapes else f"shape {list(shapes[key])}"
                raise CheckpointError(
                    f"injected {role} tensor {key} is {got}, expected {list(shape)}",
                    hint="rebuild the convert and inject stages; acceptance would be stuck at 1.00",
                )


STAGE = InjectStage()
