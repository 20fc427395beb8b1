"""Stage `inject`: move weights across the pair (REFERENCE 4).

* draft <- target: `embed_tokens.weight` and `lm_head.weight` (the draft ships neither).
* target <- draft: `dflash.fc.weight` (scaled into fp16 range) and `dflash.hidden_norm.weight`, so
  the exported target emits the fused [batch, seq, H] context instead of len(ids) hidden states.
  The draft keeps its own unscaled `fc`/`hidden_norm`, so it stays a complete z-lab draft that a
  PyTorch reference can run unchanged.

No weight is copied: both directories hard-link convert's files and `weights.json` aliases the draft's
`embed_tokens` / `lm_head` to the target's stored tensors; only `target/dflash.safetensors` (fc and
hidden_norm, in the draft's dtype) is new. pair.json gains `fc_scale`. Every injected tensor is checked through
the written index after writing: a missing one would silently pin acceptance at 1.00.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_cli.checkpoints import locate as ckpt
from dflash_cli.checkpoints.weights import WEIGHTS_INDEX, WeightStore, link_or_copy, write_index
from dflash_cli.errors import CheckpointError
from dflash_cli.pairing.pair import PAIR_FILE, PairInfo
from dflash_cli.stages.base import StageContext
from dflash_cli.stages.convert import DRAFT_DIR, EMBED_KEY, LM_HEAD_KEY, TARGET_DIR

if TYPE_CHECKING:
    import torch

DRAFT_EMBED_KEY = "embed_tokens.weight"
DRAFT_LM_HEAD_KEY = "lm_head.weight"
TARGET_FC_KEY = "dflash.fc.weight"
TARGET_HIDDEN_NORM_KEY = "dflash.hidden_norm.weight"
INJECTED_FILE = "dflash.safetensors"  # the only new weight bytes inject writes
SHARED_PREFIX = "target."  # the target's files, hard-linked into the draft for its embedding / lm_head
FP16_HEADROOM = 128.0  # QEfficient's target bound for |fc output| per unit of feature magnitude


def fc_scale(fc_weight: torch.Tensor) -> float:
    """Divisor that keeps fc outputs in fp16 range; RMSNorm after fc makes any divisor harmless. A power
    of two, so the scaled weight is exact in the checkpoint's own dtype (no float32 copy to store)."""
    in_features = fc_weight.shape[1]
    bound = math.sqrt(in_features) * float(fc_weight.float().norm(dim=1).max())
    return 2.0 ** math.ceil(math.log2(bound / FP16_HEADROOM)) if bound > FP16_HEADROOM else 1.0


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
    version = 3  # 3: fc scaled by a power of two, stored in the draft's dtype
    upstream: tuple[str, ...] = ("convert",)
    tools: tuple[str, ...] = ("torch", "safetensors")

    def key_fields(self, recipe: Any) -> dict[str, Any]:
        return {}  # everything inject reads comes through the convert artifact and its key

    def run(self, ctx: StageContext) -> dict[str, Any]:

        src = ctx.inputs["convert"]
        pair = PairInfo.from_json((src / PAIR_FILE).read_text(encoding="utf-8"))
        target = _open(src / TARGET_DIR, "target")
        draft = _open(src / DRAFT_DIR, "draft")
        for store, key, role in ((target, EMBED_KEY, "target"), (draft, "fc.weight", "draft")):
            _required(store, key, role)
        _required(draft, "hidden_norm.weight", "draft")
        lm_head = LM_HEAD_KEY if LM_HEAD_KEY in target else EMBED_KEY  # convert names it; tied fallback anyway

        # Only the small fused-context weights are new bytes, in the draft's dtype (a power-of-two
        # division is exact there).
        fc = draft.get("fc.weight")
        scale = fc_scale(fc)
        out_target, out_draft = ctx.out_dir / TARGET_DIR, ctx.out_dir / DRAFT_DIR
        out_target.mkdir(parents=True)
        out_draft.mkdir(parents=True)
        ctx.progress(f"writing fused-context weights (fc scaled by 1/{scale:.4g})")
        ckpt.save_state_dict(
            {TARGET_FC_KEY: fc / scale, TARGET_HIDDEN_NORM_KEY: draft.get("hidden_norm.weight")},
            out_target / INJECTED_FILE,
        )
        del fc

        ctx.progress("linking target and draft weights")
        target_index = _link_all(target, src / TARGET_DIR, out_target)
        target_index[TARGET_FC_KEY] = (INJECTED_FILE, TARGET_FC_KEY)
        target_index[TARGET_HIDDEN_NORM_KEY] = (INJECTED_FILE, TARGET_HIDDEN_NORM_KEY)
        write_index(out_target, target_index, target.stacks)
        _copy_side_files(src / TARGET_DIR, out_target)

        draft_index = _link_all(draft, src / DRAFT_DIR, out_draft)
        # The draft's embedding and lm_head are the target's tensors: link the target's files under a
        # prefix (draft and target may both call a file model.safetensors) and alias the names.
        for name, key in ((DRAFT_EMBED_KEY, EMBED_KEY), (DRAFT_LM_HEAD_KEY, lm_head)):
            ref = target.refs[key]
            linked = SHARED_PREFIX + ref.file
            if not (out_draft / linked).exists():
                link_or_copy(src / TARGET_DIR / ref.file, out_draft / linked)
            draft_index[name] = (linked, ref.key)
        write_index(out_draft, draft_index)
        _copy_side_files(src / DRAFT_DIR, out_draft)

        pair = replace(pair, fc_scale=scale)
        (ctx.out_dir / PAIR_FILE).write_text(pair.to_json(), encoding="utf-8")
        expected = _expected_injected(pair)
        _verify(ctx.out_dir, expected)
        return {"fc_scale": scale, "injected": {role: sorted(keys) for role, keys in expected.items()}}


def _open(path: Path, role: str) -> WeightStore:
    if not (path / WEIGHTS_INDEX).is_file():
        raise CheckpointError(f"converted {role} has no {WEIGHTS_INDEX}", hint="rebuild the convert stage")
    return WeightStore.open(path)


def _link_all(store: WeightStore, src: Path, out: Path) -> dict[str, tuple[str, str]]:
    for name in store.files():
        link_or_copy(src / name, out / name)
    return {name: (ref.file, ref.key) for name, ref in store.refs.items()}


def _required(store: WeightStore, key: str, role: str) -> None:
    if key not in store:
        raise CheckpointError(f"converted {role} has no {key}", hint="rebuild the convert stage")


def _copy_side_files(src: Path, dst: Path) -> None:
    for path in sorted(src.iterdir()):
        if path.is_file() and not path.name.endswith(".safetensors") and not (dst / path.name).exists():
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
    """Re-read the written index and headers: every injected tensor must be there with its shape."""
    for role, tensors in expected.items():
        store = WeightStore.open(out_dir / role)
        shapes = {name: ref.shape for name, ref in store.refs.items()}
        for key, shape in tensors.items():
            if shapes.get(key) != shape:
                got = "missing" if key not in shapes else f"shape {list(shapes[key])}"
                raise CheckpointError(
                    f"injected {role} tensor {key} is {got}, expected {list(shape)}",
                    hint="rebuild the convert and inject stages; acceptance would be stuck at 1.00",
                )


STAGE = InjectStage()
