"""The stage contract shared by every stage and the pipeline.

A stage is a function of (the recipe fields it uses, upstream artifacts, tool versions) to a
directory. The pipeline hashes `key_fields()` + the stage's `version` + upstream keys + tool
versions into the cache key, gives `run()` an empty temporary directory, and publishes it by
rename with a manifest once `run()` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class StageContext:
    recipe: Any  # dflash_cli.recipe.schema.Recipe
    out_dir: Path  # empty temporary directory; write every output here
    inputs: Mapping[str, Path]  # upstream stage name -> its published artifact directory
    progress: Callable[[str], None]  # short human progress messages ("loading target weights")


class Stage(Protocol):
    name: str
    version: int  # bump whenever the stage's output format or semantics change
    upstream: tuple[str, ...]
    tools: tuple[str, ...]  # packages whose version can change the output (hashed into the key)

    def key_fields(self, recipe: Any) -> dict[str, Any]:
        """Every input this stage reads, as JSON-able values (checkpoint fingerprints included)."""

    def run(self, ctx: StageContext) -> dict[str, Any]:
        """Do the work into ctx.out_dir; return extra facts for the manifest."""
