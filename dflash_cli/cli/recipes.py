"""`dflash recipes list | show`: what recipes exist and what a recipe resolves to."""

from __future__ import annotations

from typing import Annotated

import typer

from dflash_cli.cli.common import JsonOpt, SetOpt, examples, handle_errors, make_table, print_json, print_table
from dflash_cli.errors import RecipeError
from dflash_cli.recipe.files import list_recipes
from dflash_cli.recipe.schema import load_recipe

recipes_app = typer.Typer(help="List and inspect recipes.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(recipes_app, name="recipes")


@recipes_app.command("list", epilog=examples("dflash recipes list", "dflash recipes list --json"))
@handle_errors
def list_command(json_: JsonOpt = False) -> None:
    """List the shipped recipes with their target and draft (invalid ones show the problem)."""
    rows = []
    for name, path in list_recipes().items():
        try:
            recipe = load_recipe(str(path))
        except RecipeError as err:
            rows.append({"name": name, "path": str(path), "error": err.message})
            continue
        rows.append(
            {
                "name": name,
                "path": str(path),
                "family": recipe.family,
                "target": recipe.target.path,
                "draft": recipe.draft.path,
                "backend": recipe.compile.backend,
            }
        )
    if json_:
        print_json({"recipes": rows})
        return
    table = make_table("name", "family", "target", "draft", "backend")
    for row in rows:
        if "error" in row:
            table.add_row(row["name"], "invalid", row["error"], "", "")
        else:
            table.add_row(row["name"], row["family"], row["target"], row["draft"], row["backend"])
    print_table(table)


@recipes_app.command(
    "show", epilog=examples("dflash recipes show qwen3-8b", "dflash recipes show demo --set run.temperature=0.7")
)
@handle_errors
def show_command(
    name: Annotated[str, typer.Argument(help="Recipe name or path to a .yaml file.")],
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Print the effective recipe (defaults < YAML < --set) as YAML."""
    recipe = load_recipe(name, set_ or [])
    if json_:
        print_json(recipe.to_dict())
        return
    typer.echo(f"# {recipe.source}" if recipe.source else f"# {recipe.name}")
    typer.echo(recipe.to_yaml(), nl=False)
