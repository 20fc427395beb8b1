"""Llama (3.x, dense): no q/k normalisation."""

from dflash_cli.families.family import Family

FAMILY = Family("llama", qk_norm=False, default_mask_token_id=128002, qaic_slot_cache=True)
