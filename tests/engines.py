"""Build tiny pairs through the real pipeline (convert -> compile) and open them as engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.fixtures.tiny_pairs import TinyPair


def build_recipe(pair: TinyPair, root: Path, **overrides: Any):
    from dflash_cli.cache import Cache
    from dflash_cli.pipeline import build
    from dflash_cli.recipe import load_recipe

    path = pair.write_recipe(root / "recipe.yaml", **overrides)
    recipe = load_recipe(str(path))
    cache = Cache(root / "cache")
    build(recipe, cache)
    return recipe, cache


def open_engine(pair: TinyPair, root: Path, **overrides: Any):
    from dflash_cli.decoding.engine import Engine

    recipe, cache = build_recipe(pair, root, **overrides)
    return Engine.load(recipe, cache)
