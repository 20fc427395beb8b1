"""Stage `convert`: locate both checkpoints, validate the pair, publish them without copying weights.

Weights keep the checkpoint's own dtype and files: each safetensors file is hard-linked into the
artifact (copied only where the filesystem cannot link), and `weights.json` names every tensor the
later stages read, so a tied lm_head is an alias of the embedding rather than a second copy.
Nothing here loads a tensor: shapes come from the safetensors headers.

Output layout (names are the contract for `inject`):
  target/config.json, target/weights.json (Hugging Face keys, lm_head.weight always named),
  target/source_config.json (the checkpoint's own config.json, where config.json is its text path's),
  target/<the checkpoint's safetensors files and shard index>, target/<generation config, tokenizer>
  draft/config.json (block_size, num_target_layers, dflash_config resolved),
  draft/weights.json (z-lab keys exactly), draft/<safetensors files>
  pair.json (PairInfo)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cli.checkpoints import locate as ckpt
from dflash_cli.checkpoints.text_path import (
    VISION_CONFIG_FILE,
    VISION_PREFIXES,
    text_config,
    text_weights,
    vision_config,
)
from dflash_cli.checkpoints.weights import WeightStore, link_or_copy, write_index
from dflash_cli.errors import CheckpointError
from dflash_cli.modeling.dflash2_config import refuse_unread
from dflash_cli.pairing.pair import PAIR_FILE, PairInfo, draft_weight_shapes, resolve_pair
from dflash_cli.pairing.speculators import IGNORED_TENSORS, as_zlab, is_speculators
from dflash_cli.stages.base import StageContext

EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
TARGET_DIR = "target"
DRAFT_DIR = "draft"
# A target needs one of these to encode prompts; without any, every later `run` would fail.
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ConvertStage:
    name = "convert"
    # 3: the text path of multimodal checkpoints (Qwen3.5); 4: stacked experts (MoE); 5: Gemma 4, Qwen3.5's tower;
    # 6: DFlash2 drafts and speculators-format drafts; 7: a draft config field we do not compute is refused by
    # name (a cached artifact of such a draft must not outlive the check), and target/source_config.json
    version = 7
    upstream: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()  # reads headers and links files: only its own version matters

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
            "images": takes_images(recipe),
        }

    def run(self, ctx: StageContext) -> dict[str, Any]:
        ctx.progress(f"reading target headers from {ckpt.resolve_checkpoint_dir(ctx.recipe.target.path, 'target')}")
        described = describe(ctx.recipe)
        target_dir, draft_dir, pair = described.target_dir, described.draft_dir, described.pair
        target = described.target
        target_index = {name: (ref.file, ref.key) for name, ref in target.refs.items()}
        _complete_lm_head(target_index, pair)
        _check_target_layers(target.names(), pair)

        ctx.progress(f"reading draft headers from {draft_dir}")
        draft = WeightStore.open(draft_dir)
        if is_speculators(described.draft_cfg):  # the verifier's own tensors it may carry are not the draft's
            draft = WeightStore(draft.root, {k: r for k, r in draft.refs.items() if k not in IGNORED_TENSORS})
        expected = draft_weight_shapes(described.draft_cfg, pair)
        _check_draft_weights({n: r.shape for n, r in draft.refs.items()}, expected)

        ctx.progress("linking target weights")
        write_configs(ctx.out_dir, described)
        out_target, out_draft = ctx.out_dir / TARGET_DIR, ctx.out_dir / DRAFT_DIR
        for name in (ckpt.GENERATION_CONFIG_FILE, ckpt.SHARD_INDEX_FILE, *ckpt.TOKENIZER_FILES, *ckpt.PROCESSOR_FILES):
            if (target_dir / name).is_file():
                shutil.copyfile(target_dir / name, out_target / name)
        copied = _link_files(target_dir, target.files(), out_target)
        write_index(out_target, target_index, target.stacks)

        ctx.progress("linking draft weights")
        copied += _link_files(draft_dir, draft.files(), out_draft)
        write_index(out_draft, {name: (ref.file, ref.key) for name, ref in draft.refs.items()})

        return {
            "target_params": _numel(target, exclude={LM_HEAD_KEY} if pair.tie_word_embeddings else set()),
            "draft_params": _numel(draft, set()),
            "dtype": sorted({r.dtype for r in (*target.refs.values(), *draft.refs.values())}),
            "weight_files_copied": copied,  # 0 when every file could be hard-linked
            "block_size": pair.block_size,
            "target_layer_ids": list(pair.target_layer_ids),
            "mask_token_id": pair.mask_token_id,
        }


@dataclass(frozen=True)
class Described:
    """What convert knows of a pair from its configs and headers alone (no weight is read)."""

    target_dir: Path
    draft_dir: Path
    target_cfg: dict[str, Any]
    draft_cfg: dict[str, Any]  # the draft's own config.json
    pair: PairInfo
    target: WeightStore  # the target checkpoint's tensors, by their headers
    vision_cfg: dict[str, Any] | None = None  # a vision-language target's tower config and image token ids
    raw_target_cfg: dict[str, Any] | None = None  # the checkpoint's config.json as it is (its tokenizer's class)


def describe(recipe: Any) -> Described:
    """The recipe's pair as convert resolves it: configs, tokenizer check and target header only."""
    target_dir = ckpt.resolve_checkpoint_dir(recipe.target.path, "target")
    draft_dir = ckpt.resolve_checkpoint_dir(recipe.draft.path, "draft")
    raw_target_cfg = ckpt.load_config(target_dir)
    draft_cfg = as_zlab(ckpt.load_config(draft_dir), str(draft_dir / ckpt.CONFIG_FILE))  # speculators' format too
    _check_roles(target_dir, raw_target_cfg, draft_cfg)
    target_cfg = text_config(raw_target_cfg)
    _check_layer_kinds(target_dir, target_cfg, "target")
    _check_gemma4(target_dir, target_cfg)
    _check_layer_kinds(draft_dir, draft_cfg, "draft")
    if isinstance(draft_cfg.get("dflash_config"), dict):  # a DFlash draft (else resolve_pair says it is none)
        refuse_unread(draft_cfg, str(draft_dir / ckpt.CONFIG_FILE))  # a field we would otherwise ignore: by name
    _check_tokenizer(target_dir)
    images = _family_has(target_cfg.get("model_type"), "vision") and takes_images(recipe)
    store = WeightStore.open(target_dir)
    # A multimodal config over a checkpoint without the tower's tensors (saved text-only): its text path.
    has_tower = any(name.startswith(VISION_PREFIXES) for name in store.refs)
    vision = vision_config(raw_target_cfg) if images and has_tower else None
    target = text_weights(store, with_vision=vision is not None)
    if EMBED_KEY not in target:
        raise CheckpointError(
            f"target weights have no {EMBED_KEY}", hint="point target.path at a Hugging Face causal LM checkpoint"
        )
    _check_vocab_size(target_dir, target_cfg, target)
    if _family_has(target_cfg.get("model_type"), "moe"):
        from dflash_cli.modeling.moe import checkpoint_stacks  # imports torch: not at pipeline import

        target = WeightStore(target.root, target.refs, checkpoint_stacks(target_cfg, target))
    from dflash_cli.families import traits_of

    views = traits_of(target_cfg.get("model_type")).checkpoint_views  # tensors read in another layout than stored
    if views is not None:
        target = WeightStore(target.root, target.refs, {**target.stacks, **views(target_cfg, target)})
    pair = resolve_pair(
        target_cfg,
        draft_cfg,
        recipe,
        int(target.shape(EMBED_KEY)[0]),
        generation_cfg=ckpt.load_generation_config(target_dir),
    )
    return Described(target_dir, draft_dir, target_cfg, draft_cfg, pair, target, vision, raw_target_cfg)


def write_configs(out_dir: Path, described: Described) -> None:
    """The artifact's config files and pair.json: what later stages build their modules from."""
    for sub in (TARGET_DIR, DRAFT_DIR):
        (out_dir / sub).mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / TARGET_DIR / ckpt.CONFIG_FILE, described.target_cfg)
    if described.raw_target_cfg is not None and described.raw_target_cfg != described.target_cfg:
        # config.json above is the text path's; Hugging Face picks the tokenizer's class from the checkpoint's own
        _write_json(out_dir / TARGET_DIR / ckpt.SOURCE_CONFIG_FILE, described.raw_target_cfg)
    if described.vision_cfg is not None:
        _write_json(out_dir / TARGET_DIR / VISION_CONFIG_FILE, described.vision_cfg)
    draft_cfg = _resolved_draft_config(described.draft_cfg, described.pair, described.target_cfg)
    _write_json(out_dir / DRAFT_DIR / ckpt.CONFIG_FILE, draft_cfg)
    (out_dir / PAIR_FILE).write_text(described.pair.to_json(), encoding="utf-8")


def _is_dflash_draft(cfg: dict[str, Any]) -> bool:
    """A z-lab DFlash draft's config: a dflash_config section, or a DFlash architecture."""
    archs = cfg.get("architectures")
    named = isinstance(archs, list) and any(isinstance(a, str) and "dflash" in a.lower() for a in archs)
    return named or isinstance(cfg.get("dflash_config"), dict)


def _check_roles(target_dir: Path, target_cfg: dict[str, Any], draft_cfg: dict[str, Any]) -> None:
    """A DFlash draft given as the target (most often target.path and draft.path swapped)."""
    if not _is_dflash_draft(target_cfg):
        return
    archs = target_cfg.get("architectures")
    what = f"architectures {archs}" if isinstance(archs, list) and archs else "a dflash_config section"
    hint = (
        "target.path and draft.path look swapped: swap them in the recipe"
        if not _is_dflash_draft(draft_cfg)
        else "point target.path at the model the draft was trained for (draft.path takes the DFlash draft)"
    )
    raise CheckpointError(
        f"target checkpoint is a DFlash draft, not a target model ({ckpt.CONFIG_FILE} has {what}): {target_dir}",
        hint=hint,
    )


def _check_layer_kinds(path: Path, cfg: dict[str, Any], role: str) -> None:
    """Every layer must be of a kind our modules compute: full attention, and in a hybrid family's target
    linear attention. A sliding-window layer would be computed as a full one, silently giving other
    tokens, so it is refused until it is supported."""
    kinds = cfg.get("layer_types")  # what transformers 5 computes by, when the config has it
    if not isinstance(kinds, list):
        window = cfg.get("use_sliding_window") is True and cfg.get("sliding_window")
        start, layers = int(cfg.get("max_window_layers") or 0), int(cfg.get("num_hidden_layers") or 0)
        kinds = ["sliding_attention" if window and i >= start else "full_attention" for i in range(layers)]
    allowed = {"full_attention"}
    if role == "target" and _family_has(cfg.get("model_type"), "hybrid"):
        allowed.add("linear_attention")
    if role == "target" and _family_has(cfg.get("model_type"), "sliding"):
        allowed.add("sliding_attention")
    if role == "draft" and cfg.get("sliding_window"):
        # a draft's window is taken only where it never binds (export checks it against ctx_len)
        allowed.add("sliding_attention")
    other = [i for i, k in enumerate(kinds) if k not in allowed]
    if other:
        kind = kinds[other[0]]
        window = f" (window {cfg.get('sliding_window')})" if "sliding" in str(kind) else ""
        supported = " and ".join(sorted(a.removesuffix("_attention") for a in allowed)) + " attention is"
        raise CheckpointError(
            f"{role} layer {other[0]} is {kind!r}{window} and {len(other)} layer(s) in all: only "
            f"{supported} supported: {path / ckpt.CONFIG_FILE}",
            hint=f"this checkpoint cannot be built yet; use a pair whose {role} layers are all "
            + " or ".join(sorted(allowed)),
        )


def takes_images(recipe: Any) -> bool:
    """Whether the build keeps a multimodal checkpoint's vision path: on QAIC only where the family's bundle has a
    vision program (Qwen3-VL's third); a QAIC build of Qwen3.5 keeps its text path (Gemma 4 is refused there)."""
    from dflash_cli.families import family_named

    on_qaic = getattr(getattr(recipe, "compile", None), "backend", "ort") == "qaic"
    return not on_qaic or family_named(recipe.family).qaic_vision


def _check_gemma4(path: Path, cfg: dict[str, Any]) -> None:
    """A Gemma 4 variant computing what our module does not (gemma4_target.unsupported)."""
    if not _family_has(cfg.get("model_type"), "per_layer_geometry"):
        return
    from dflash_cli.modeling.gemma4_target import unsupported

    why = unsupported(cfg)
    if why:
        raise CheckpointError(
            f"this Gemma 4 target uses {why}, which dflash does not compute yet: {path / ckpt.CONFIG_FILE}",
            hint="the dense Gemma 4 models (31B, 12B) are supported; use one of those",
        )


def _family_has(model_type: Any, trait: str) -> bool:
    """Whether the family of `model_type` has `trait` ("hybrid", "moe"); False for unknown types (refused later)."""
    from dflash_cli.families import traits_of

    return bool(getattr(traits_of(model_type), trait))


def _check_vocab_size(target_dir: Path, target_cfg: dict[str, Any], target: WeightStore) -> None:
    """config.json's vocab_size sizes the exported graph; it must equal the weights' rows, or export fails."""
    vocab = target_cfg.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        return
    rows = {key: target.shape(key)[0] for key in (EMBED_KEY, LM_HEAD_KEY) if key in target}
    for key, n in rows.items():
        if n != vocab:
            fix = (
                f"set vocab_size to {n} in its {ckpt.CONFIG_FILE}"
                if len(set(rows.values())) == 1
                else f"its {EMBED_KEY} and {LM_HEAD_KEY} differ too; download it again"
            )
            raise CheckpointError(
                f"target {ckpt.CONFIG_FILE} says vocab_size {vocab} but {key} has {n} rows "
                f"(in {target.refs[key].file}): {target_dir / ckpt.CONFIG_FILE}",
                hint=f"the checkpoint is inconsistent: {fix}",
            )


def _check_tokenizer(target_dir: Path) -> None:
    if not any((target_dir / name).is_file() for name in TOKENIZER_MARKERS):
        raise CheckpointError(
            f"target checkpoint has no tokenizer files ({', '.join(TOKENIZER_MARKERS)}): {target_dir}",
            hint="copy the model's tokenizer files into the target directory",
        )


def _link_files(src_dir: Path, files: list[str], out_dir: Path) -> int:
    copied = 0
    for name in files:
        if link_or_copy(src_dir / name, out_dir / name) == "copy":
            copied += 1
    return copied


def _numel(store: WeightStore, exclude: set[str]) -> int:
    total = 0
    for name, ref in store.refs.items():
        if name not in exclude:
            n = 1
            for d in ref.shape:
                n *= d
            total += n
    return total


def _complete_lm_head(index: dict[str, tuple[str, str]], pair: PairInfo) -> None:
    # Later stages (inject, export) always find lm_head.weight; tied checkpoints omit it on disk.
    if LM_HEAD_KEY in index:
        return
    if not pair.tie_word_embeddings:
        raise CheckpointError(
            f"target weights have no {LM_HEAD_KEY} and tie_word_embeddings is false",
            hint="the target checkpoint is incomplete; download it again",
        )
    index[LM_HEAD_KEY] = index[EMBED_KEY]  # an alias of the same stored tensor, not a copy


def _check_target_layers(names: list[str], pair: PairInfo) -> None:
    present = {int(k.split(".")[2]) for k in names if k.startswith("model.layers.")}
    missing = sorted(set(range(pair.num_target_layers)) - present)
    if missing:
        raise CheckpointError(
            f"target weights lack decoder layers {missing[:5]} of the {pair.num_target_layers} in its config",
            hint="the target checkpoint is incomplete; download it again",
        )


def _check_draft_weights(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
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
    wrong = [(k, tuple(shapes[k]), s) for k, s in expected.items() if tuple(shapes[k]) != s]
    if wrong:
        key, got, want = wrong[0]
        raise CheckpointError(
            f"draft tensor {key} has shape {list(got)}, expected {list(want)} ({len(wrong)} mismatched)",
            hint="target_layer_ids must have as many entries as the draft's fc was trained with"
            if key == "fc.weight"
            else "the draft config does not match its weights",
        )


def _resolved_draft_config(draft_cfg: dict[str, Any], pair: PairInfo, target_cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = dict(draft_cfg)
    if _family_has(target_cfg.get("model_type"), "scaled_embedding"):
        # The draft embeds its block through the target's embedding, which Gemma 4 scales.
        from dflash_cli.modeling.gemma4_target import embed_scale

        cfg["embed_scale"] = embed_scale(int(target_cfg["hidden_size"]), target_cfg.get("dtype"))
    cfg["block_size"] = pair.block_size
    cfg["num_target_layers"] = pair.num_target_layers
    kept = {k: v for k, v in draft_cfg.get("dflash_config", {}).items() if k not in ("block_size", "num_target_layers")}
    cfg["dflash_config"] = {  # block_size and num_target_layers: their resolved values are the top level's
        **kept,
        "mask_token_id": pair.mask_token_id,
        "target_layer_ids": list(pair.target_layer_ids),
    }
    return cfg


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


STAGE = ConvertStage()
