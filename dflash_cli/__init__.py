"""dflash: compile-and-run toolchain for DFlash speculative decoding."""

__version__ = "0.1.0"
