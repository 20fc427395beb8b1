"""gpt-oss (20b, 120b): attention sinks, every other layer a 128-token window, biased projections, YaRN;
every MLP routed experts (fused, transposed or MXFP4). The published drafts' configs name their mask token.
Its chat template is harmony's."""

from dflash_cli.families.family import Family

FAMILY = Family(
    "gpt_oss",
    qk_norm=False,
    default_mask_token_id=None,
    moe=True,
    sliding=True,
    attention_sinks=True,
    fused_experts=True,
    reasoning_effort=True,
    qaic_slot_cache=True,
)
