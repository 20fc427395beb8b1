"""Qwen3-MoE (Qwen3-Coder-30B-A3B, Qwen3-30B-A3B): Qwen3 attention, routed experts without a shared one."""

from dflash_cli.families.family import Family

FAMILY = Family(
    "qwen3_moe", qk_norm=True, default_mask_token_id=151669, moe=True, qaic_slot_cache=True, tool_call_format="hermes"
)
