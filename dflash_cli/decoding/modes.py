"""Decoding modes by name (light: the CLI imports this at startup)."""

MODES = ("plain", "dflash", "pld", "hybrid")  # pld = prompt (suffix) lookup, no model
DRAFTER_MODES = {"dflash": "dflash", "lookup": "pld", "hybrid": "hybrid"}  # recipe run.drafter -> mode
