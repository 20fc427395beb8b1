"""Instantiate the export-ready modules from an inject artifact.

`build_*` makes the module on any device (the meta device for tracing: no weight memory);
`load_*` fills it with real weights read tensor by tensor (strict key matching); `weight_sources`
says, for every parameter and buffer name, where its bytes come from, for streamed export.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_cli.checkpoints.weights import WeightStore
from dflash_cli.errors import CheckpointError

DRAFT_PREFIX = "draft."  # StaticCacheDraft holds the DFlashDraft as `draft`


def _hf_config(config_path: Path, **overrides):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(config_path.parent))
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def vision_config(artifact_dir: Path) -> dict:
    """A vision-language target's tower config and image token ids (text_path.vision_config), as convert kept them."""
    from dflash_cli.checkpoints.text_path import VISION_CONFIG_FILE

    path = artifact_dir / "target" / VISION_CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"no {VISION_CONFIG_FILE} in {path.parent}", hint="rebuild: `dflash build --force`")
    return json.loads(path.read_text())


def multimodal_config(artifact_dir: Path):
    """The target's whole multimodal config (text and tower) as Hugging Face's own class builds it from what
    convert kept; its `.vision_config` is the tower's (checkpoints name that type as the model's own)."""
    from transformers import AutoConfig

    kept = vision_config(artifact_dir)
    text = json.loads((artifact_dir / "target" / "config.json").read_text())
    fields = {k: v for k, v in kept.items() if k != "model_type"}
    return AutoConfig.for_model(kept["model_type"], text_config=text, **fields)


def load_pair_info(artifact_dir: Path) -> dict:
    return json.loads((artifact_dir / "pair.json").read_text())


def target_config(artifact_dir: Path, **overrides):
    return _hf_config(artifact_dir / "target" / "config.json", **overrides)


def draft_config(artifact_dir: Path, **overrides):
    from transformers import Qwen3Config

    raw = json.loads((artifact_dir / "draft" / "config.json").read_text())
    drop = ("model_type", "dflash_config", "auto_map", "dtype", "torch_dtype")
    cfg = Qwen3Config(**{k: v for k, v in raw.items() if k not in drop})
    from dflash_cli.modeling.dflash2_config import spec_of

    cfg.dflash2 = spec_of(raw)  # None for a DFlash draft
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def build_target(
    artifact_dir: Path, emit_logits: bool = False, *, cfg=None, layer_ids=None, device="cpu", dtype=None, shape=None
):
    """The export-ready target of the pair's family; `shape` (a PairShape: the export's call lengths) sizes
    a hybrid family's linear-attention state (the longest call, the pending rows a static graph keeps)."""
    from dflash_cli.families import family_for

    cfg = cfg or target_config(artifact_dir)
    ids = layer_ids if layer_ids is not None else load_pair_info(artifact_dir)["target_layer_ids"]
    with torch.device(device):
        if family_for(cfg.model_type).per_layer_geometry:
            from dflash_cli.checkpoints.text_path import VISION_CONFIG_FILE
            from dflash_cli.modeling.gemma4_target import Gemma4Target

            kept = vision_config(artifact_dir) if (artifact_dir / "target" / VISION_CONFIG_FILE).is_file() else {}
            placeholders = tuple(kept[k] for k in ("image_token_id", "video_token_id") if kept.get(k) is not None)
            model = Gemma4Target(cfg, ids, emit_logits=emit_logits, placeholders=placeholders).eval()
        elif family_for(cfg.model_type).hybrid:
            from dflash_cli.checkpoints.text_path import VISION_CONFIG_FILE
            from dflash_cli.modeling.hybrid_target import HybridCacheTarget

            calls = {} if shape is None else {"longest_call": shape.longest_call, "keep_rows": shape.block}
            vision = (artifact_dir / "target" / VISION_CONFIG_FILE).is_file()  # Qwen3.5 taking images
            model = HybridCacheTarget(cfg, ids, emit_logits=emit_logits, vision=vision, **calls).eval()
        elif family_for(cfg.model_type).vision:
            from dflash_cli.modeling.vl_target import VisionLanguageTarget

            deepstack = len(vision_config(artifact_dir)["vision_config"].get("deepstack_visual_indexes", ()))
            model = VisionLanguageTarget(cfg, ids, emit_logits=emit_logits, deepstack=deepstack).eval()
        else:
            from dflash_cli.modeling.target import StaticCacheTarget

            model = StaticCacheTarget(cfg, ids, emit_logits=emit_logits).eval()
    if dtype is not None:
        model = model.to(dtype)
    return model


def build_draft(artifact_dir: Path, emit_logits: bool = False, *, cfg=None, vocab=None, device="cpu", dtype=None):
    from dflash_cli.modeling.draft import DFlashDraft, StaticCacheDraft

    pair = load_pair_info(artifact_dir)
    cfg = cfg or draft_config(artifact_dir)
    with torch.device(device):
        model = StaticCacheDraft(
            DFlashDraft(cfg, len(pair["target_layer_ids"]), vocab or pair["vocab_size"]), emit_logits=emit_logits
        ).eval()
    if dtype is not None:
        model = model.to(dtype)
    return model


def fill_weights(module: torch.nn.Module, store: WeightStore, rename=None, *, rows: int | None = None) -> None:
    """Give every parameter of `module` its checkpoint tensor (float32, or the module's dtype).

    `rename` maps a parameter name to its name in the store; `rows` keeps only the first rows of
    the vocabulary-sized tensors (the reduced model of validation, exporting/reduced.py).
    """
    names = [n for n, _ in module.named_parameters()]
    wanted = {n: (rename(n) if rename else n) for n in names}
    missing = sorted(n for n, s in wanted.items() if s not in store)
    if missing:
        raise CheckpointError(
            f"weights do not match the model: missing {missing[:5]}",
            hint="rebuild from a clean cache: `dflash build --force`",
        )
    for name, param in list(module.named_parameters()):
        shape = store.shape(wanted[name])
        if rows is not None and shape and shape[0] != param.shape[0] and tuple(shape[1:]) == tuple(param.shape[1:]):
            # only the rows kept are read and converted (not a whole vocabulary-sized tensor first); the
            # module's own first dim: the vocabulary rows, or a reduced MoE layer's experts
            tensor = torch.cat(list(store.iter_rows(wanted[name], param.dtype, rows=param.shape[0])))
        else:
            tensor = store.get(wanted[name], param.dtype)
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor {wanted[name]} has shape {list(tensor.shape)}, the model expects {list(param.shape)}",
                hint="rebuild from a clean cache: `dflash build --force`",
            )
        owner, attr = _owner(module, name)
        setattr(owner, attr, torch.nn.Parameter(tensor.to(param.dtype), requires_grad=False))


def _owner(module: torch.nn.Module, name: str):
    *path, attr = name.split(".")
    for p in path:
        module = getattr(module, p)
    return module, attr


def draft_store_name(name: str) -> str:
    return name.removeprefix(DRAFT_PREFIX)


def target_rotaries(model, cfg) -> dict:
    """A target's RoPE modules by attribute name (one, or one per layer kind: gemma4_target.py)."""
    from dflash_cli.modeling.layers import Rotary

    make = getattr(model, "rotary_modules", None)
    return make(cfg) if make is not None else {"rotary": Rotary(cfg)}


def computed_parts(model, cfg) -> None:
    """What a target built on the meta device computes rather than loads: RoPE and config-derived buffers."""
    for name, rotary in target_rotaries(model, cfg).items():
        setattr(model, name, rotary)
    if hasattr(model, "computed_buffers"):
        model.computed_buffers(cfg)


def load_target(artifact_dir: Path, emit_logits: bool = False):
    """StaticCacheTarget with injected fc/hidden_norm, in eval mode, float32."""
    cfg = target_config(artifact_dir)
    model = build_target(artifact_dir, emit_logits, cfg=cfg, device="meta", dtype=torch.float32)
    fill_weights(model, WeightStore.open(artifact_dir / "target"))
    computed_parts(model, cfg)
    return model.eval()


def load_draft(artifact_dir: Path):
    """DFlashDraft with injected embed_tokens/lm_head, in eval mode, float32."""
    from dflash_cli.modeling.layers import Rotary

    cfg = draft_config(artifact_dir)
    model = build_draft(artifact_dir, cfg=cfg, device="meta", dtype=torch.float32)
    fill_weights(model, WeightStore.open(artifact_dir / "draft"), draft_store_name)
    model.draft.rotary = Rotary(cfg)
    return model.draft.eval()
