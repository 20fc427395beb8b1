"""A multimodal checkpoint's text path as a causal LM: its config and its tensor names.

Qwen3.5 / Qwen3.6 ship as `Qwen3_5ForConditionalGeneration`: the language model's config nested in
`text_config`, its tensors under `model.language_model.*`, the vision tower under `model.visual.*` (and
multi-token-prediction heads under `mtp.*`). Convert publishes the text path under the causal LM's
names (`model.layers.*`, `model.embed_tokens.weight`, `lm_head.weight`) by renaming entries of the
weight index: no tensor is read or copied. The vision weights stay in their files, unindexed, except for
a family that takes images (Qwen3-VL, Gemma 4): its vision path is indexed without the `model.` prefix
and its config kept beside.
A text-only checkpoint (`Qwen3_5ForCausalLM`) already has this layout and passes through unchanged.
"""

from __future__ import annotations

from typing import Any

from dflash_cli.checkpoints.weights import WeightStore

LANGUAGE_PREFIX = "model.language_model."
# The vision path's tensors (Qwen3-VL's tower; Gemma 4's tower and embedder), indexed without `model.`
# beside the text path: `visual.*`, `vision_tower.*`, `embed_vision.*`.
VISION_PREFIXES = ("model.visual.", "model.vision_tower.", "model.embed_vision.")
VISION_CONFIG_FILE = "vision_config.json"  # beside the text config: what a vision-language target's tower needs
_VISION_KEYS = (
    "vision_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "boi_token_id",  # Gemma 4: an image's tokens sit between these two
    "eoi_token_id",
)
# Top-level keys of a multimodal config that hold for its text path too, where text_config lacks them.
_SHARED_KEYS = ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id")


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The causal LM config of `cfg`: text_config with a model_type of its own, or `cfg` itself."""
    nested = cfg.get("text_config")
    if not isinstance(nested, dict):
        return cfg
    text = dict(nested)
    text.setdefault("model_type", f"{cfg.get('model_type')}_text")
    for key in _SHARED_KEYS:
        if key in cfg and key not in text:
            text[key] = cfg[key]
    return text


def text_weights(store: WeightStore, with_vision: bool = False) -> WeightStore:
    """`store` with the language model's tensors under causal-LM names (a view: same files, same keys);
    `with_vision`: the vision tower's too, as `visual.*`."""
    if not any(name.startswith(LANGUAGE_PREFIX) for name in store.refs):
        return store
    refs = {"model." + n[len(LANGUAGE_PREFIX) :]: r for n, r in store.refs.items() if n.startswith(LANGUAGE_PREFIX)}
    if "lm_head.weight" in store.refs:
        refs["lm_head.weight"] = store.refs["lm_head.weight"]
    if with_vision:
        refs |= {n.removeprefix("model."): r for n, r in store.refs.items() if n.startswith(VISION_PREFIXES)}
    return WeightStore(store.root, refs)


def vision_config(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """A multimodal config's vision tower and image token ids, or None for a text-only config."""
    if not isinstance(cfg.get("vision_config"), dict):
        return None
    return {k: cfg[k] for k in _VISION_KEYS if k in cfg} | {"model_type": cfg.get("model_type")}
