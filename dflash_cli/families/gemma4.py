"""Gemma 4 (31B, 12B): sliding-window and global layers of different shapes (modeling/gemma4_target.py)."""

from dflash_cli.families.family import Family

FAMILY = Family(
    "gemma4",
    qk_norm=True,
    default_mask_token_id=None,
    model_types=("gemma4", "gemma4_text"),
    sliding=True,
    per_layer_geometry=True,
    scaled_embedding=True,
    vision=True,  # Gemma4ForConditionalGeneration: its tower and embedder (a text-only checkpoint has none)
    pooled_vision=True,
    qaic_refusal=(
        "compile.backend=qaic does not take Gemma 4 targets yet: their global layers' KV cache has another"
        " head width and head count than the sliding layers', and the bundle's specializations assume one"
    ),
)
