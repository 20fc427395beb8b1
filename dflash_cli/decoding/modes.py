"""The decoding modes, each once by its one name (light: the CLI imports this at startup).

A mode's name is what `engine.generate(mode=...)`, `dflash run --mode`, `dflash bench --modes`, the
bench document's sections and GenerationResult.mode all say. Every other list of modes (bench,
reports, the CLI's choices and help) derives from MODES below.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    name: str
    label: str  # what reports and tables call it
    speculative: bool  # proposes and verifies: acceptance statistics, a speedup over plain, the lossless check
    uses_draft: bool  # runs the draft model (its weights count toward the bytes a step reads)
    help: str


MODES_INFO = (
    Mode("plain", "plain", False, False, "the target alone, one token a step (the baseline)"),
    Mode("dflash", "dflash", True, True, "the DFlash draft model proposes each block"),
    Mode("lookup", "prompt lookup", True, False, "suffix lookup in the prompt and output so far, no model"),
    Mode("hybrid", "hybrid", True, True, "suffix lookup or the draft model, chosen per step"),
)
MODES = tuple(m.name for m in MODES_INFO)
SPECULATIVE_MODES = tuple(m.name for m in MODES_INFO if m.speculative)
# Old names, still accepted as input and read from old files, each mapped to its mode. "pld" was
# lookup's name in the engine, `bench --modes`, results logs and bench documents of schema 1
# (bench/document.py keeps it as an alias key through schema 2); to be dropped with schema 3.
ALIASES = {"pld": "lookup"}


def canonical(name: str) -> str:
    """A mode name or alias as the mode's one name (an unknown name comes back unchanged)."""
    return ALIASES.get(name, name)


def mode_info(name: str) -> Mode:
    """The mode named `name` (or an alias of it); KeyError for an unknown name."""
    name = canonical(name)
    for m in MODES_INFO:
        if m.name == name:
            return m
    raise KeyError(name)
