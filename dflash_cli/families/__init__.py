"""Target families: one module each (qwen3.py, gemma4.py, ...) declaring its Family (family.py), and the
registry (registry.py). Per-family differences are declared here only; code elsewhere reads a trait
(`family_for(model_type).moe`), never tests a family's name (tests/test_family_dispatch.py)."""

from dflash_cli.families.family import Family
from dflash_cli.families.registry import (
    DRAFT_MODEL_TYPE,
    FAMILIES,
    FAMILY_NAMES,
    family_for,
    family_named,
    require_qaic_support,
    traits_of,
)

__all__ = [
    "DRAFT_MODEL_TYPE",
    "FAMILIES",
    "FAMILY_NAMES",
    "Family",
    "family_for",
    "family_named",
    "require_qaic_support",
    "traits_of",
]
