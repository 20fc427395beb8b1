"""Moved to dflash_cli.families (one module per family, issue 57). Kept only while stages/compile.py,
stages/export.py and pair.py still import from here; delete it once they import dflash_cli.families."""

from dflash_cli.families import FAMILIES, Family, family_for, require_qaic_support

__all__ = ["FAMILIES", "Family", "family_for", "require_qaic_support"]
