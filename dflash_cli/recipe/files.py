"""Finding recipes: the shipped ones (or $DFLASH_RECIPES_DIR) by name, any other by its .yaml path."""

from __future__ import annotations

import os
from pathlib import Path

import dflash_cli
from dflash_cli.errors import RecipeError

DEFAULT_RECIPE = "demo"
RECIPE_SUFFIXES = (".yaml", ".yml")


def recipes_dir() -> Path:
    """The shipped recipes (`<repo>/recipes`), or $DFLASH_RECIPES_DIR."""
    env = os.environ.get("DFLASH_RECIPES_DIR")
    if env:
        return Path(env)
    # The package carries the shipped recipes and demo pair (symlinks to the repo's recipes/ and models/
    # in a checkout, copies in a wheel), so an installed `dflash` finds them wherever it runs.
    return Path(dflash_cli.__file__).parent / "shipped" / "recipes"


def list_recipes() -> dict[str, Path]:
    """Recipe name -> YAML file, sorted by name."""
    directory = recipes_dir()
    if not directory.is_dir():
        return {}
    files = [p for p in directory.iterdir() if p.suffix in RECIPE_SUFFIXES and p.is_file()]
    return {p.stem: p for p in sorted(files, key=lambda p: p.stem)}


def find_recipe(name_or_path: str) -> Path:
    """A path ending in .yaml/.yml is used as is; anything else is a name in the recipes directory."""
    if name_or_path.endswith(RECIPE_SUFFIXES):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise RecipeError(f"recipe file not found: {name_or_path}", hint="check the path passed to --recipe")
        return path
    available = list_recipes()
    if name_or_path in available:
        return available[name_or_path]
    names = ", ".join(available) or "none"
    guess = did_you_mean(name_or_path, available)
    raise RecipeError(
        f"unknown recipe {name_or_path!r}{guess}",
        hint=f"available recipes: {names} (or pass a path to a .yaml file)",
    )


def did_you_mean(word: str, choices) -> str:
    """`; did you mean 'x'?` for the closest choice, or nothing."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
