"""Exports of the tiny pairs that the export tests compare, each built once per test run.

`SharedExports.get(family, variant)` exports the family's inject artifact the first time a test asks
and hands every later test the same directory (never to be changed). Variants:
  replicated  what `dflash build` exports: one traced layer grown to the real depth (replicate.py)
  full        replication refused, so every graph is traced whole: the export's fallback, and the
              plain path replication must equal (its progress notes are kept in `notes`)
  full-static the same for the static graphs only (their prefix-cache forms replicate through the same
              code: one family's full prefix-cache traces check that)
  retraced    replicated, with torch.onnx's decomposition re-trace forced (no_retrace.py's reference)
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from dflash_cli.exporting.options import ExportOptions, PairShape
from tests.fixtures.tiny_pairs import TinyPair

OPTIONS = ExportOptions(logits=True, validation="off")
REFUSAL = "refused for the reference"


def inject(pair: TinyPair, root: Path, **overrides) -> Path:
    """The pair's inject artifact, built by the real pipeline into `root`/cache."""
    from dflash_cli.cache.store import Cache
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import artifact_paths, build

    recipe = load_recipe(str(pair.write_recipe(root / "recipe.yaml", **overrides)))
    cache = Cache(root / "cache")
    build(recipe, cache, upto="inject")
    return artifact_paths(recipe, cache, ("inject",))["inject"]


def export(
    src: Path, out: Path, options: ExportOptions = OPTIONS, *, full: bool = False, retrace: bool = False
) -> list[str]:
    """export_pair of `src` into a new directory `out` (prefill of two blocks, ctx_len 96); returns the
    progress notes. `full`: replication refused (every graph traced whole, as the fallback does);
    `retrace`: torch.onnx's decomposition re-trace forced."""
    from dflash_cli.exporting import replicate
    from dflash_cli.exporting.graphs import export_pair
    from dflash_cli.modeling.loading import load_pair_info

    def refuse(*args, **kwargs):
        raise replicate.ReplicationError(REFUSAL)

    pair = load_pair_info(src)
    shape = PairShape(pair["block_size"], 2 * pair["block_size"], 96, pair["hidden_size"])
    out.mkdir()
    notes: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        if full:
            mp.setattr(replicate, "replicate_layers", refuse)
        if retrace:
            mp.setenv("DFLASH_EXPORT_RETRACE", "1")
        export_pair(src, out, shape, options, notes.append)
    return notes


class SharedExports:
    def __init__(self, root: Path, pairs: dict[str, TinyPair]) -> None:
        self.root, self.pairs = root, pairs
        self._injected: dict[str, Path] = {}
        self.notes: dict[tuple[str, str], list[str]] = {}

    def injected(self, family: str) -> Path:
        if family not in self._injected:
            self._injected[family] = inject(self.pairs[family], self.root / family / "build")
        return self._injected[family]

    def get(self, family: str, variant: str) -> Path:
        out = self.root / family / variant
        if (family, variant) not in self.notes:
            shutil.rmtree(out, ignore_errors=True)  # what a failed attempt left
            options = replace(OPTIONS, prefix_graphs=False) if variant == "full-static" else OPTIONS
            notes = export(
                self.injected(family), out, options, full=variant.startswith("full"), retrace=variant == "retraced"
            )
            self.notes[family, variant] = notes
        return out
